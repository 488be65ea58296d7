"""Checkpoints: every damaged, missing, foreign or too-late file is refused on every worker,
before the first step, naming the file and the worker; a clean resume is bit-identical."""
import io
import re
import shutil
import zipfile

import pytest
import torch
from torch import nn

from procs import checksums, train_job
from worker import checkpoint
from worker.checkpoint import CheckpointError, Damaged, Finding

JOB = {"model": "cnn", "optimizer": "sgd"}


def _small(tmp_path, step=3, **meta):
    """A checkpoint of a tiny model with momentum state, and the file's bytes."""
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    path = tmp_path / "worker0.pt"
    checkpoint.save(path, model, opt, **{"step": step, "workers": 2, "rank": 0, "job": JOB, **meta})
    return model, path, path.read_bytes()


def test_a_checkpoint_reads_back_what_was_saved_and_leaves_no_temporary_file(tmp_path):
    model, path, _ = _small(tmp_path)
    meta, state = checkpoint.read(path)
    assert (meta["step"], meta["workers"], meta["rank"], meta["job"]) == (3, 2, 0, JOB)
    assert all(torch.equal(state["model"][k], v) for k, v in model.state_dict().items())
    assert state["optimizer"]["state"][0]["momentum_buffer"].abs().sum() > 0
    assert [p.name for p in tmp_path.iterdir()] == ["worker0.pt"]


def test_every_flipped_byte_and_every_truncation_is_found_before_torch_reads_it(tmp_path):
    _, path, blob = _small(tmp_path)
    reasons = set()
    for i in range(len(blob)):
        path.write_bytes(blob[:i] + bytes([blob[i] ^ 0xFF]) + blob[i + 1:])
        with pytest.raises(Damaged) as err:
            checkpoint.read(path)
        reasons.add(str(err.value).split(":")[0].split(" (")[0])
    assert reasons <= {"checksum mismatch", "not an adtopk-ps checkpoint", "truncated"}, reasons
    for n in range(len(blob)):
        path.write_bytes(blob[:n])
        with pytest.raises(Damaged, match="empty file" if n == 0 else "truncated|checksum mismatch"):
            checkpoint.read(path)
    path.write_bytes(blob[:len(blob) // 2])
    with pytest.raises(Damaged, match=r"truncated: \d+ of \d+ payload bytes"):
        checkpoint.read(path)


def test_a_file_of_the_old_format_is_not_taken_for_a_checkpoint(tmp_path):
    path = tmp_path / "worker0.pt"
    torch.save({"model": {}, "optimizer": {}, "step": 3}, path)
    with pytest.raises(Damaged, match="not an adtopk-ps checkpoint"):
        checkpoint.read(path)


def test_a_checkpoint_saved_on_a_gpu_loads_on_the_cpu(tmp_path):
    """The same file with every storage tagged cuda:0, as a GPU run writes it: read() maps it
    to the CPU (a plain torch.load needs CUDA), and the model follows its own device."""
    model, path, blob = _small(tmp_path)
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": {}}, buffer)
    relocated = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(buffer.getvalue())) as zin, \
            zipfile.ZipFile(relocated, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            data = zin.read(info)
            if info.filename.endswith("/data.pkl"):
                assert data.count(b"X\x03\x00\x00\x00cpu") == 1  # memoised after its first use
                data = data.replace(b"X\x03\x00\x00\x00cpu", b"X\x06\x00\x00\x00cuda:0")
            zout.writestr(info, data)
    payload = relocated.getvalue()
    meta = {"job": JOB, "rank": 0, "step": 3, "workers": 2}
    path.write_bytes(checkpoint.header_for(meta, payload) + payload)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA"):
            torch.load(io.BytesIO(payload), weights_only=True)
    _, state = checkpoint.read(path)
    assert {t.device.type for t in state["model"].values()} == {"cpu"}
    fresh = nn.Linear(3, 2)
    fresh.load_state_dict(state["model"])
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), model.parameters()))


def test_the_wrapped_optimizers_residuals_come_back_on_the_models_device(tmp_path, device, session):
    """Saved from a DistributedOptimizer on ``device``: read to the CPU, loaded into a fresh one
    on the CPU, with momentum and error-feedback residuals intact, and both take the same step."""
    import adtopk_ps.torch as bps

    def job(on):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(40, 500), nn.ReLU(), nn.Linear(500, 3)).to(on)
        opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                       model.named_parameters(),
                                       compression={"compressor": "adtopk", "k": 0.01, "ef": "vanilla"})
        return model, opt

    def step(model, opt, seed):
        torch.manual_seed(seed)
        opt.zero_grad()
        model(torch.randn(2, 40, device=next(model.parameters()).device)).sum().backward()
        opt.step()

    model, opt = job(device)
    step(model, opt, 1)
    path = tmp_path / "worker0.pt"
    checkpoint.save(path, model, opt, step=1, workers=1, rank=0, job=JOB)
    _, state = checkpoint.read(path)
    residuals = state["optimizer"]["adtopk_ps"]["compression"]["residuals"]
    assert residuals["0.weight#0"].device.type == "cpu" and residuals["0.weight#0"].abs().sum() > 0
    restored, restored_opt = job("cpu")
    restored.load_state_dict(state["model"])
    restored_opt.load_state_dict(state["optimizer"])
    again = restored_opt.state_dict()["adtopk_ps"]["compression"]["residuals"]
    assert again.keys() == residuals.keys() and all(torch.equal(again[k], residuals[k]) for k in again)
    step(model, opt, 2)
    step(restored, restored_opt, 2)
    assert all(torch.equal(a.cpu(), b) for a, b in zip(model.parameters(), restored.parameters()))


def test_the_decision_is_resume_all_fresh_all_or_refuse():
    def found(rank, state, step=None, reason=""):
        return Finding(rank, f"/ckpt/worker{rank}.pt", state, reason, step)
    assert checkpoint.decide([found(0, "valid", 20), found(1, "valid", 20)]) == 20
    assert checkpoint.decide([found(0, "absent"), found(1, "off")]) is None
    with pytest.raises(CheckpointError, match=r"worker 0 \(/ckpt/worker0.pt\) would resume at step "
                                              r"20, worker 1 \(/ckpt/worker1.pt\) would start fresh"):
        checkpoint.decide([found(0, "valid", 20), found(1, "absent")])
    with pytest.raises(CheckpointError, match="worker 0 at step 20 .*, worker 1 at step 25"):
        checkpoint.decide([found(0, "valid", 20), found(1, "valid", 25)])
    with pytest.raises(CheckpointError, match="worker 1: /ckpt/worker1.pt is damaged: empty file"):
        checkpoint.decide([found(0, "valid", 20), found(1, "damaged", reason="empty file")])


# --- the training job on real local clusters --------------------------------------------

STEPS = 8


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """An uninterrupted run; one stopped after 4 of its 8 steps (checkpoints at step 4); that
    one resumed to the end in a copy (checkpoints at step 8)."""
    base = tmp_path_factory.mktemp("checkpoints")
    at4, at8 = base / "at4", base / "at8"
    straight = train_job(2, 1, "--steps", str(STEPS), "--checksums", "--set", "progress=false")
    first = train_job(2, 1, "--steps", str(STEPS), "--checksums", "--stop-after", "4",
                      "--checkpoint-dir", str(at4), "--set", "progress=false")
    assert first.returncode == 0, first.stdout[-3000:]
    shutil.copytree(at4, at8)
    resumed = train_job(2, 1, "--steps", str(STEPS), "--checksums", "--checkpoint-dir", str(at8),
                        "--set", "progress=false")
    return {"straight": straight, "first": first, "resumed": resumed, "at4": at4, "at8": at8}


def test_a_resumed_run_matches_an_uninterrupted_one_bit_for_bit(runs):
    for name in ("straight", "first", "resumed"):
        assert runs[name].returncode == 0, runs[name].stdout[-3000:]
    want, got = checksums(runs["straight"].stdout), checksums(runs["resumed"].stdout)
    assert sorted(checksums(runs["first"].stdout)) == [1, 2, 3, 4]
    assert sorted(got) == list(range(5, STEPS + 1))
    assert all(got[step] == want[step] for step in got)  # model, optimizer and residuals came back
    assert {p.name for p in runs["at8"].iterdir()} == {"worker0.pt", "worker1.pt"}


def _refused(tmp_path, runs, *args, workers=2, steps=STEPS, setup=None):
    """The job resumed from a copy of the step-4 checkpoints changed by ``setup``: it must
    fail before any step, on every worker at once, and end within seconds."""
    directory = tmp_path / "ckpt"
    shutil.copytree(runs["at4"], directory)
    if setup is not None:
        setup(directory)
    result = train_job(workers, 1, "--steps", str(steps), "--checksums", "--checkpoint-dir",
                       str(directory), "--set", "progress=false", *args, timeout=90, timed=True)
    out = result.stdout
    assert result.returncode != 0, out[-3000:]
    assert not checksums(out), "a worker trained a step"
    refused = {}
    for t, line in result.arrivals:
        found = re.match(r"\[worker (\d+)\] worker: CheckpointError: checkpoints refused on every "
                         r"worker", line)
        if found:
            refused[int(found.group(1))] = t
    assert sorted(refused) == list(range(workers)), out[-3000:]  # every one, none left waiting
    assert max(refused.values()) - min(refused.values()) < 5, refused  # all at once
    assert result.ended - max(refused.values()) < 20, (result.ended, refused)  # and the job ended
    assert "Traceback" not in out, out[-3000:]
    return directory.resolve(), out


def _flip(path, at, n=64):
    blob = bytearray(path.read_bytes())
    blob[at:at + n] = bytes(b ^ 0xFF for b in blob[at:at + n])
    path.write_bytes(bytes(blob))


def test_flipped_bytes_in_one_workers_checkpoint_are_refused(tmp_path, runs):
    d, out = _refused(tmp_path, runs, setup=lambda d: _flip(d / "worker1.pt", 4000))
    assert re.search(rf"worker 1: {d}/worker1.pt is damaged: checksum mismatch", out), out[-3000:]
    assert "worker 0: " not in out


def test_an_empty_and_a_truncated_checkpoint_are_refused(tmp_path, runs):
    def damage(d):
        (d / "worker0.pt").write_bytes(b"")
        with open(d / "worker1.pt", "r+b") as f:
            f.truncate(f.seek(0, 2) // 2)
    d, out = _refused(tmp_path, runs, setup=damage)
    assert f"worker 0: {d}/worker0.pt is damaged: empty file (0 bytes)" in out, out[-3000:]
    assert re.search(rf"worker 1: {d}/worker1.pt is damaged: truncated: \d+ of \d+ payload bytes",
                     out), out[-3000:]


def test_a_checkpoint_missing_on_one_worker_is_refused_naming_both(tmp_path, runs):
    d, out = _refused(tmp_path, runs, setup=lambda d: (d / "worker0.pt").unlink())
    assert (f"worker 1 ({d}/worker1.pt) would resume at step 4, worker 0 ({d}/worker0.pt) would "
            f"start fresh") in out, out[-3000:]


def test_checkpoints_of_another_cluster_shape_are_refused(tmp_path, runs):
    d, out = _refused(tmp_path, runs, workers=3)
    for rank in (0, 1):
        assert (f"worker {rank}: {d}/worker{rank}.pt is foreign: saved by worker {rank} of 2, this "
                f"is worker {rank} of 3") in out, out[-3000:]


def test_checkpoints_of_another_model_are_refused(tmp_path, runs):
    d, out = _refused(tmp_path, runs, "--set", "model=mlp")
    for rank in (0, 1):
        assert (f"worker {rank}: {d}/worker{rank}.pt is foreign: saved by another job: "
                f"model='cnn' where this job has 'mlp'") in out, out[-3000:]


def test_checkpoints_at_or_past_the_last_step_are_refused(tmp_path, runs):
    d, out = _refused(tmp_path, runs, steps=4)
    for rank in (0, 1):
        assert (f"worker {rank}: {d}/worker{rank}.pt is too late: at step 4, at or beyond the "
                f"job's 4 steps") in out, out[-3000:]


def test_checkpoints_at_different_steps_are_refused(tmp_path, runs):
    d, out = _refused(tmp_path, runs, setup=lambda d: shutil.copy(runs["at8"] / "worker1.pt", d),
                      steps=30)
    assert (f"checkpoints at different steps: worker 0 at step 4 ({d}/worker0.pt), worker 1 at "
            f"step 8 ({d}/worker1.pt)") in out, out[-3000:]


def test_intact_checkpoints_of_two_different_runs_are_refused(tmp_path, runs):
    """Another run's checkpoint of the same job at the same step (here: another seed) is intact
    and matches in every field, but its parameters differ from the other worker's."""
    other = tmp_path / "other"
    made = train_job(2, 1, "--steps", str(STEPS), "--stop-after", "4", "--seed", "7",
                     "--checkpoint-dir", str(other), "--set", "progress=false")
    assert made.returncode == 0, made.stdout[-3000:]
    d, out = _refused(tmp_path, runs, setup=lambda d: shutil.copy(other / "worker1.pt", d))
    assert re.search(rf"they hold different parameters, so they come from different runs: worker 0 "
                     rf"\({d}/worker0.pt\) \w+; worker 1 \({d}/worker1.pt\) \w+", out), out[-3000:]


def test_a_save_that_fails_says_which_and_keeps_the_previous_checkpoint(tmp_path):
    """A full disk or a folder that cannot hold it: CheckpointError (the job's clean error,
    not a traceback) naming the worker, the step and the file; no .tmp is left behind."""
    from worker.checkpoint import CheckpointError, checkpoint_path, read, save
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    path = checkpoint_path(tmp_path, 0)
    save(path, model, opt, step=1, workers=1, rank=0, job={})
    full = tmp_path / "worker0.pt.tmp"
    full.mkdir()  # the temporary file cannot be written where a folder stands
    with pytest.raises(CheckpointError, match=r"worker 0: saving the step-2 checkpoint to .*worker0\.pt failed"):
        save(path, model, opt, step=2, workers=1, rank=0, job={})
    assert read(path)[0]["step"] == 1
