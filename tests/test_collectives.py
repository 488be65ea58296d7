"""Collectives agreed by name: calls that differ or fail on one worker are refused on every
worker at once, and the cluster stays usable (horovod's suite runs whole in one cluster)."""
import sys
import time
from pathlib import Path

from procs import bpslaunch

PROGRAMS = Path(__file__).resolve().parent / "programs"
PATIENT = {"PS_HEARTBEAT_TIMEOUT_MS": "10000", "PS_PUSH_PULL_TIMEOUT_S": "60"}
CHECKS = 49  # lines workers 1 and 2 of collectives_check.py print (worker 0: 1 fewer)


def _lines(stdout, worker):
    return [line.split(f"worker {worker}: ", 1)[1] for line in stdout.splitlines()
            if f"] worker {worker}: " in line]


def test_calls_that_differ_are_refused_everywhere_and_the_next_call_works():
    """Shape, dtype, op, root, allgather's trailing shape, a root out of range, an op or an
    int64 out of range on one worker, an unpicklable object on the root, a call one worker
    skips, a backward pass on one worker only, a timeout, a duplicate name, join beside sums, 90 rounds of join with stand-ins where the joiner changes every round, shutdown and
    init again, and 30 refusals each followed by a right answer; three workers, two
    servers, one cluster throughout."""
    began = time.monotonic()
    result = bpslaunch("--local", "--num-workers", "3", "--num-servers", "2", "--",
                       sys.executable, str(PROGRAMS / "collectives_check.py"), "30",
                       env=PATIENT, timeout=240)
    out = result.stdout
    assert result.returncode == 0, out[-4000:]
    for worker in range(3):
        lines = _lines(out, worker)
        failed = [line for line in lines if not line.endswith(" ok")]
        assert not failed and len(lines) == CHECKS - (1 if worker == 0 else 0), (failed, len(lines))
    # no refusal waited for a timeout: the whole program runs in seconds, not minutes
    assert time.monotonic() - began < 150


NAME_CHECKS = 24  # lines each worker of names_check.py prints


def test_names_that_cannot_travel_are_refused_on_their_call_and_the_next_call_works():
    """A 30 KB name (the scheduler's answer to it passed the 64 KiB header limit and the job
    ended), a 1 MB one (the scheduler refused the node) and a lone surrogate (it killed the
    engine thread), through every entry point that takes a name: each raises ValueError on
    the worker that made it, naming the limit, and the next call is right; a name at the
    limit is served; one refused on one worker only is refused on the other once both wait,
    and the calls after meet. Two workers, one server, one cluster throughout."""
    result = bpslaunch("--local", "--num-workers", "2", "--num-servers", "1", "--timeout", "130",
                       "--", sys.executable, str(PROGRAMS / "names_check.py"), env=PATIENT,
                       timeout=150)
    out = result.stdout
    assert result.returncode == 0, out[-4000:]
    for worker in range(2):
        lines = _lines(out, worker)
        failed = [line for line in lines if not line.endswith(" ok")]
        assert not failed and len(lines) == NAME_CHECKS, (failed, len(lines))
