"""Workers that would push different things are refused at start-up, on every worker at once."""
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from adtopk_ps.compression import SparsificationPolicy, create
from adtopk_ps.torch import GradientCompression
from adtopk_ps.torch.agreement import compressor_label, describe, differences
from procs import bpslaunch, cluster_env, roles

ROOT = Path(__file__).resolve().parents[1]
PROGRAM = str(ROOT / "tests" / "programs" / "disagree.py")
WEIGHTS = "the compressor of '0.weight' and '2.weight'"
# each case's worker 1 differs from worker 0 in one respect (programs/disagree.py); the
# lines every worker must print, in order
EXPECTED = {
    "compressor": [f"workers disagree on {WEIGHTS}: worker 0 has adtopk(ratio=0.01, ef=vanilla), "
                   f"worker 1 has topk(ratio=0.01, ef=vanilla)"],
    "randomk": [f"workers disagree on {WEIGHTS}: worker 0 has adtopk(ratio=0.01, ef=vanilla), "
                f"worker 1 has randomk(ratio=0.01, ef=vanilla)"],
    "ratio": ["workers disagree on the sparsification policy: worker 0 has SparsificationPolicy("
              "ratio=0.01, min_compress_bytes=1024, budget=False), worker 1 has SparsificationPolicy("
              "ratio=0.05, min_compress_bytes=1024, budget=False)",
              f"workers disagree on {WEIGHTS}: worker 0 has adtopk(ratio=0.01, ef=vanilla), "
              f"worker 1 has adtopk(ratio=0.05, ef=vanilla)"],
    "ef": [f"workers disagree on {WEIGHTS}: worker 0 has adtopk(ratio=0.01, ef=vanilla), "
           f"worker 1 has adtopk(ratio=0.01, ef=none)"],
    # (the biases, dense on both, are not named: before, a shape error named one of them)
    "none": ["workers disagree on the sparsification policy: worker 0 has SparsificationPolicy("
             "ratio=0.01, min_compress_bytes=1024, budget=False), worker 1 has SparsificationPolicy("
             "ratio=1.0, min_compress_bytes=1024, budget=False)",
             f"workers disagree on {WEIGHTS}: worker 0 has adtopk(ratio=0.01, ef=vanilla), "
             f"worker 1 has dense"],
    # (before, both waited out the push_pull timeout in the all-reduce rendezvous)
    "transport": ["workers disagree on dense_transport: worker 0 has 'ps', worker 1 has 'allreduce'"],
    "shape": ["workers disagree on the shape of '0.weight': worker 0 has [64, 32], worker 1 has [65, 32]",
              "workers disagree on the shape of '0.bias': worker 0 has [64], worker 1 has [65]",
              "workers disagree on the shape of '2.weight': worker 0 has [4, 64], worker 1 has [4, 65]"],
    "dtype": ["workers disagree on the dtype of '0.weight', '0.bias', '2.weight' and 1 more: "
              "worker 0 has float32, worker 1 has float64"],
    "passes": ["workers disagree on backward_passes_per_step: worker 0 has 1, worker 1 has 2"],
    "overlap": ["workers disagree on overlap: worker 0 has False, worker 1 has True"],
    "op": ["workers disagree on op: worker 0 has 'Average', worker 1 has 'Sum'"],
    "nonfinite": ["workers disagree on nonfinite: worker 0 has 'stop', worker 1 has 'skip'"],
    "names": ["workers disagree on the parameter '0.weight': worker 0 has float32[64, 32], worker 1 has none",
              "workers disagree on the parameter '0.bias': worker 0 has float32[64], worker 1 has none",
              "workers disagree on the parameter '2.weight': worker 0 has float32[4, 64], worker 1 has none",
              "workers disagree on the parameter '2.bias': worker 0 has float32[4], worker 1 has none",
              "workers disagree on the parameter 'net.0.weight': worker 0 has none, "
              "worker 1 has float32[64, 32]",
              "(and 3 more)"],
}
REFUSED = re.compile(r"REFUSED case=(\w+) rank=(\d) after ([\d.]+) s: (.*)")


def _refusals(out: str, workers: int) -> dict[tuple[str, int], tuple[float, list[str]]]:
    """(case, rank) -> (seconds the optimizer took to refuse, the message's lines)."""
    found = {}
    for rank in range(workers):
        case = None
        for line in re.findall(rf"^\[worker {rank}\] (.*)$", out, re.M):
            refused = REFUSED.fullmatch(line)
            if refused:
                case, seconds = refused[1], float(refused[3])
                assert int(refused[2]) == rank
                found[case, rank] = (seconds, [refused[4]])
            elif case is not None and (line.startswith("workers disagree") or line.startswith("(and")):
                found[case, rank][1].append(line)
            else:
                case = None
    return found


def test_every_difference_is_refused_on_every_worker_at_once_naming_both_sides():
    # every case in one cluster, one after another: a refusal leaves the cluster as it was,
    # so the last case, set up alike, still trains (and to identical replicas)
    result = bpslaunch("--local", "--num-workers", "2", "--num-servers", "1", "--timeout", "100",
                       "--", sys.executable, PROGRAM, *EXPECTED, "agree", timeout=120)
    out = result.stdout
    assert result.returncode != 0, out[-3000:]
    refusals = _refusals(out, 2)
    for case, lines in EXPECTED.items():
        for rank in range(2):
            assert (case, rank) in refusals, (case, rank, out[-5000:])
            seconds, message = refusals[case, rank]
            assert message == lines, (case, rank)
            assert seconds < 5, (case, rank, seconds)
    trained = re.findall(r"TRAINED case=agree rank=(\d) checksum=(\w+)", out)
    assert sorted(rank for rank, _ in trained) == ["0", "1"], out[-3000:]
    assert len({digest for _, digest in trained}) == 1


def _outputs(procs: list, timeout: float) -> list[str]:
    """Every process's output, each within ``timeout``; none is left running."""
    try:
        return [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_ddp_hook_states_that_disagree_are_refused_on_every_rank(tmp_path):
    init = tmp_path / "init"
    procs = [subprocess.Popen([sys.executable, PROGRAM, "--ddp", str(r), "2", str(init), "compressor"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    outs = _outputs(procs, 60)
    for rank, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 3, out[-3000:]
        assert f"REFUSED case=compressor rank={rank}" in out
        assert EXPECTED["compressor"][0] in out


def _two_jobs(*per_rank: list[str]) -> list[tuple[int, str]]:
    """The training job on two workers started by hand, as two hosts would be, each with its
    own extra arguments."""
    with roles(2, 1) as (config, _):
        env = cluster_env(2, 1, config.root_port, DMLC_ROLE="worker")
        workers = [subprocess.Popen(
            [sys.executable, "-m", "worker", "--config", str(ROOT / "configs" / "digits-mlp.yaml"),
             "--steps", "5", *extra],
            env={**env, "DMLC_WORKER_ID": str(rank)}, cwd=ROOT, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True) for rank, extra in enumerate(per_rank)]
        outs = _outputs(workers, 90)
    return [(p.returncode, out) for p, out in zip(workers, outs)]


def test_training_jobs_started_with_different_compressors_exit_non_zero_naming_both():
    for code, out in _two_jobs(["--compressor", "adtopk-i"], ["--compressor", "topk"]):
        assert code == 1, out[-3000:]
        # the job compares its configs first; the optimizer's own check is the program's above
        assert "worker: Disagreement: workers disagree on the job config: " \
               "compression.compressor: worker 0 has 'adtopk-i', worker 1 has 'topk'\n" in out, \
            out[-3000:]
        assert "Traceback" not in out


def test_training_jobs_with_different_learning_rates_exit_non_zero_naming_both():
    """The job reads its learning rate and schedule from each worker's own config every step,
    which no broadcast of optimizer state corrects: the configs themselves must agree."""
    for code, out in _two_jobs([], ["--lr", "0.2", "--set", "lr_schedule.warmup_steps=3"]):
        assert code == 1, out[-3000:]
        assert "worker: Disagreement: workers disagree on the job config: lr_schedule.warmup_steps:" \
               in out and "optimizer.lr: worker 0 has 0.05, worker 1 has 0.2" in out, out[-3000:]
        assert "Traceback" not in out


def _model(hidden=8):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 4))


def _described(named, spec="topk", fusion=None, **settings):
    compression = GradientCompression(spec, SparsificationPolicy(0.01, min_compress_bytes=1024))
    compression.plan(named)
    return describe(named, compression, settings, fusion)


def test_alike_descriptions_have_no_differences():
    named = list(_model().named_parameters())
    assert differences([_described(named, fusion=64)] * 3) == []


def test_reordered_parameters_are_named_at_the_first_position_that_differs():
    named = list(_model().named_parameters())
    swapped = [named[1], named[0], *named[2:]]
    assert differences([_described(named), _described(swapped)]) == [
        "workers disagree on the order of the parameters: worker 0 has '0.weight' at position 0, "
        "worker 1 has '0.bias'"]


def test_workers_that_differ_alike_share_one_line():
    named = list(_model().named_parameters())
    mine, theirs = _described(named), _described(named, spec={"compressor": "topk", "ef": "vanilla"})
    assert differences([mine, theirs, theirs, mine, theirs]) == [
        "workers disagree on the compressor of '0.weight': worker 0 has topk(ratio=0.01, ef=none), "
        "workers 1, 2 and 4 have topk(ratio=0.01, ef=vanilla)"]


def test_fusion_buckets_are_named_where_nothing_else_differs():
    named = list(_model().named_parameters())
    # 16 bytes hold neither bias alone (32 and 16 bytes): no bucket at all
    assert differences([_described(named, fusion=64), _described(named, fusion=16)]) == [
        "workers disagree on the fusion bucket 'fused.0': worker 0 has members '2.bias' and "
        "'0.bias', worker 1 has none"]


@pytest.mark.parametrize("spec, label", [
    ("threshold", "threshold(ratio=0.01, ef=none)"),
    ({"compressor": "threshold", "tau": 9, "ef": "vanilla"}, "threshold(ratio=0.01, tau=9, ef=vanilla)"),
    ({"compressor": "adtopk", "k": 0.1, "layout": "rows", "value_dtype": "fp16"},
     "adtopk(ratio=0.1, layout=rows, value_dtype=float16, ef=none)"),
    ({"compressor": "dgc", "sample_ratio": 0.5}, "dgc(ratio=0.01, sample_ratio=0.5, ef=none)"),
])
def test_compressor_labels_name_every_parameter_off_its_default(spec, label):
    assert compressor_label(create(spec)) == label
