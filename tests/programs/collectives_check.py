"""Collectives that differ or fail on one worker, one after another in one cluster, each
followed by a call that must be right: run under ``bpslaunch --local --num-workers 3``.

Every check prints ``worker R: <check> ok`` or ``worker R: <check> FAILED <why>``; a
refusal must reach every worker, with the same text, in about a second.
"""
import sys
import time

import torch

import adtopk_ps.torch as hvd
from adtopk_ps.client.ps_client import CollectiveError

hvd.init()
rank, size = hvd.rank(), hvd.size()
REFUSAL_S = 3.0  # a loaded CI machine: a refusal must still come long before any timeout
ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 20


def say(check, ok, why=""):
    print(f"worker {rank}: {check} {'ok' if ok else 'FAILED ' + why}", flush=True)


def refused(check, call, expect=CollectiveError, text=None):
    """``call`` must raise ``expect`` within REFUSAL_S; the next allreduce must be right."""
    began = time.monotonic()
    try:
        call()
    except expect as exc:
        took = time.monotonic() - began
        ok = took < REFUSAL_S and (text is None or text in str(exc))
        say(check, ok, f"took {took:.1f} s: {exc}")
        mine = str(exc) if isinstance(exc, CollectiveError) and "wait elsewhere" not in str(exc) \
            else None  # a deadlock's refusal names the call each worker waits in
        texts = {t for t in hvd.allgather_object(mine, name=f"{check}.text") if t is not None}
        say(f"{check} same text everywhere", len(texts) <= 1, str(texts))
    except Exception as exc:  # noqa: BLE001 - the wrong error is a failure, named
        say(check, False, f"raised {type(exc).__name__}: {exc}")
    else:
        say(check, False, "did not raise")
    after = hvd.allreduce(torch.full((5,), float(rank)), op=hvd.Sum)
    say(f"{check} then allreduce", torch.equal(after, torch.full((5,), float(sum(range(size))))),
        str(after))


refused("shape", lambda: hvd.allreduce(torch.ones(17 + rank, 17)), text="shape: worker 0 (17, 17)")
refused("dtype", lambda: hvd.allreduce(torch.ones(4, dtype=torch.float64 if rank else torch.float32)),
        text="dtype")
refused("op", lambda: hvd.allreduce(torch.ones(3), op=hvd.Sum if rank == 1 else hvd.Average),
        text="op")
refused("root", lambda: hvd.broadcast(torch.ones(3), root_rank=rank), text="root")
refused("allgather shape", lambda: hvd.allgather(torch.ones(2, 3 + (rank == 2))), text="shape[1:]")
refused("root out of range on one", lambda: hvd.broadcast_(torch.ones(2), 5 if rank == 1 else 0),
        expect=ValueError if rank == 1 else CollectiveError)


class Unpicklable:
    def __reduce__(self):
        raise TypeError("this object refuses to pickle")


refused("unpicklable on the root", lambda: hvd.broadcast_object(
    Unpicklable() if rank == 0 else None, root_rank=0),
    expect=TypeError if rank == 0 else CollectiveError)
refused("skipped call", lambda: hvd.allreduce(torch.ones(2), name=f"only-on-{rank}"),
        text="wait elsewhere")
refused("op on one worker", lambda: hvd.allreduce(torch.ones(2), op=hvd.Max if rank == 1 else hvd.Sum),
        expect=ValueError if rank == 1 else CollectiveError, text=None)
refused("int64 minimum", lambda: hvd.allreduce(torch.tensor([-2**63 if rank == 0 else 1])),
        expect=ValueError if rank == 0 else CollectiveError)

# the same call through different entry points meets: allreduce, allreduce_, allreduce_async
variant = [lambda t: hvd.allreduce(t, name="variants", op=hvd.Sum),
           lambda t: hvd.allreduce_(t, name="variants", op=hvd.Sum),
           lambda t: hvd.synchronize(hvd.allreduce_async(t, name="variants", op=hvd.Sum))][rank]
say("entry points meet", torch.equal(variant(torch.ones(3)), torch.full((3,), float(size))))

# a backward pass on one worker only (its input alone needs a gradient): the gradient's call
# is named after the forward's, so unnamed calls after it still meet, after one refusal each
x = torch.ones(3, requires_grad=rank == 0)
y = hvd.allreduce(x)
if rank == 0:
    try:
        y.sum().backward()
        say("backward on one worker", False, "did not raise")
    except CollectiveError as exc:
        say("backward on one worker", "allreduce.noname" in str(exc) and ".grad" in str(exc), str(exc))
try:
    hvd.allreduce(torch.ones(1))
    say("the next unnamed call", rank != 0, "did not raise")
except CollectiveError as exc:
    say("the next unnamed call", True)
lined_up = hvd.allreduce(torch.full((2,), float(rank)), op=hvd.Sum)
say("unnamed calls line up again", torch.equal(lined_up, torch.full((2,), float(sum(range(size))))),
    str(lined_up))

# a wait that times out gives the call up (no worker goes on with a sum it abandoned); the
# same name called again meets the others' late calls
if rank == 0:
    patience, hvd.client().timeout = hvd.client().timeout, 0.5
    try:
        hvd.allreduce(torch.ones(2), name="given-up")
        say("timed out", False, "did not time out")
    except TimeoutError:
        say("timed out", True)
    hvd.client().timeout = patience
else:
    time.sleep(1.5)
late = hvd.allreduce(torch.full((2,), float(rank)), op=hvd.Sum, name="given-up")
say("after a timeout", torch.equal(late, torch.full((2,), float(sum(range(size))))), str(late))

# a duplicate name in flight is refused on the worker that makes it; the first call completes
first = hvd.allgather_async(torch.full((1, 2), float(rank)), name="duplicate_name")
try:
    hvd.allgather_async(torch.ones(1, 2), name="duplicate_name")
    say("duplicate name", False, "did not raise")
except ValueError:
    say("duplicate name", torch.equal(hvd.synchronize(first)[:, 0], torch.arange(size).float()))

# an exception in the user's code between calls, on one worker: it makes its calls anyway
try:
    if rank == 1:
        raise KeyError("the user's own bug")
except KeyError:
    pass
say("after a user exception", hvd.broadcast(torch.tensor([rank]), root_rank=2).item() == 2)

# join: the others' sums go on with the joined worker standing in; other kinds are refused
if rank == 0:
    last = hvd.join()
else:
    summed = hvd.allreduce(torch.ones(3), op=hvd.Sum, name="join.sum")
    say("sum beside join", torch.equal(summed, torch.full((3,), float(size - 1))), str(summed))
    averaged = hvd.allreduce(torch.full((3,), float(rank)), name="join.average")  # over all 3
    say("average beside join", torch.allclose(averaged, torch.full((3,), 1.0)), str(averaged))
    try:
        hvd.allgather(torch.ones(1), name="join.gather")
        say("allgather beside join", False, "did not raise")
    except CollectiveError as exc:
        say("allgather beside join", "join()" in str(exc), str(exc))
    last = hvd.join()
say("join's last", hvd.allgather_object(last) == [last] * size and last != 0, str(last))

# the racy ending of join: a joined worker's stand-in answer may still be on its way when it
# pushes the same key again in the next round; who joins first changes every round
for i in range(3 * ROUNDS):
    if rank == i % size:
        hvd.join()
    else:
        got = hvd.allreduce(torch.full((1 << 18,), float(i)), op=hvd.Sum, name="join.race")
        hvd.join()
        if not torch.equal(got, torch.full((1 << 18,), float(i * (size - 1)))):
            say("join stand-ins repeated", False, f"round {i}: {got}")
            break
else:
    say("join stand-ins repeated", True)

# re-initialisation keeps rank and size
hvd.shutdown()
try:
    hvd.allreduce(torch.ones(1))
    say("call after shutdown", False, "did not raise")
except RuntimeError:
    say("call after shutdown", not hvd.is_initialized())
hvd.init()
say("reinit", (hvd.rank(), hvd.size()) == (rank, size))

# keys do not depend on call order: worker 0 makes a call the others do not (each side is
# refused once all wait), and the next calls still meet
try:
    hvd.allreduce(torch.ones(1), name="rank0.extra") if rank == 0 else hvd.barrier()
    say("a call only worker 0 makes", False, "did not raise")
except CollectiveError as exc:
    say("a call only worker 0 makes", "wait elsewhere" in str(exc), str(exc))
for i in range(ROUNDS):  # the racy ending, many times: refusal, then a right answer
    try:
        hvd.allreduce(torch.ones(2 + (rank == 1 and i % 2)), name="again")
        mismatched = False
    except CollectiveError:
        mismatched = True
    got = hvd.allreduce(torch.full((3,), float(i + rank)), op=hvd.Sum, name="again.after")
    if mismatched != bool(i % 2) or not torch.equal(got, torch.full((3,), float(size * i + 3))):
        say("repeated refusals", False, f"round {i}: mismatched {mismatched}, got {got}")
        break
else:
    say("repeated refusals", True)

# a loop of unnamed calls cycles through a few data keys, not one key per call
before = len(hvd.client()._layouts)
handles = [hvd.allreduce_async(torch.full((4,), float(i)), op=hvd.Sum) for i in range(100)]
right = all(torch.equal(hvd.synchronize(h), torch.full((4,), float(i * size)))
            for i, h in enumerate(handles))
say("100 unnamed calls, few keys", right and len(hvd.client()._layouts) - before <= 16,
    f"{len(hvd.client()._layouts) - before} new keys")


class Halve(hvd.Compression.Compressor):
    """A user's horovod-style compressor: what is summed is half, decompress doubles it."""

    @staticmethod
    def compress(tensor):
        return tensor / 2, "ctx"

    @staticmethod
    def decompress(tensor, ctx):
        assert ctx == "ctx"
        return tensor * 2


t = torch.arange(6.0).view(2, 3) * (rank + 1)
want = torch.arange(6.0).view(2, 3) * sum(range(1, size + 1)) / size
say("user compressor allreduce", torch.allclose(hvd.allreduce(t, compression=Halve), want))
model = torch.nn.Linear(3, 2)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               named_parameters=model.named_parameters(), compression=Halve)
x = torch.full((1, 3), float(rank + 1))
model(x).sum().backward()
opt.step()
say("user compressor optimizer", torch.allclose(model.weight.grad, hvd.allreduce(
    torch.ones(2, 1) * x, name="expected.grad")))
hvd.barrier()
say("done", True)
