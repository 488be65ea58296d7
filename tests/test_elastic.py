"""Elastic jobs: a worker killed with SIGKILL at a bad moment leaves the others training.

Each job runs tests/programs/elastic_train.py (a horovod elastic script, the import changed)
under ``bpslaunch --local --min-workers``. Every time: the job exits 0, every survivor ends
at the same step count with bit-identical parameters, and each kill is followed by the next
step within 3 s (the kill's and the step's wall-clock times, printed by the processes)."""
from __future__ import annotations

import random
import re
import sys
from pathlib import Path

import pytest

from adtopk_ps.testing.stats import kill_to_next_step
from procs import bpslaunch

PROGRAM = str(Path(__file__).resolve().parent / "programs" / "elastic_train.py")
STEPS = 16
GOAL_S = 3.0


def elastic_job(workers: int, servers: int, minimum: int, *args: str, steps: int = STEPS):
    return bpslaunch("--local", "--num-workers", str(workers), "--num-servers", str(servers),
                     "--min-workers", str(minimum), "--timeout", "100", "--",
                     sys.executable, PROGRAM, "--steps", str(steps), *args, timeout=130)


def survivors(out: str) -> list[tuple[int, str, int]]:
    """(step, digest, size) of every worker that finished."""
    return [(int(m[1]), m[3], int(m[2])) for m in
            re.finditer(r"done step=(\d+) size=(\d+) digest=(\w+)", out)]


def check_finished(result, workers: int) -> list[float]:
    assert result.returncode == 0, result.stdout[-4000:]
    done = survivors(result.stdout)
    assert len(done) == workers, result.stdout[-4000:]
    assert {(step, size) for step, _, size in done} == {(STEPS, workers)}
    assert len({digest for _, digest, _ in done}) == 1, done  # bit-identical replicas
    gaps = kill_to_next_step(result.stdout)
    assert all(gap <= GOAL_S for gap in gaps), gaps
    return gaps


def kills(seed: int, workers: int, count: int) -> list[str]:
    """``count`` distinct victims at distinct steps, the moment drawn from every kind."""
    rng = random.Random(seed)
    victims = rng.sample(range(workers), count)
    steps = sorted(rng.sample(range(1, STEPS - 2), count))
    return [f"--kill={v}:{s}" for v, s in zip(victims, steps)]


@pytest.mark.parametrize("when", ["before-push", "mid-push"])
@pytest.mark.parametrize("seed", range(3))
def test_repeated_kills_at_bad_moments_leave_the_others_training(when, seed):
    # 5 workers, at least 2: three kills a job at random steps and ranks, before a push or
    # between the pushes and their answers (overlap), 18 kills over the 6 jobs
    gaps = check_finished(elastic_job(5, 2, 2, "--when", when, *kills(seed, 5, 3)), 2)
    assert len(gaps) == 3


def test_a_worker_killed_in_the_start_up_agreement_leaves_the_others_training():
    result = elastic_job(3, 2, 2, "--when", "start-up", "--kill=1:0")
    check_finished(result, 2)
    assert "going on with 2 worker(s) (epoch 1" in result.stdout


def test_workers_killed_at_once_and_while_the_others_re_form():
    # two kills at one step (two re-forms within milliseconds: a request made in the first
    # must not be answered in the second), a third a step later, while the others re-form
    check_finished(elastic_job(5, 2, 2, "--when", "mid-push", "--kill=1:5", "--kill=3:5",
                               "--kill=0:6"), 2)


def test_below_the_minimum_the_job_ends_naming_why():
    result = elastic_job(3, 1, 2, "--kill=1:3", "--kill=2:8")
    assert result.returncode != 0
    assert "only 1 worker(s) would remain, below PS_MIN_WORKERS=2" in result.stdout
    assert not survivors(result.stdout)


def test_a_worker_that_is_only_slow_is_not_evicted():
    # stopped for 1 s, under the heartbeat timeout (2 s): nobody re-forms
    result = elastic_job(3, 2, 2, "--pause=1:6", "--pause-s=1.0")
    check_finished(result, 3)
    assert "re-formed" not in result.stdout and "lost" not in result.stdout
