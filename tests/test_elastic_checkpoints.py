"""Checkpoints on disk for the elastic training job: the newest committed step that any
worker holds intact resumes the job, with however many workers it has now; what cannot
resume it is refused on every worker, naming the file."""
from __future__ import annotations

import dataclasses
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from adtopk_ps.testing.roles import role_pids
from procs import FAST, bpslaunch
from worker import checkpoint, elastic_checkpoint
from worker.checkpoint import REFUSED, CheckpointError, generation_path
from worker.checkpoint_file import read, read_header, write
from worker.elastic_checkpoint import Copy, Holdings, decide

ROOT = Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "configs" / "digits-mlp-elastic.yaml")
JOB = {"model": "mlp", "optimizer": {"name": "sgd"}}


def _copy(step, saved_by, digest="d", folder="/ckpt"):
    return Copy(f"{folder}/worker{saved_by}-step{step:08d}.pt", step, digest, 0, 0)


def _held(rank, *copies, committed=(), faults=(), folder="/ckpt"):
    return Holdings(rank, folder, tuple(copies), tuple(faults), tuple(committed))


def test_the_newest_committed_step_is_resumed_from_any_copy_of_it():
    # a shared folder: every worker sees every copy; run 1's records name steps 20 and 30
    shared = [_copy(20, 0), _copy(20, 1), _copy(30, 0), _copy(30, 1)]
    records = [(20, "d", 1), (30, "d", 1)]
    chosen, notes, committed = decide([_held(0, *shared, committed=records), _held(1, *shared)], 100)
    assert (chosen, notes, committed) == (_copy(30, 0), [], {20: "d", 30: "d"})
    # one folder per host, the host of worker 0 gone: worker 1's copy of step 30 is enough
    chosen, _, _ = decide([_held(0, committed=[(20, "d", 1)], folder="/a"),
                           _held(1, _copy(20, 1), _copy(30, 1), committed=records, folder="/b")], 100)
    assert chosen == _copy(30, 1)


def test_a_copy_no_record_names_was_never_committed_and_is_passed_over():
    # step 40: only worker 0 wrote it before the job ended; no record names it
    chosen, notes, committed = decide([_held(0, _copy(30, 0), _copy(40, 0), committed=[(30, "d", 1)]),
                                       _held(1, _copy(30, 1), committed=[(30, "d", 1)])], 100)
    assert chosen.step == 30 and committed == {30: "d"}
    assert notes == ["/ckpt/worker0-step00000040.pt (step 40) no commit record names it: passed over"]
    # no record at all (a first save cut short): a fresh start, saying why
    assert decide([_held(0, _copy(4, 0)), _held(1)], 100) == \
        (None, ["/ckpt/worker0-step00000004.pt (step 4) no commit record names it: passed over"], {})
    assert decide([_held(0, folder=""), _held(1, folder="")], 100) == (None, [], {})


def test_a_copy_of_a_step_the_job_took_again_is_not_the_jobs_step():
    """A save cut short by a kill: worker 2 wrote step 20 (parameters X), the others rolled
    back and took step 20 again with two workers (Y), committing it; the record names Y."""
    stale = _copy(20, 2, digest="X")
    again = [_copy(20, 0, digest="Y"), _copy(20, 1, digest="Y")]
    records = [(10, "W", 1), (20, "Y", 1)]
    chosen, notes, committed = decide([_held(0, *again, stale, committed=records),
                                       _held(1, *again, stale, committed=records)], 100)
    assert chosen.digest == "Y" and committed == {20: "Y"}
    assert notes == ["/ckpt/worker2-step00000020.pt (step 20) no commit record names it: passed over"]
    # the records lost where the retake's copies are: back to what a record still names,
    # never to the rolled-back copies, however many ranks left them
    chosen, _, _ = decide([_held(0, _copy(10, 0, "W"), _copy(20, 0, "X"), committed=records[:1],
                                 folder="/w0"),
                           _held(1, _copy(20, 1, "X"), _copy(20, 0, "Y"), folder="/w1"),
                           _held(2, _copy(20, 2, "X"), _copy(20, 1, "Y"), folder="/w2")], 100)
    assert (chosen.step, chosen.digest) == (10, "W")


def test_a_host_that_missed_a_run_is_outranked_by_the_newer_run():
    # run 1 committed 30 and 40 (A) on three hosts; run 2 ran without host 2, resumed from
    # 30 and committed 40 (B) and 45; host 2 is back with run 1's records and copies
    newer = [(30, "C", 2), (40, "B", 2), (45, "E", 2)]
    holdings = [_held(0, _copy(40, 0, "B", "/w0"), _copy(45, 0, "E", "/w0"), committed=newer,
                      folder="/w0"),
                _held(1, _copy(40, 1, "B", "/w1"), _copy(45, 1, "E", "/w1"), committed=newer,
                      folder="/w1"),
                _held(2, _copy(40, 2, "A", "/w2"), _copy(50, 2, "F", "/w2"),
                      committed=[(40, "A", 1), (50, "F", 1)], folder="/w2")]
    chosen, notes, committed = decide(holdings, 100)
    assert (chosen.step, chosen.digest) == (45, "E") and committed == {40: "B", 45: "E"}
    assert "/w2/worker2-step00000050.pt (step 50) is of run 1, which run 2 went on from: passed over" \
        in notes
    # run 2's copies of 40 damaged and 45 lost: its 40 is gone, so back to run 2's 30 if held
    damaged = [("/w0/worker0-step00000040.pt", "damaged", "truncated")]
    chosen, notes, _ = decide([_held(0, _copy(30, 0, "C"), faults=damaged, committed=newer, folder="/w0"),
                               _held(2, _copy(40, 2, "A"), _copy(30, 2, "C"),
                                     committed=[(30, "C", 1), (40, "A", 1)], folder="/w2")], 100)
    assert (chosen.step, chosen.digest) == (30, "C")
    assert notes[-1] == "step 45 was committed, but no intact copy of it is left"


def test_folders_at_one_path_on_every_host_are_told_apart_by_their_parameters():
    # /ckpt on each host: worker 0's holds a stale step 40 (A), worker 1's the committed (B)
    chosen, _, _ = decide([_held(0, _copy(40, 0, digest="A"), committed=[(30, "C", 1)]),
                           _held(1, _copy(40, 0, digest="B"), committed=[(40, "B", 1)])], 100)
    assert chosen.digest == "B"


def test_a_damaged_copy_gives_way_to_an_intact_one_or_to_an_older_step():
    damaged = ("/ckpt/worker0-step00000030.pt", "damaged", "checksum mismatch")
    records = [(20, "d", 1), (30, "d", 1)]
    # the same damaged file in a shared folder is named once
    chosen, notes, _ = decide([_held(0, _copy(30, 1), faults=[damaged], committed=records),
                               _held(1, _copy(30, 1), faults=[damaged], committed=records)], 100)
    assert chosen == _copy(30, 1)
    assert notes == ["/ckpt/worker0-step00000030.pt is damaged (checksum mismatch)"]
    chosen, notes, _ = decide([_held(0, _copy(20, 0), faults=[damaged], committed=records),
                               _held(1, _copy(20, 1), committed=records)], 100)
    assert chosen.step == 20 and notes[-1] == "step 30 was committed, but no intact copy of it is left"


def test_what_cannot_resume_the_job_is_refused_naming_the_file():
    def refused(holdings, total=100):
        with pytest.raises(CheckpointError) as err:
            decide(holdings, total)
        assert str(err.value).startswith(REFUSED)
        return str(err.value)
    assert "--checkpoint-dir is given to some workers only: worker 0 has /ckpt; worker 1 has none" \
        in refused([_held(0), _held(1, folder="")])
    assert "run 1 committed step 30 with different parameters" in \
        refused([_held(0, _copy(30, 0, digest="a"), committed=[(30, "a", 1)]),
                 _held(1, _copy(30, 1, digest="b"), committed=[(30, "b", 1)])])
    foreign = ("/ckpt/worker0-step00000010.pt", "foreign", "saved by a job that is not elastic")
    message = refused([_held(0, faults=[foreign]), _held(1, faults=[foreign])])
    assert message.count("/ckpt/worker0-step00000010.pt is foreign: saved by a job that is not "
                         "elastic") == 1  # a shared folder: named once
    assert "no intact copy of a committed step is left (step 30 was committed)" in \
        refused([_held(0, committed=[(30, "d", 1)]), _held(1)])
    assert "at step 30, at or beyond the job's 30 steps" in \
        refused([_held(0, _copy(30, 0), committed=[(30, "d", 1)])], 30)


@settings(max_examples=200, deadline=None)
@given(runs=st.lists(st.lists(st.tuples(st.integers(1, 4), st.lists(st.booleans(), min_size=4,
                                                                     max_size=4)),
                              min_size=0, max_size=4), min_size=1, max_size=3),
       folders=st.sampled_from(["shared", "per host"]))
def test_the_resumed_step_is_always_the_newest_runs_newest_commit(runs, folders):
    """Runs one after the other, each resuming from what the last decision chose; in each,
    saves by W workers, some of whom wrote their copy before the save was cut short (the
    job then took the step again: other parameters, a new save). Whatever is left on disk,
    the decision resumes the newest committed step of the newest run that committed one,
    with the parameters committed."""
    files: dict[tuple[str, int, int], Copy] = {}  # (folder, rank, step) -> what the file holds
    records: dict[str, tuple] = {}  # folder -> what its records name
    last_run_kept: dict[int, str] = {}
    run_no = 0
    for attempts in runs:
        holdings = _holdings(files, records, folders)
        chosen, _, lineage = decide(holdings, 10 ** 6)
        run_no = 1 + max((r for h in holdings for _, _, r in h.committed), default=0)
        kept = dict(lineage)
        step0 = chosen.step if chosen else 0
        for attempt, (workers, wrote) in enumerate(attempts):
            step = step0 + 10 * (len(kept) - len(lineage) + 1)
            digest = f"r{run_no}-{step}-{attempt}"
            for r in range(workers):
                if wrote[r]:
                    folder = "/ckpt" if folders == "shared" else f"/host{r}"
                    files[folder, r, step] = _copy(step, r, digest, folder)
            if all(wrote[:workers]):
                kept[step] = digest
                for r in range(workers):
                    folder = "/ckpt" if folders == "shared" else f"/host{r}"
                    records[folder] = tuple((s, d, run_no) for s, d in kept.items())
        if len(kept) > len(lineage):
            last_run_kept = {s: d for s, d in kept.items()}
    chosen, _, _ = decide(_holdings(files, records, folders), 10 ** 6)
    if last_run_kept:
        newest = max(last_run_kept)
        assert (chosen.step, chosen.digest) == (newest, last_run_kept[newest])
    else:
        assert chosen is None


def _holdings(files, records, folders):
    by_folder: dict[str, list[Copy]] = {}
    for (folder, _, _), c in files.items():
        by_folder.setdefault(folder, []).append(c)
    if folders == "shared":
        return [_held(r, *by_folder.get("/ckpt", []), committed=records.get("/ckpt", ()))
                for r in range(2)]
    return [_held(r, *by_folder.get(f"/host{r}", []), committed=records.get(f"/host{r}", ()),
                  folder=f"/host{r}") for r in range(4)]


def test_an_unreadable_commit_record_is_damaged_and_nothing_is_taken_for_uncommitted(tmp_path):
    # per-host folders, one host gone, the records unreadable: the copies of step 40 may well
    # be committed, so the job neither starts fresh (removing them) nor guesses
    (tmp_path / "worker0.commit").write_text("{not json")
    (tmp_path / "worker1.commit").write_text('{"step": 40}')  # no digests
    (tmp_path / "worker2.commit").write_text('{"step": 40, "run": 1, "kept": {"40": 7}}')
    (tmp_path / "worker3.commit").write_text('{"step": 40, "kept": {"40": "abc"}}')  # no run
    found = elastic_checkpoint.survey(str(tmp_path), 0, checkpoint.job_identity(JOB))
    assert [f[0].rsplit("/", 1)[1] for f in found.faults] == \
        ["worker0.commit", "worker1.commit", "worker2.commit", "worker3.commit"]
    assert all(state == "damaged" and why.startswith("an unreadable commit record")
               for _, state, why in found.faults)
    holdings = [dataclasses.replace(found, copies=(_copy(40, 0, folder=str(tmp_path)),)),
                _held(1, _copy(40, 1), folder="/other")]
    with pytest.raises(CheckpointError, match="no intact copy of a committed step is left"):
        decide(holdings, 100)


def _tiny(path: Path, step: int, rank: int, meta: dict | None) -> None:
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    write(path, model, opt, {**(meta or {}), "step": step, "workers": 2, "rank": rank,
                             "job": checkpoint.job_identity(JOB)})


def test_elastic_and_plain_jobs_never_take_each_others_files(tmp_path):
    _tiny(generation_path(tmp_path, 0, 10), 10, 0, None)
    _tiny(generation_path(tmp_path, 1, 10), 10, 1, {"elastic": {"epoch": 0, "processed": 0,
                                                                 "digest": "x"}})
    found = elastic_checkpoint.survey(str(tmp_path), 0, checkpoint.job_identity(JOB))
    assert [c.path for c in found.copies] == [str(generation_path(tmp_path, 1, 10))]
    assert found.faults == ((str(generation_path(tmp_path, 0, 10)), "foreign",
                             "saved by a job that is not elastic"),)
    plain = checkpoint.survey(str(tmp_path), 1, 2, checkpoint.job_identity(JOB))
    assert plain.faults == ((str(generation_path(tmp_path, 1, 10)), "foreign", "saved by an elastic job"),)


def _job(folder, workers, steps, *extra, restarts=0, timeout=150):
    return [sys.executable, "-m", "adtopk_ps.launcher", "--local", "--num-workers", str(workers),
            "--num-servers", "2", "--min-workers", "1", "--restarts", str(restarts), "--timeout",
            str(timeout), "--", sys.executable, "-m", "worker", "--config", CONFIG, "--steps",
            str(steps), "--checkpoint-dir", str(folder), "--checksums", "--set", "progress=false",
            "--set", "elastic.min_workers=1", "--set", "checkpoint_every=10", *extra]


def test_a_kill_in_a_save_and_a_rerun_with_other_workers_resume_the_committed_steps(tmp_path):
    # 3 workers; worker 2 is killed as soon as its copy of step 20 is on disk (inside the
    # save: the others may have written theirs or not), and its restart joins. The job
    # rolls step 20 back and takes it again, every later save commits, and a rerun with 2
    # workers goes on from step 60's committed parameters
    env = {**os.environ, **FAST, "PS_HEARTBEAT_TIMEOUT_MS": "6000"}
    launcher = subprocess.Popen(_job(tmp_path, 3, 60, restarts=1), env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    killed = []

    def kill_in_the_save():
        deadline = time.monotonic() + 120
        while not (tmp_path / "worker2-step00000020.pt").exists() and time.monotonic() < deadline:
            time.sleep(0.001)
        for pid in role_pids(launcher.pid, "worker", 2):
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
    watcher = threading.Thread(target=kill_in_the_save)
    watcher.start()
    try:
        out, _ = launcher.communicate(timeout=200)
    finally:
        launcher.kill()
        watcher.join()
    assert launcher.returncode == 0 and killed, out
    at_60 = set(re.findall(r"checksum step 60: (\w+)", out))
    assert len(at_60) == 1, out
    held = sorted(p.name for p in tmp_path.glob("worker*-step*.pt"))
    assert {int(n[-11:-3]) for n in held} == {50, 60}, held  # the newest 2 generations only
    # the step-60 copies hold the first run's parameters
    assert {read_header(p)["elastic"]["digest"] for p in tmp_path.glob("worker*-step00000060.pt")} \
        == at_60
    # again with 2 workers, to step 80: from step 60's parameters, not from the start
    second = bpslaunch(*_job(tmp_path, 2, 80)[3:], timeout=200, env=env)
    out = second.stdout
    assert second.returncode == 0, out
    assert re.search(r"resuming from step 60 \(.*worker\d-step00000060\.pt\), the newest committed "
                     r"step, with 2 worker\(s\)", out), out
    assert "checksum step 60:" not in out and out.count("checksum step 61:") == 2, out
    assert len(set(re.findall(r"checksum step 80: (\w+)", out))) == 1, out


def test_any_copy_of_a_step_brings_back_what_the_servers_held_back(tmp_path):
    """With servers that re-sparsify (their residuals in checkpoints), every worker's copy
    of a step holds them: a rerun that finds only worker 1's copy (worker 0's host is gone)
    continues as the one that finds worker 0's."""
    env = {**os.environ, **FAST, "PS_HEARTBEAT_TIMEOUT_MS": "6000", "BYTEPS_SERVER_COMPRESSOR": "topk"}
    first = bpslaunch(*_job(tmp_path / "a", 2, 20, "--stop-after", "10")[3:], timeout=200, env=env)
    assert first.returncode == 0, first.stdout
    for rank in range(2):
        entries = read(generation_path(tmp_path / "a", rank, 10))[1]["servers"]
        assert entries and any(bool(e["residual"].any()) for e in entries)
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    generation_path(tmp_path / "b", 0, 10).unlink()
    sums = []
    for folder in ("a", "b"):
        rerun = bpslaunch(*_job(tmp_path / folder, 2, 20)[3:], timeout=200, env=env)
        assert rerun.returncode == 0, rerun.stdout
        assert re.search(rf"resuming from step 10 \(.*worker{0 if folder == 'a' else 1}-step00000010\.pt\)",
                         rerun.stdout), rerun.stdout
        sums.append(sorted(re.findall(r"checksum step (\d+): (\w+)", rerun.stdout)))
    assert sums[0] == sums[1] and len(sums[0]) == 2 * 10
