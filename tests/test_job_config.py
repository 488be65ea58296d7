"""The job config is validated in full, with errors naming key, value and what is valid,
before the worker joins the cluster."""
import os
import subprocess
import sys
import time

import pytest

from adtopk_ps.launcher import free_port
from worker import config
from worker.validate import ConfigError

CONFIG = "configs/digits-cnn.yaml"


def _load(*sets, extra=()):
    return config.load(config.parse_args(["--config", CONFIG, *extra,
                                          *[a for s in sets for a in ("--set", s)]]))


@pytest.mark.parametrize("name", sorted(os.listdir("configs")))
def test_every_shipped_config_is_valid(name):
    cfg = config.load(config.parse_args(["--config", f"configs/{name}"]))
    assert cfg["nonfinite"] == "stop"


@pytest.mark.parametrize("override, words", [
    ("batch_size=-32", "batch_size=-32: must be an integer >= 1"),
    ("batch_size=0", "batch_size=0: must be an integer >= 1"),
    ("batch_size=2.5", "batch_size=2.5: must be an integer >= 1"),
    ("steps=-5", "steps=-5: must be an integer >= 1 or null"),
    ("epochs=0", "epochs=0: must be an integer >= 1"),
    ("lr_schedule={warmup_stepz: 5}", "lr_schedule.warmup_stepz: unknown key; did you mean 'warmup_steps'?"),
    ("lr_schedule={name: cosin}", "lr_schedule.name='cosin': did you mean 'cosine'?"),
    ("lr_schedule={name: constant, gamma: 0.5}", "lr_schedule.gamma: unknown key"),
    ("lr_schedule={name: step, every: 0}", "lr_schedule.every=0: must be an integer >= 1"),
    ("lr_schedule={name: step, gamma: -1}", "lr_schedule.gamma=-1: must be a number > 0"),
    ("lr_schedule={warmup_steps: -1}", "lr_schedule.warmup_steps=-1: must be an integer >= 0"),
    ("compression.compressor=adtopkk", "compression.compressor='adtopkk': did you mean 'adtopk'?"),
    ("compression.k=0", "ratio must be a number in (0, 1], got 0"),
    ("compression.k=2", "ratio must be a number in (0, 1], got 2"),
    ("compression.kk=0.1", "compression.kk: unknown key; did you mean 'k'?"),
    ("compression.ef=bad", "ef must be one of"),
    ("compression={compressor: threshold, k: 0.1, tau: -1}", "config key compression="),
    ("compression={k: 0.1}", "needs a 'compressor' key"),
    ("compression=7", "compression=7: must be a mapping"),
    ("optimizer.lrr=0.1", "optimizer.lrr: unknown key; did you mean 'lr'?"),
    ("optimizer.lr=0", "optimizer.lr=0: must be a number > 0"),
    ("optimizer.lr=1e-3", "YAML reads this as a string"),
    ("optimizer.momentum=-1", "torch.optim.SGD refuses it: Invalid momentum value: -1"),
    ("optimizer.nesterov=1", "optimizer.nesterov=1: must be true or false"),
    ("optimizer={name: adam, betas: [0.9, 2.0]}", "torch.optim.Adam refuses it"),
    ("optimizer={name: adam, betas: 0.9}", "optimizer.betas=0.9: must be a list of 2 numbers"),
    ("optimizer={name: adam, momentum: 0.9}", "optimizer.momentum: unknown key"),
    ("optimizer={name: adamm}", "optimizer.name='adamm': did you mean 'adam'?"),
    ("model=cnnn", "model='cnnn': did you mean 'cnn'?"),
    ("model_args={sidee: 8}", "model_args.sidee: unknown key; did you mean 'side'?"),
    ("model_args={classes: 0}", "model_args.classes=0: must be an integer >= 1"),
    ("dataset=digitz", "dataset='digitz': did you mean 'digits'?"),
    ("dataset_args={count: 5}", "dataset_args.count: unknown key; valid: []"),
    ("min_compress_bytes=-1", "min_compress_bytes=-1: must be an integer >= 0"),
    ("budget=maybe", "budget='maybe': must be true or false"),
    ("cost_model=1", "cost_model=1: must be true or false"),
    ("dense_transport=grpc", "dense_transport='grpc': must be one of ['allreduce', 'auto', 'ps']"),
    ("eval_every=0", "eval_every=0: must be an integer >= 1"),
    ("verify_every=-1", "verify_every=-1: must be an integer >= 0"),
    ("checkpoint_every=0", "checkpoint_every=0: must be an integer >= 1"),
    ("seed=-1", "seed=-1: must be an integer >= 0"),
    ("metrics=/nonexistent-dir/m.jsonl", "its folder /nonexistent-dir does not exist"),
    ("metrics=3", "metrics=3: must be a file path or null"),
    ("progress=1", "progress=1: must be true or false"),
    ("nonfinite=ignore", "nonfinite='ignore': must be one of ['skip', 'stop']"),
    ("batchsize=3", "batchsize: unknown key; did you mean 'batch_size'?"),
    ("batch_size.x=1", "config key batch_size is not a mapping"),
    ("batch_size=[1", "is not valid YAML"),
    ("device=gpu", "device='gpu': did you mean 'cuda'? must be one of ['auto', 'cpu', 'cuda']"),
    ("device=cude", "device='cude': did you mean 'cuda'? must be one of ['auto', 'cpu', 'cuda']"),
    ("device=cuda:1", "device='cuda:1': name no GPU index: every worker takes the GPU of its local rank"),
    ("device=metal", "device='metal': must be one of ['auto', 'cpu', 'cuda']"),
    ("device=0", "device=0: must be one of ['auto', 'cpu', 'cuda']"),
    ("devise=cpu", "devise: unknown key; did you mean 'device'?"),
    ("elastic={commit_every: 0}", "elastic.commit_every=0: must be an integer >= 1"),
    ("elastic={commit: 1}", "elastic.commit: unknown key; did you mean 'commit_every'?"),
    ("elastic={min_workers: 3, max_workers: 2}", "must not be above elastic.max_workers (2)"),
    ("elastic={min_workers: 0}", "elastic.min_workers=0: must be an integer >= 1 or null"),
])
def test_a_bad_value_is_refused_naming_key_value_and_what_is_valid(override, words):
    with pytest.raises(ConfigError) as caught:
        _load(override)
    assert words in str(caught.value)


def test_datasets_args_follow_the_dataset():
    cfg = _load("dataset=synthetic-images", "model=resnet18", "dataset_args={count: 64}")
    assert cfg["dataset_args"] == {"count": 64}
    with pytest.raises(ConfigError, match=r"dataset_args\.cout: unknown key; did you mean 'count'"):
        _load("dataset=synthetic-images", "dataset_args={cout: 64}")


def test_good_overrides_pass():
    cfg = _load("nonfinite=skip", "steps=null", "optimizer={name: adamw, lr: 0.001, betas: [0.9, 0.99]}",
                "lr_schedule={name: step, every: 10, gamma: 0.5}", "compression.compressor=topk")
    assert cfg["nonfinite"] == "skip" and cfg["steps"] is None
    assert _load("compression={compressor: none}")["compression"] == {"compressor": "none"}
    assert _load("compression=randomk")["compression"] == {"compressor": "randomk"}


@pytest.mark.parametrize("flags, words", [
    (["--batch-size", "0"], "batch_size=0"),
    (["--steps", "-5"], "steps=-5"),
    (["--lr", "-0.1"], "optimizer.lr=-0.1"),
    (["--ratio", "0"], "ratio must be a number in (0, 1], got 0"),
    (["--compressor", "nope"], "compression.compressor='nope'"),
    (["--stop-after", "0"], "--stop-after=0: must be an integer >= 1"),
])
def test_command_line_flags_are_validated_alike(flags, words):
    with pytest.raises(ConfigError) as caught:
        _load(extra=flags)
    assert words in str(caught.value)


def test_the_worker_refuses_a_bad_config_before_joining_the_cluster():
    """No scheduler listens at the address and the registration timeout is long: a worker that
    joined first would wait; it exits 2 at once, naming the key."""
    env = {**os.environ, "DMLC_ROLE": "worker", "DMLC_NUM_WORKER": "1", "DMLC_NUM_SERVER": "1",
           "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": str(free_port()),
           "DMLC_WORKER_ID": "0", "PS_REGISTER_TIMEOUT_S": "600"}
    began = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "worker", "--config", CONFIG, "--set",
                             "lr_schedule={warmup_stepz: 5}"], env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == ("worker: config key lr_schedule.warmup_stepz: unknown key; "
                                     "did you mean 'warmup_steps'? valid: ['name', 'warmup_steps']")
    print(f"refused in {time.monotonic() - began:.1f} s")


@pytest.mark.parametrize("flag", ["--checkpoint-dir", "--metrics-out"])
def test_outputs_that_cannot_be_written_are_refused_before_joining(tmp_path, flag):
    """A checkpoint folder or summary file under a path that is not a folder (a read-only
    one, for users that are not root) is named at once, exit 2, before the cluster forms:
    not after the training it would have lost."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    result = subprocess.run([sys.executable, "-m", "worker", "--config", CONFIG, flag,
                             str(blocker / "out")], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "DMLC_ROLE": "worker"})
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"{flag} {blocker / 'out'}: cannot write there" in result.stderr
