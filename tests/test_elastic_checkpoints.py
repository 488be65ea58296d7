"""Checkpoints on disk for the elastic training job: the newest committed step that any
worker holds intact resumes the job, with however many workers it has now; what cannot
resume it is refused on every worker, naming the file."""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from adtopk_ps.testing.roles import run_and_kill
from procs import FAST, bpslaunch
from worker import checkpoint, elastic_checkpoint
from worker.checkpoint import REFUSED, CheckpointError, generation_path
from worker.checkpoint_file import read_header, write
from worker.elastic_checkpoint import Copy, Holdings, decide

ROOT = Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "configs" / "digits-mlp-elastic.yaml")
JOB = {"model": "mlp", "optimizer": {"name": "sgd"}}


def _copy(step, saved_by, workers=2, digest="d", folder="/ckpt"):
    return Copy(f"{folder}/worker{saved_by}-step{step:08d}.pt", step, saved_by, workers, digest, 0, 0)


def _held(rank, *copies, committed=None, faults=(), folder="/ckpt"):
    return Holdings(rank, folder, tuple(copies), tuple(faults), committed)


def test_the_newest_committed_step_is_resumed_from_any_copy_of_it():
    # a shared folder: every worker sees every copy; step 30 is committed by its record
    shared = [_copy(20, 0), _copy(20, 1), _copy(30, 0), _copy(30, 1)]
    chosen, notes, committed = decide([_held(0, *shared, committed=30), _held(1, *shared)], 100)
    assert (chosen, notes, committed) == (_copy(30, 0), [], [20, 30])
    # one folder per host, the host of worker 0 gone: worker 1's copy of step 30 is enough
    chosen, _, _ = decide([_held(0, committed=20, folder="/a"),
                           _held(1, _copy(20, 1), _copy(30, 1), committed=30, folder="/b")], 100)
    assert chosen == _copy(30, 1)


def test_a_step_not_every_worker_saved_was_never_committed_and_is_passed_over():
    # step 40: only worker 0 wrote it before the job ended; no record names it
    chosen, notes, committed = decide([_held(0, _copy(30, 0), _copy(40, 0), committed=30),
                                       _held(1, _copy(30, 1), committed=30)], 100)
    assert chosen.step == 30 and committed == [30]
    assert notes == ["step 40 was never committed (not every worker saved it): passed over"]
    # every rank of that save holds a copy: committed, though no record reached the disk
    chosen, _, _ = decide([_held(0, _copy(40, 0, workers=3)), _held(1, _copy(40, 1, workers=3)),
                           _held(2, _copy(40, 2, workers=3))], 100)
    assert chosen.step == 40
    assert decide([_held(0, _copy(4, 0)), _held(1)], 100) == \
        (None, ["step 4 was never committed (not every worker saved it): passed over"], [])
    assert decide([_held(0, folder=""), _held(1, folder="")], 100) == (None, [], [])


def test_a_damaged_copy_gives_way_to_an_intact_one_or_to_an_older_step():
    damaged = ("/ckpt/worker0-step00000030.pt", "damaged", "checksum mismatch")
    # the same damaged file in a shared folder is named once
    chosen, notes, _ = decide([_held(0, _copy(30, 1), faults=[damaged], committed=30),
                               _held(1, _copy(30, 1), faults=[damaged], committed=30)], 100)
    assert chosen == _copy(30, 1)
    assert notes == ["/ckpt/worker0-step00000030.pt is damaged (checksum mismatch)"]
    chosen, notes, _ = decide([_held(0, _copy(20, 0), faults=[damaged], committed=30),
                               _held(1, _copy(20, 1), committed=30)], 100)
    assert chosen.step == 20 and notes[-1] == "step 30 was committed, but no intact copy of it is left"


def test_what_cannot_resume_the_job_is_refused_naming_the_file():
    def refused(holdings, total=100):
        with pytest.raises(CheckpointError) as err:
            decide(holdings, total)
        assert str(err.value).startswith(REFUSED)
        return str(err.value)
    assert "--checkpoint-dir is given to some workers only: worker 0 has /ckpt; worker 1 has none" \
        in refused([_held(0), _held(1, folder="")])
    assert "the copies of step 30 hold different parameters" in \
        refused([_held(0, _copy(30, 0, digest="a"), committed=30), _held(1, _copy(30, 1, digest="b"))])
    foreign = ("/ckpt/worker0-step00000010.pt", "foreign", "saved by a job that is not elastic")
    assert "worker 0: /ckpt/worker0-step00000010.pt is foreign: saved by a job that is not elastic" \
        in refused([_held(0, faults=[foreign]), _held(1)])
    assert "no intact copy of a committed step is left (step 30 was committed)" in \
        refused([_held(0, committed=30), _held(1)])
    assert "at step 30, at or beyond the job's 30 steps" in refused([_held(0, _copy(30, 0), committed=30)], 30)


@settings(max_examples=200, deadline=None)
@given(saves=st.lists(st.tuples(st.integers(1, 4), st.lists(st.booleans(), min_size=4, max_size=4)),
                      min_size=0, max_size=6),
       folders=st.sampled_from(["shared", "per host"]))
def test_the_resumed_step_is_always_one_every_worker_of_its_save_finished(saves, folders):
    """A run of saves, each by W workers some of whom wrote their copy; a save is committed
    only when all of them did (the record then names it), and a later save can only follow
    a committed one. Whatever is left, the decision resumes the newest committed step."""
    copies: list[Copy] = []
    record, newest = None, None
    for step, (workers, wrote) in enumerate(saves, 1):
        made = [_copy(step * 10, r, workers) for r in range(workers) if wrote[r]]
        copies += made
        if len(made) == workers:
            record = newest = step * 10
        else:
            break  # the job ended on the failed commit
    if folders == "shared":
        holdings = [_held(r, *copies, committed=record) for r in range(2)]
    else:
        holdings = [_held(r, *[c for c in copies if c.saved_by == r], committed=record,
                          folder=f"/host{r}") for r in range(4)]
    chosen, _, committed = decide(holdings, 1000)
    assert (chosen.step if chosen else None) == newest
    assert all(s <= (newest or 0) for s in committed)


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


def test_an_elastic_job_saves_through_kills_and_joins_and_resumes_with_other_workers(tmp_path):
    # 3 workers, worker 2 killed at step 25 and its restart joining: every save still commits
    env = {**os.environ, **FAST, "PS_HEARTBEAT_TIMEOUT_MS": "6000"}
    first, killed = run_and_kill(_job(tmp_path, 3, 60, restarts=1), env, r"checksum step 25:",
                                 "worker", 2, timeout=200)
    assert first.returncode == 0 and killed, first.stdout
    at_60 = set(re.findall(r"checksum step 60: (\w+)", first.stdout))
    assert len(at_60) == 1, first.stdout
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
