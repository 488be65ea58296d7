"""Collective names that cannot travel (too long, not valid UTF-8), one after another in one
cluster, each followed by a call that must be right: run under ``bpslaunch --local
--num-workers 2``.

Every check prints ``worker R: <check> ok`` or ``worker R: <check> FAILED <why>``. A name
refused on every worker raises ``ValueError`` on each, naming the limit; one refused on
one worker only leaves the other's call to the skipped-call rule (refused once every worker
waits), and the calls after meet again.
"""
import time

import torch

import adtopk_ps.torch as hvd
from adtopk_ps.client.errors import CollectiveError
from adtopk_ps.cluster.coordinator import MAX_NAME_BYTES

hvd.init()
rank, size = hvd.rank(), hvd.size()
REFUSAL_S = 3.0  # a loaded CI machine: a refusal must still come long before any timeout
LONG = "x" * 30000  # the reply to it used to pass the wire's 64 KiB header limit
HUGE = "y" * (1 << 20)  # its request used to: the scheduler refused the node
SURROGATE = "bad\ud800"  # msgpack cannot encode it: the engine thread died


def say(check, ok, why=""):
    print(f"worker {rank}: {check} {'ok' if ok else 'FAILED ' + why}", flush=True)


def next_call_works(check):
    summed = hvd.allreduce(torch.full((5,), float(rank)), op=hvd.Sum, name=f"{check}.after")
    say(f"{check} then allreduce", torch.equal(summed, torch.full((5,), float(sum(range(size))))),
        str(summed))


def refused_here(check, call, text):
    """``call`` raises ValueError containing ``text`` at once, on this worker."""
    began = time.monotonic()
    try:
        call()
    except ValueError as exc:
        say(check, text in str(exc) and time.monotonic() - began < REFUSAL_S, str(exc))
    except Exception as exc:  # noqa: BLE001 - the wrong error is a failure, named
        say(check, False, f"raised {type(exc).__name__}: {exc}")
    else:
        say(check, False, "did not raise")
    next_call_works(check)


limit = f"exceeds the limit of {MAX_NAME_BYTES} bytes"
refused_here("30 KB allreduce", lambda: hvd.allreduce(torch.ones(3), name=LONG),
             f"of 30000 bytes {limit}")
refused_here("1 MB allreduce", lambda: hvd.allreduce(torch.ones(3), name=HUGE),
             f"of {1 << 20} bytes {limit}")
refused_here("surrogate allreduce", lambda: hvd.allreduce(torch.ones(3), name=SURROGATE),
             "is not valid UTF-8 (lone surrogate '\\ud800' at position 3)")
refused_here("surrogate broadcast_object", lambda: hvd.broadcast_object({"a": 1}, name=SURROGATE),
             "lone surrogate")
refused_here("30 KB allgather", lambda: hvd.allgather(torch.ones(1, 2), name=LONG), limit)
refused_here("30 KB allgather_object", lambda: hvd.allgather_object(rank, name=LONG), limit)
refused_here("30 KB push_pull_async", lambda: hvd.push_pull_async(torch.ones(2), name=LONG), limit)
refused_here("surrogate broadcast_", lambda: hvd.broadcast_(torch.ones(2), 0, name=SURROGATE),
             "lone surrogate")
refused_here("30 KB parameter name", lambda: hvd.broadcast_parameters({LONG: torch.ones(2)}), limit)
optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
refused_here("surrogate optimizer prefix",
             lambda: hvd.broadcast_optimizer_state(optimizer, prefix=SURROGATE), "lone surrogate")

# a name at the limit (two bytes a character) is served, and so is its gradient's call
at_limit = "é" * (MAX_NAME_BYTES // 2)
x = torch.full((4,), float(rank + 1), requires_grad=True)
y = hvd.allreduce(x, op=hvd.Sum, name=at_limit)
y.sum().backward()
say("a name at the limit", torch.equal(y.detach(), torch.full((4,), float(sum(range(1, size + 1))))) and
    torch.equal(x.grad, torch.full((4,), float(size))), f"{y} {x.grad}")

# refused on worker 1 only: worker 0 waits in a call worker 1 never makes, and is refused
# once worker 1 waits too; each side then has one refusal, and the calls after meet
began = time.monotonic()
try:
    hvd.allreduce(torch.ones(2), name=LONG if rank == 1 else "fine-on-0")
    say("refused on one worker", False, "did not raise")
except ValueError as exc:
    say("refused on one worker", rank == 1 and limit in str(exc), str(exc))
except CollectiveError as exc:
    say("refused on one worker", rank == 0 and "wait elsewhere" in str(exc)
        and time.monotonic() - began < REFUSAL_S, str(exc))
refusals = 0
for _ in range(3):
    try:
        lined_up = hvd.allreduce(torch.full((3,), float(rank)), op=hvd.Sum, name="lined-up")
        break
    except CollectiveError:
        refusals += 1
say("lined up again", refusals == 1 and torch.equal(
    lined_up, torch.full((3,), float(sum(range(size))))), f"{refusals} refusals, {lined_up}")
next_call_works("one-sided")
hvd.shutdown()
