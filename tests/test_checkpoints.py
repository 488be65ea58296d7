"""Checkpoints: generations committed across the workers; a resume from the newest step every
worker holds intact, bit-identical to a run never stopped; every file that cannot resume the
job refused on every worker before the first step, naming the file and the worker; a full
disk costs only the steps since the last commit."""
import io
import re
import shutil
import zipfile

import pytest
import torch
from hypothesis import given, strategies as st
from torch import nn

from procs import checksums, train_job
from worker import checkpoint
from worker.checkpoint import CheckpointError, Finding, generation_path
from worker.checkpoint_file import Damaged, header_for, read, write

JOB = {"model": "cnn", "optimizer": "sgd"}


def _small(tmp_path, step=3, **meta):
    """A checkpoint of a tiny model with momentum state, and the file's bytes."""
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    path = generation_path(tmp_path, 0, step)
    write(path, model, opt, {"step": step, "workers": 2, "rank": 0, "job": JOB, **meta})
    return model, path, path.read_bytes()


def test_a_checkpoint_reads_back_what_was_saved_and_leaves_no_temporary_file(tmp_path):
    model, path, _ = _small(tmp_path)
    meta, state = read(path)
    assert (meta["step"], meta["workers"], meta["rank"], meta["job"]) == (3, 2, 0, JOB)
    assert all(torch.equal(state["model"][k], v) for k, v in model.state_dict().items())
    assert state["optimizer"]["state"][0]["momentum_buffer"].abs().sum() > 0
    assert [p.name for p in tmp_path.iterdir()] == ["worker0-step00000003.pt"]


def test_every_flipped_byte_and_every_truncation_is_found_before_torch_reads_it(tmp_path):
    _, path, blob = _small(tmp_path)
    reasons = set()
    for i in range(len(blob)):
        path.write_bytes(blob[:i] + bytes([blob[i] ^ 0xFF]) + blob[i + 1:])
        with pytest.raises(Damaged) as err:
            read(path)
        reasons.add(str(err.value).split(":")[0].split(" (")[0])
    assert reasons <= {"checksum mismatch", "not an adtopk-ps checkpoint", "truncated"}, reasons
    for n in range(len(blob)):
        path.write_bytes(blob[:n])
        with pytest.raises(Damaged, match="empty file" if n == 0 else "truncated|checksum mismatch"):
            read(path)
    path.write_bytes(blob[:len(blob) // 2])
    with pytest.raises(Damaged, match=r"truncated: \d+ of \d+ payload bytes"):
        read(path)


def test_a_file_of_the_old_format_is_not_taken_for_a_checkpoint(tmp_path):
    path = tmp_path / "worker0.pt"
    torch.save({"model": {}, "optimizer": {}, "step": 3}, path)
    with pytest.raises(Damaged, match="not an adtopk-ps checkpoint"):
        read(path)


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
    path.write_bytes(header_for(meta, payload) + payload)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA"):
            torch.load(io.BytesIO(payload), weights_only=True)
    _, state = read(path)
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
    path = generation_path(tmp_path, 0, 1)
    write(path, model, opt, {"step": 1, "workers": 1, "rank": 0, "job": JOB})
    _, state = read(path)
    residuals = state["optimizer"]["adtopk_ps"]["compression"]["residuals"]
    # kept whole, not by partition (another job may cut the tensor otherwise)
    assert residuals["0.weight#*"].device.type == "cpu" and residuals["0.weight#*"].abs().sum() > 0
    restored, restored_opt = job("cpu")
    restored.load_state_dict(state["model"])
    restored_opt.load_state_dict(state["optimizer"])
    again = restored_opt.state_dict()["adtopk_ps"]["compression"]["residuals"]
    assert again.keys() == residuals.keys() and all(torch.equal(again[k], residuals[k]) for k in again)
    step(model, opt, 2)
    step(restored, restored_opt, 2)
    assert all(torch.equal(a.cpu(), b) for a, b in zip(model.parameters(), restored.parameters()))


def _found(rank, *steps, faults=(), committed=None, folder="/ckpt"):
    return Finding(rank, folder, {s: f"{folder}/worker{rank}-step{s:08d}.pt" for s in steps},
                   tuple(faults), committed)


def test_the_newest_step_every_worker_holds_is_resumed_and_what_was_passed_over_is_said():
    assert checkpoint.decide([_found(0, 10, 20), _found(1, 10, 20)], 100) == (20, [], [10, 20])
    step, notes, committed = checkpoint.decide([_found(0, 10, 20, committed=10),
                                                _found(1, 10, committed=10)], 100)
    assert (step, committed) == (10, [10])
    assert notes == ["worker 0's step 20 (/ckpt/worker0-step00000020.pt) is not held by every "
                     "worker, so it was never committed: removed"]
    damaged = ("/ckpt/worker1-step00000020.pt", "damaged", "checksum mismatch")
    step, notes, _ = checkpoint.decide([_found(0, 10, 20, committed=20),
                                        _found(1, 10, faults=[damaged], committed=20)], 100)
    assert step == 10 and notes[1:] == ["worker 1's /ckpt/worker1-step00000020.pt is damaged "
                                        "(checksum mismatch)",
                                        "step 20 was committed, but not every worker still holds it intact"]
    assert checkpoint.decide([_found(0), _found(1)], 100) == (None, [], [])
    assert checkpoint.decide([Finding(0, "", {}), Finding(1, "", {})], 100) == (None, [], [])


def test_files_no_worker_can_have_committed_are_passed_over_for_a_fresh_start():
    """The first save failed on one worker (or one died in it): the others' files were never
    committed, and no commit record reaches them."""
    step, notes, committed = checkpoint.decide([_found(0), _found(1, 4)], 100)
    assert (step, committed) == (None, [])
    assert notes == ["worker 1's step 4 (/ckpt/worker1-step00000004.pt) is not held by every "
                     "worker, so it was never committed: removed"]
    step, _, _ = checkpoint.decide([_found(0, 8, committed=4), _found(1, committed=4)], 100)
    assert step is None  # step 8 came after the last commit


def test_what_cannot_resume_one_job_is_refused_naming_each_worker_and_file():
    def refused(findings, total=100):
        with pytest.raises(CheckpointError) as err:
            checkpoint.decide(findings, total)
        assert str(err.value).startswith("checkpoints refused on every worker, none trains:")
        return str(err.value)
    assert ("no step is held intact by every worker: worker 0 holds step(s) 20 (/ckpt); worker 1 "
            "holds none (/ckpt) (step 20 was committed)") in refused([_found(0, 20, committed=20),
                                                                      _found(1, committed=20)])
    assert "worker 0 holds step(s) 20 (/ckpt); worker 1 has no --checkpoint-dir" in \
        refused([_found(0, 20, committed=20), Finding(1, "", {})])
    # with nothing held either: each commit would wait for the workers that never commit
    assert "--checkpoint-dir is given to some workers only: worker 0 has /ckpt; worker 1 has none" \
        in refused([_found(0), Finding(1, "", {})])
    assert "worker 0 holds step(s) 10, 20 (/ckpt); worker 1 holds step(s) 25" in \
        refused([_found(0, 10, 20, committed=10), _found(1, 25, committed=10)])
    empty = ("/ckpt/worker1-step00000020.pt", "damaged", "empty file (0 bytes)")
    assert "worker 1: /ckpt/worker1-step00000020.pt is damaged: empty file (0 bytes)" in \
        refused([_found(0, 20), _found(1, faults=[empty])])  # a damaged file may be the commit
    foreign = ("/ckpt/worker1-step00000005.pt", "foreign", "saved by another job: model='mlp' ...")
    assert "worker 1: /ckpt/worker1-step00000005.pt is foreign" in \
        refused([_found(0, 20), _found(1, 20, faults=[foreign])])  # even with a step in common
    out = refused([_found(0, 20), _found(1, 20)], total=20)
    assert "worker 1: /ckpt/worker1-step00000020.pt is too late: at step 20, at or beyond the job's 20" in out


@given(st.lists(st.frozensets(st.integers(1, 12), max_size=5), min_size=1, max_size=4),
       st.integers(1, 14), st.none() | st.integers(0, 12))
def test_the_decision_is_the_newest_common_step_whatever_each_worker_holds(holdings, total, record):
    findings = [_found(rank, *steps, committed=record) for rank, steps in enumerate(holdings)]
    common = frozenset.intersection(*holdings)
    held = [s for steps in holdings for s in steps]
    try:
        step, notes, committed = checkpoint.decide(findings, total)
    except CheckpointError as exc:
        assert (common and max(common) >= total) or \
            (not common and record is not None and record >= min(held)), exc
        return
    assert step == (max(common) if common else None) and (step is None or step < total)
    assert committed == sorted(common)
    assert len(notes) >= sum(1 for steps in holdings for s in steps if s not in common)
    assert checkpoint.decide(findings[::-1], total)[0] == step  # the order gathered does not matter


def _model():
    model = nn.Linear(3, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_a_commit_keeps_the_newest_generations_and_a_failed_one_keeps_them_all(tmp_path, session):
    """One worker (the session's cluster): each commit records itself and keeps ``keep``
    generations; a write that fails names the worker, the file and the step a rerun resumes
    from, whatever the record on disk says."""
    model, opt = _model()
    checkpoints = checkpoint.Checkpoints(tmp_path, keep=2, committed=[])
    for step in (1, 2, 3):
        checkpoints.commit(model, opt, step=step, job=JOB)
    assert sorted(checkpoint.generations(tmp_path, 0)) == [2, 3]
    assert checkpoint.survey(str(tmp_path), 0, 1, JOB).committed == 3
    (tmp_path / "worker0.commit").write_text('{"step": 40}')  # stale: another run's
    generation_path(tmp_path, 0, 4).with_suffix(".pt.tmp").mkdir()  # the file cannot be written
    with pytest.raises(CheckpointError, match=rf"the step-4 checkpoint is not committed: worker 0: "
                                              rf"saving to {tmp_path}/worker0-step00000004.pt failed "
                                              rf"\(Is a directory\); the job stops, and a rerun resumes "
                                              rf"from step 3, the last committed"):
        checkpoints.commit(model, opt, step=4, job=JOB)
    assert sorted(checkpoint.generations(tmp_path, 0)) == [2, 3]


def test_stray_files_named_like_generations_take_no_slot(tmp_path, session):
    """A file named like a newer generation (garbage, a directory) is never counted among the
    kept, so the committed ones stay; a name the job does not write (``step8``) is no step."""
    model, opt = _model()
    generation_path(tmp_path, 0, 99).write_text("garbage")
    (tmp_path / "worker0-step8.pt").write_text("")
    checkpoints = checkpoint.Checkpoints(tmp_path, keep=1, committed=[])
    for step in (4, 8, 12):
        checkpoints.commit(model, opt, step=step, job=JOB)
    assert sorted(checkpoint.generations(tmp_path, 0)) == [12, 99]
    assert (tmp_path / "worker0-step8.pt").exists()  # not ours: left alone
    found = checkpoint.survey(str(tmp_path), 0, 1, JOB)
    assert list(found.held) == [12] and found.faults[0][:2] == (str(generation_path(tmp_path, 0, 99)), "damaged")


# --- the training job on real local clusters --------------------------------------------

STEPS = 8


def _file(folder, rank, step):
    return generation_path(folder, rank, step)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """An uninterrupted run; one stopped after 4 of its 8 steps (checkpoints at step 4); that
    one resumed to the end in a copy (checkpoints at steps 4 and 8)."""
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


def _same_as_straight(runs, result, first_step):
    """``result`` trained steps ``first_step``..STEPS, each bit-identical to the run never stopped."""
    assert result.returncode == 0, result.stdout[-3000:]
    want, got = checksums(runs["straight"].stdout), checksums(result.stdout)
    assert sorted(got) == list(range(first_step, STEPS + 1))
    assert all(got[step] == want[step] for step in got)  # model, optimizer and residuals came back


def test_a_resumed_run_matches_an_uninterrupted_one_bit_for_bit(runs):
    for name in ("straight", "first"):
        assert runs[name].returncode == 0, runs[name].stdout[-3000:]
    assert sorted(checksums(runs["first"].stdout)) == [1, 2, 3, 4]
    _same_as_straight(runs, runs["resumed"], 5)
    assert "resuming from step 4, the newest step every worker holds intact" in runs["resumed"].stdout
    assert {p.name for p in runs["at8"].iterdir()} == {
        "worker0-step00000004.pt", "worker0-step00000008.pt", "worker0.commit",
        "worker1-step00000004.pt", "worker1-step00000008.pt", "worker1.commit"}


# servers that re-sparsify their answers (at one push's width) hold residuals back
HELD_BACK = {"BYTEPS_SERVER_COMPRESSOR": "topk"}


@pytest.fixture(scope="module")
def held_back(tmp_path_factory):
    """As ``runs``, with 2 servers that hold residuals back: uninterrupted, and stopped after
    4 of its 8 steps (checkpoints at step 4)."""
    at4 = tmp_path_factory.mktemp("held-back") / "at4"
    common = ("--steps", str(STEPS), "--checksums", "--set", "progress=false")
    straight = train_job(2, 2, *common, env=HELD_BACK)
    first = train_job(2, 2, *common, "--stop-after", "4", "--checkpoint-dir", str(at4), env=HELD_BACK)
    for result in (straight, first):
        assert result.returncode == 0, result.stdout[-3000:]
    return {"straight": straight, "at4": at4, "common": common}


def _resume_held_back(tmp_path, held_back, setup=lambda d: None, env=HELD_BACK):
    directory = tmp_path / "ckpt"
    shutil.copytree(held_back["at4"], directory)
    setup(directory)
    return train_job(2, 2, *held_back["common"], "--checkpoint-dir", str(directory), env=env)


def _without_servers(directory):
    path = _file(directory, 0, 4)
    meta, state = read(path)
    del state["servers"]
    buffer = io.BytesIO()
    torch.save(state, buffer)
    path.write_bytes(header_for({k: v for k, v in meta.items() if k != "bytes"}, buffer.getbuffer())
                     + buffer.getvalue())


def test_a_resumed_run_whose_servers_held_residuals_back_matches_an_uninterrupted_one(tmp_path, held_back):
    entries = read(_file(held_back["at4"], 0, 4))[1]["servers"]  # worker 0's file holds them
    assert entries and any(bool(e["residual"].any()) for e in entries)
    assert "servers" not in read(_file(held_back["at4"], 1, 4))[1]
    want = checksums(held_back["straight"].stdout)
    resumed = _resume_held_back(tmp_path / "with", held_back)
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    got = checksums(resumed.stdout)
    assert sorted(got) == list(range(5, STEPS + 1)) and all(got[s] == want[s] for s in got)
    # they matter: the same checkpoint without them resumes into another run
    other = _resume_held_back(tmp_path / "without", held_back, _without_servers)
    assert other.returncode == 0, other.stdout[-3000:]
    assert checksums(other.stdout)[5] != want[5]


def _refused_on_every_worker(result) -> str:
    out = result.stdout
    assert result.returncode != 0 and not checksums(out), out[-3000:]
    for rank in range(2):
        assert f"[worker {rank}] worker: CheckpointError: checkpoints refused on every worker" in out, out[-3000:]
    return out


def test_residuals_of_servers_that_held_back_are_refused_by_servers_that_do_not(tmp_path, held_back):
    """A job resumed with servers that do not re-sparsify cannot continue the run it saved:
    every worker refuses the checkpoint before its first step, naming why."""
    out = _refused_on_every_worker(_resume_held_back(tmp_path, held_back,
                                                     env={"BYTEPS_SERVER_COMPRESSOR": ""}))
    assert re.search(r"worker 0: the servers' residuals in \S+worker0-step00000004.pt cannot be put back: "
                     r"server \d refused the residual put back for key \d+: worker 0 put back a residual "
                     r"the server cannot hold: a residual came for key \d+, but this server does not "
                     r"re-sparsify its answers \(BYTEPS_SERVER_COMPRESSOR is not set\)", out), out[-3000:]


def test_servers_residuals_of_other_partitions_are_refused_on_every_worker_naming_the_tensor(tmp_path,
                                                                                           held_back):
    out = _refused_on_every_worker(_resume_held_back(
        tmp_path, held_back, env={**HELD_BACK, "BYTEPS_PARTITION_BYTES": "4096"}))
    assert re.search(r"worker 0: the servers' residuals in \S+worker0-step00000004.pt cannot be put back: "
                     r"the servers' residual of '[\w.]+' \(partition \d+, key \d+\) fits no key of this "
                     r"job: its partitions differ from the job that saved it \(the placement cuts "
                     r"by BYTEPS_PARTITION_BYTES, DMLC_NUM_SERVER", out), out[-3000:]


def _resumed(tmp_path, runs, setup):
    """The job resumed from a copy of the step-4 and step-8 checkpoints changed by ``setup``."""
    directory = tmp_path / "ckpt"
    shutil.copytree(runs["at8"], directory)
    setup(directory)
    result = train_job(2, 1, "--steps", str(STEPS), "--checksums", "--checkpoint-dir", str(directory),
                       "--set", "progress=false")
    return directory.resolve(), result


def test_a_step_one_worker_lacks_is_passed_over_for_the_newest_every_worker_holds(tmp_path, runs):
    d, result = _resumed(tmp_path, runs, lambda d: _file(d, 1, 8).unlink())
    _same_as_straight(runs, result, 5)
    assert "[worker 0] resuming from step 4, the newest step every worker holds intact\n" \
           f"[worker 0]   worker 0's step 8 ({_file(d, 0, 8)}) is not held by every worker, so it was " \
           "never committed: removed" \
           in result.stdout, result.stdout[-3000:]
    assert sorted(checkpoint.generations(d, 1)) == [4, 8]  # written again, and committed


def test_a_damaged_newest_step_is_passed_over_naming_the_file(tmp_path, runs):
    d, result = _resumed(tmp_path, runs, lambda d: _flip(_file(d, 0, 8), 4000))
    _same_as_straight(runs, result, 5)
    assert f"worker 0's {_file(d, 0, 8)} is damaged (checksum mismatch" in result.stdout, result.stdout[-3000:]
    assert "step 8 was committed, but not every worker still holds it intact" in result.stdout


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


def test_flipped_bytes_in_one_workers_only_checkpoint_are_refused(tmp_path, runs):
    d, out = _refused(tmp_path, runs, setup=lambda d: _flip(_file(d, 1, 4), 4000))
    assert f"worker 1: {_file(d, 1, 4)} is damaged: checksum mismatch" in out, out[-3000:]
    assert f"no step is held intact by every worker: worker 0 holds step(s) 4 ({d}); worker 1 holds " \
           f"none ({d})" in out


def test_an_empty_and_a_truncated_checkpoint_are_refused(tmp_path, runs):
    def damage(d):
        _file(d, 0, 4).write_bytes(b"")
        with open(_file(d, 1, 4), "r+b") as f:
            f.truncate(f.seek(0, 2) // 2)
    d, out = _refused(tmp_path, runs, setup=damage)
    assert f"worker 0: {_file(d, 0, 4)} is damaged: empty file (0 bytes)" in out, out[-3000:]
    assert re.search(rf"worker 1: {_file(d, 1, 4)} is damaged: truncated: \d+ of \d+ payload bytes",
                     out), out[-3000:]


def test_a_checkpoint_missing_on_one_worker_is_refused_naming_both(tmp_path, runs):
    d, out = _refused(tmp_path, runs, setup=lambda d: _file(d, 0, 4).unlink())
    assert (f"no step is held intact by every worker: worker 0 holds none ({d}); worker 1 holds "
            f"step(s) 4 ({d})") in out, out[-3000:]


def test_checkpoints_of_another_cluster_shape_are_refused(tmp_path, runs):
    d, out = _refused(tmp_path, runs, workers=3)
    for rank in (0, 1):
        assert (f"worker {rank}: {_file(d, rank, 4)} is foreign: saved by worker {rank} of 2, this "
                f"is worker {rank} of 3") in out, out[-3000:]


def test_checkpoints_of_another_model_are_refused(tmp_path, runs):
    d, out = _refused(tmp_path, runs, "--set", "model=mlp")
    for rank in (0, 1):
        assert (f"worker {rank}: {_file(d, rank, 4)} is foreign: saved by another job: "
                f"model='cnn' where this job has 'mlp'") in out, out[-3000:]


def test_checkpoints_at_or_past_the_last_step_are_refused(tmp_path, runs):
    d, out = _refused(tmp_path, runs, steps=4)
    for rank in (0, 1):
        assert (f"worker {rank}: {_file(d, rank, 4)} is too late: at step 4, at or beyond the "
                f"job's 4 steps") in out, out[-3000:]


def test_checkpoints_at_different_steps_are_refused(tmp_path, runs):
    def apart(d):
        _file(d, 1, 4).unlink()
        shutil.copy(_file(runs["at8"], 1, 8), d)
    d, out = _refused(tmp_path, runs, setup=apart, steps=30)
    assert (f"no step is held intact by every worker: worker 0 holds step(s) 4 ({d}); worker 1 "
            f"holds step(s) 8 ({d})") in out, out[-3000:]


def test_intact_checkpoints_of_two_different_runs_are_refused(tmp_path, runs):
    """Another run's checkpoint of the same job at the same step (here: another seed) is intact
    and matches in every field, but its parameters differ from the other worker's."""
    other = tmp_path / "other"
    made = train_job(2, 1, "--steps", str(STEPS), "--stop-after", "4", "--seed", "7",
                     "--checkpoint-dir", str(other), "--set", "progress=false")
    assert made.returncode == 0, made.stdout[-3000:]
    d, out = _refused(tmp_path, runs, setup=lambda d: shutil.copy(_file(other, 1, 4), d))
    assert re.search(rf"they hold different parameters, so they come from different runs: worker 0 "
                     rf"\({_file(d, 0, 4)}\) \w+; worker 1 \({_file(d, 1, 4)}\) \w+", out), out[-3000:]


def test_a_full_disk_costs_only_the_steps_since_the_last_commit(runs, small_disk):
    """Room for three and a half checkpoint files: the step-4 generation commits, the step-8
    one fails on one worker or both (they write at once). Every worker names the same workers
    and files; the rerun on a larger disk resumes from step 4 and trains exactly what the run
    never stopped trained."""
    folder, resize = small_disk
    one = _file(runs["at4"], 0, 4).stat().st_size
    resize(3 * one + one // 2 + 64 * 1024)  # + the commit records' pages
    args = ("--steps", str(STEPS), "--checksums", "--checkpoint-dir", str(folder),
            "--set", "progress=false", "--set", "checkpoint_every=4")
    full = train_job(2, 1, *args, timeout=120, timed=True)
    out = full.stdout
    assert full.returncode != 0, out[-3000:]
    said = dict(re.findall(r"\[worker (\d)\] worker: CheckpointError: (the step-8 checkpoint is not "
                           r"committed: .*)", out))
    assert sorted(said) == ["0", "1"] and said["0"] == said["1"], out[-3000:]  # every worker, alike
    failures = re.findall(r"worker (\d): saving to (\S+) failed \(No space left on device\)", said["0"])
    assert failures and all(path == str(_file(folder, int(rank), 8)) for rank, path in failures), said
    assert said["0"].endswith("the job stops, and a rerun resumes from step 4, the last committed")
    assert "Traceback" not in out, out[-3000:]
    assert not list(folder.glob("*.tmp")), list(folder.iterdir())
    resize("64m")
    again = train_job(2, 1, *args)
    _same_as_straight(runs, again, 5)
    assert "resuming from step 4, the newest step every worker holds intact" in again.stdout
