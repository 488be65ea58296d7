"""byteps' and horovod's functional collectives over the parameter servers.

Every one is a push_pull: a sum over the workers, which the servers
compute. ``allreduce`` is a push_pull, a broadcast is a push_pull to which
only the root contributes (the others push zeros), an allgather is a
push_pull of a table in which each worker fills its own rows. Asynchronous
calls return integer handles for :func:`poll` and :func:`synchronize`, as
in byteps and horovod.

Floating tensors travel in their own dtype (or as the compression says);
integer and bool tensors travel as float64, exact while every sum stays
below 2**53, and come back in their dtype. An integer average is the floor
of the sum over the workers, as byteps and horovod do.

Names: an operation named ``x`` uses the server key ``<kind>.x`` (``byteps``,
``allreduce``, ``broadcast``, ``allgather``), so the same name in two kinds
of call does not collide. An unnamed one (where byteps and horovod allow
that) gets a name from the order of unnamed calls of its kind, dtype and
shape, cycling through :data:`UNNAMED_KEYS` keys, so every worker must make
its unnamed calls in one order, as horovod requires too.
"""
from __future__ import annotations

import enum
import itertools
import time
import weakref
from dataclasses import dataclass, replace
from typing import Callable

import torch

from ..client import Handle, PSClient
from ..compression import Compressor, SparsificationPolicy
from ..dtypes import FLOAT_DTYPES
from .compression import Compression, compressor_of, is_cast
from .runtime import client

FLOATS = tuple(FLOAT_DTYPES.values())  # what travels as it is
EXACT = 1 << 53  # float64 holds every integer below this
UNNAMED_KEYS = 16  # server keys an unnamed call of one kind, dtype and shape cycles through


class ReduceOp(enum.IntEnum):
    """horovod's reduction ops (same values); the servers sum, so Average and Sum are served."""

    AVERAGE = 0
    SUM = 1
    ADASUM = 2
    MIN = 3
    MAX = 4
    PRODUCT = 5


Average, Sum, Adasum, Min, Max, Product = (ReduceOp.AVERAGE, ReduceOp.SUM, ReduceOp.ADASUM,
                                           ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT)


def averages(op: object = None, average: bool | None = None) -> bool:
    """Whether horovod's ``op`` (or its deprecated ``average``) asks for the average; any op
    the parameter servers cannot compute is refused, named."""
    if op is not None and average is not None:
        raise ValueError("give op= or the deprecated average=, not both")
    if op is None:
        return average is None or bool(average)
    if op == Average:
        return True
    if op == Sum:
        return False
    name = ReduceOp(op).name if op in set(ReduceOp) else repr(op)
    raise ValueError(f"reduction op {name} is not supported: the parameter servers only sum; "
                     f"use op=Average or op=Sum")


@dataclass
class _Op:
    handle: Handle
    finish: Callable[[torch.Tensor], torch.Tensor]


class _Table:
    """One connection's pending operations and unnamed-call counters."""

    def __init__(self) -> None:
        self.ops: dict[int, _Op] = {}
        self.ids = itertools.count(1)
        self.unnamed: dict[str, int] = {}
        self.slots: dict[str, Handle] = {}


_tables: "weakref.WeakKeyDictionary[PSClient, _Table]" = weakref.WeakKeyDictionary()


def _table(c: PSClient) -> _Table:
    table = _tables.get(c)
    if table is None:
        table = _tables[c] = _Table()
    return table


def _wire(tensor: object, what: str, size: int) -> torch.Tensor:
    """``tensor`` as it travels: floats as they are, integers and bools as float64."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} takes a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise ValueError(f"{what}: a {tensor.layout} tensor is not supported; pass a dense one")
    if tensor.dtype in FLOATS:
        return tensor.detach().contiguous()
    if tensor.dtype == torch.bool or not (tensor.is_floating_point() or tensor.is_complex()):
        if tensor.dtype == torch.int64 and tensor.numel() and \
                int(tensor.detach().abs().max()) * size >= EXACT:
            raise ValueError(f"{what}: int64 values up to {int(tensor.detach().abs().max())} "
                             f"summed over {size} workers may reach 2**53, beyond what travels "
                             f"exactly (as float64)")
        return tensor.detach().to(torch.float64).contiguous()
    raise ValueError(f"{what}: tensors of dtype {tensor.dtype} are not supported; supported: "
                     f"{[str(d) for d in FLOATS]}, integer types and bool")


def _signature(wire: torch.Tensor, shape: tuple[int, ...]) -> str:
    return f"{str(wire.dtype).removeprefix('torch.')}.{'x'.join(map(str, shape)) or 'scalar'}"


def _key(table: _Table, kind: str, name: str | None, signature: str) -> str:
    """The server key of a call: ``kind.name``, or for an unnamed call the next of its
    signature's keys (waiting, if need be, for that key's previous use to be answered)."""
    if name is not None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty string, got {name!r}")
        return f"{kind}.{name}"
    sig = f"{kind}.noname.{signature}"
    n = table.unnamed.get(sig, 0)
    table.unnamed[sig] = n + 1
    key = f"{sig}.{n % UNNAMED_KEYS}"
    previous = table.slots.get(key)
    if previous is not None and not previous.done():
        try:
            previous.wait()
        except Exception:  # noqa: BLE001 - its own synchronize() reports it
            pass
    return key


def _route(compressor: Compressor | None, wire: torch.Tensor) -> Compressor | None:
    """What compresses ``wire``: a cast (fp16) every floating tensor; a sparsifier the tensors
    the optimizer would sparsify too (2-D and up, not small), others travel dense."""
    if compressor is None or is_cast(compressor):
        return compressor
    return None if SparsificationPolicy(compressor.ratio).route(wire).dense else compressor


def _submit(key: str | None, tensor: torch.Tensor, *, what: str, average: bool,
            compression: object = None, priority: int | None = None, inplace: bool = False,
            root: int | None = None, kind: str = "", name: str | None = None,
            scale: tuple[float, float] = (1.0, 1.0)) -> int:
    """Start one push_pull; returns its handle. ``root``: only that rank contributes (a
    broadcast). ``key`` None: ``kind`` and ``name`` make it (see :func:`_key`)."""
    c = client()
    compressor = compressor_of(compression)
    wire = _wire(tensor, what, c.size)
    integral = wire.dtype != tensor.dtype
    if integral and average and tensor.dtype == torch.bool:
        raise ValueError(f"{what}: the average of a bool tensor is not defined; use op=Sum")
    pre, post = scale
    if integral and (pre, post) != (1.0, 1.0):
        raise ValueError(f"{what}: prescale/postscale factors apply to floating tensors only, "
                         f"got {tensor.dtype}")
    if root is not None and not 0 <= root < c.size:
        raise ValueError(f"root_rank {root} is not a worker rank (0..{c.size - 1})")
    table = _table(c)
    unnamed = key is None and name is None
    if key is None:
        key = _key(table, kind, name, _signature(wire, tuple(tensor.shape)))
    send = wire
    if root is not None and c.rank != root:
        send = torch.zeros_like(wire)
    elif pre != 1.0:
        send = wire * pre
    # a contiguous floating tensor in place receives the answer in its own memory
    direct = inplace and not integral and send.data_ptr() == tensor.data_ptr()
    handle = c.push_pull(send, key, None if integral else _route(compressor, send),
                         average=average and not integral, priority=priority,
                         out=tensor.detach() if direct else None)
    if unnamed:
        table.slots[key] = handle

    def finish(result: torch.Tensor) -> torch.Tensor:
        if integral:
            result = result.to(tensor.dtype)
            if average:
                result = result.floor_divide_(c.size)
        elif post != 1.0:
            result = result.mul_(post)
        if inplace and result.data_ptr() != tensor.data_ptr():
            with torch.no_grad():
                tensor.copy_(result)
        return tensor if inplace else result

    ident = next(table.ids)
    table.ops[ident] = _Op(handle, finish)
    return ident


def poll(handle: int) -> bool:
    """Whether the operation behind ``handle`` has finished (synchronize() will not block)."""
    return _op(handle, pop=False).handle.done()


def synchronize(handle: int) -> torch.Tensor:
    """Wait for the operation behind ``handle``; returns its result (raises what it failed with).

    Example::

        h = bps.push_pull_async(grad, name="grad")
        averaged = bps.synchronize(h)
    """
    op = _op(handle, pop=True)
    return op.finish(op.handle.wait())


def _op(handle: int, pop: bool) -> _Op:
    ops = _table(client(paused_ok=True)).ops  # a finished operation may be read while suspended
    op = ops.pop(handle, None) if pop else ops.get(handle)
    if op is None:
        raise ValueError(f"handle {handle!r} is not a pending operation (unknown, or "
                         f"synchronized already)")
    return op


# --- byteps ----------------------------------------------------------------------------------

def _byteps_priority(priority: int) -> int | None:
    """byteps sends the larger priority first; our queue the smaller. 0 keeps our order
    (later layers, whose gradients come first, first)."""
    return -priority if priority else None


def _no_staleness(staleness: int) -> None:
    if staleness:
        raise ValueError(f"staleness={staleness} (pipelined SGD) is not supported; use 0")


def push_pull_async(tensor: torch.Tensor, average: bool = True, name: str | None = None,
                    version: int = 0, priority: int = 0, *, compression: object = Compression.none
                    ) -> int:
    """Start summing (or averaging) ``tensor`` over every worker; ``tensor`` is not modified.
    Returns a handle for :func:`poll` and :func:`synchronize`. ``version`` is byteps' and unused."""
    return _submit(None, tensor, what="push_pull_async", average=average, compression=compression,
                   priority=_byteps_priority(priority), kind="byteps", name=name)


def push_pull_async_inplace(tensor: torch.Tensor, average: bool = True, name: str | None = None,
                            version: int = 0, priority: int = 0, staleness: int = 0) -> int:
    """Like :func:`push_pull_async`, the result written into ``tensor``."""
    _no_staleness(staleness)
    return _submit(None, tensor, what="push_pull_async_inplace", average=average,
                   priority=_byteps_priority(priority), inplace=True, kind="byteps", name=name)


byteps_push_pull = push_pull_async_inplace


def push_pull_inplace(tensor: torch.Tensor, average: bool = True, name: str | None = None,
                      version: int = 0, priority: int = 0, staleness: int = 0) -> torch.Tensor:
    """Sum (or average) ``tensor`` over every worker, in place; returns ``tensor``."""
    return synchronize(push_pull_async_inplace(tensor, average, name, version, priority, staleness))


@dataclass(frozen=True)
class _Reduction:
    """Everything about one differentiable reduction but the tensor."""

    kind: str
    what: str
    name: str | None
    average: bool
    compression: object
    priority: int | None = None
    scale: tuple[float, float] = (1.0, 1.0)
    grad_named: bool = True  # byteps' backward reuses the name; horovod's goes unnamed


class _Reduce(torch.autograd.Function):
    """A push_pull whose backward push_pulls the gradient the same way."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, spec: _Reduction) -> torch.Tensor:
        ctx.spec = spec
        return synchronize(_submit(None, tensor, what=spec.what, average=spec.average,
                                   compression=spec.compression, priority=spec.priority,
                                   kind=spec.kind, name=spec.name, scale=spec.scale))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        spec = ctx.spec if ctx.spec.grad_named else replace(ctx.spec, name=None)
        return _Reduce.apply(grad, spec), None


def push_pull(tensor: torch.Tensor, average: bool = True, name: str | None = None,
              version: int = 0, priority: int = 0,
              compression: object = Compression.none) -> torch.Tensor:
    """The sum (or average) of ``tensor`` over every worker, as a new tensor; differentiable
    (the backward pass push_pulls the gradient). As in byteps, ``name`` is required.

    Example::

        accuracy = bps.push_pull(torch.tensor(correct / total), name="accuracy").item()
    """
    if name is None:
        raise ValueError("push_pull needs a name: push_pull(tensor, name=...), as in byteps")
    compressor_of(compression)  # refused here, before autograd wraps the error
    return _Reduce.apply(tensor, _Reduction("byteps", "push_pull", name, bool(average), compression,
                                            _byteps_priority(priority)))


def declare(name: str, staleness: int = 0) -> int:
    """Give ``name`` its place in the key order now, before its first push_pull; every worker
    must declare in one order (byteps' ``declare``)."""
    _no_staleness(staleness)
    if not isinstance(name, str) or not name:
        raise ValueError(f"declare needs a name, got {name!r}")
    client().reserve(f"byteps.{name}")
    return 0


# --- horovod ---------------------------------------------------------------------------------

def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                    op: object = None, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0) -> int:
    """Start averaging (``op=Average``, the default) or summing ``tensor`` over every worker."""
    return _submit(None, tensor, what="allreduce_async", average=averages(op, average),
                   kind="allreduce", name=name, scale=(prescale_factor, postscale_factor))


def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                     op: object = None, prescale_factor: float = 1.0,
                     postscale_factor: float = 1.0) -> int:
    """Like :func:`allreduce_async`, the result written into ``tensor``."""
    return _submit(None, tensor, what="allreduce_async_", average=averages(op, average),
                   inplace=True, kind="allreduce", name=name,
                   scale=(prescale_factor, postscale_factor))


def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression: object = Compression.none, op: object = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> torch.Tensor:
    """The average (``op=Average``, the default) or sum (``op=Sum``) of ``tensor`` over every
    worker, as a new tensor; differentiable.

    Example::

        loss = hvd.allreduce(loss, op=hvd.Average)
    """
    mean = averages(op, average)
    compressor_of(compression)
    return _Reduce.apply(tensor, _Reduction("allreduce", "allreduce", name, mean, compression,
                                            scale=(prescale_factor, postscale_factor),
                                            grad_named=False))


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
               op: object = None, prescale_factor: float = 1.0,
               postscale_factor: float = 1.0) -> torch.Tensor:
    """:func:`allreduce` in place; returns ``tensor``."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor,
                                        postscale_factor))


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None) -> int:
    """Start copying the root's ``tensor`` to every worker (a new tensor on each)."""
    return _submit(None, tensor, what="broadcast_async", average=False, root=root_rank,
                   kind="broadcast", name=name)


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None) -> int:
    """Like :func:`broadcast_async`, the root's value written into ``tensor``."""
    return _submit(None, tensor, what="broadcast_async_", average=False, root=root_rank,
                   inplace=True, kind="broadcast", name=name)


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, root_rank: int, name: str | None) -> torch.Tensor:
        ctx.root_rank = root_rank
        return synchronize(broadcast_async(tensor, root_rank, name))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        summed = allreduce(grad, op=Sum)
        return (summed if client().rank == ctx.root_rank else torch.zeros_like(summed)), None, None


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None) -> torch.Tensor:
    """The root's ``tensor`` on every worker, as a new tensor; differentiable (the root's
    gradient is the sum of every worker's).

    Example::

        seed = hvd.broadcast(torch.tensor(seed), root_rank=0).item()
    """
    return _Broadcast.apply(tensor, root_rank, name)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None) -> torch.Tensor:
    """:func:`broadcast` in place; returns ``tensor``."""
    return synchronize(broadcast_async_(tensor, root_rank, name))


def _allgather_start(tensor: torch.Tensor, name: str | None) -> tuple[int, int, int]:
    """Start an allgather; returns its handle, this worker's first row in the result and
    its row count."""
    c = client()
    t = tensor.unsqueeze(0) if tensor.dim() == 0 else tensor
    wire = _wire(t, "allgather", c.size)
    base = _key(_table(c), "allgather", name, _signature(wire, tuple(t.shape[1:])))
    rows = torch.zeros(c.size, dtype=torch.float64)
    rows[c.rank] = t.shape[0]
    counts = [int(n) for n in c.push_pull(rows, f"{base}.rows", average=False).wait().tolist()]
    offset = sum(counts[:c.rank])
    table = torch.zeros((sum(counts), *t.shape[1:]), dtype=wire.dtype, device=wire.device)
    table[offset:offset + t.shape[0]] = wire
    handle = _submit(f"{base}.{sum(counts)}", table, what="allgather", average=False)
    op = _table(c).ops[handle]
    if wire.dtype != t.dtype:  # back to the caller's dtype
        inner = op.finish
        op.finish = lambda result: inner(result).to(t.dtype)
    return handle, offset, t.shape[0]


def allgather_async(tensor: torch.Tensor, name: str | None = None) -> int:
    """Start concatenating every worker's ``tensor`` along dimension 0 (first dimensions may
    differ between workers, the others must not)."""
    return _allgather_start(tensor, name)[0]


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, name: str | None) -> torch.Tensor:
        handle, ctx.offset, ctx.rows = _allgather_start(tensor, name)
        return synchronize(handle)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return allreduce(grad, op=Sum).narrow(0, ctx.offset, ctx.rows), None


def allgather(tensor: torch.Tensor, name: str | None = None) -> torch.Tensor:
    """Every worker's ``tensor`` concatenated along dimension 0, in rank order; first
    dimensions may differ between workers. Differentiable.

    Example::

        predictions = hvd.allgather(model(x).argmax(1))   # every worker's, however many
    """
    return _Allgather.apply(tensor, name)


def barrier() -> None:
    """Wait until every worker has reached this barrier."""
    client().barrier()


def join(device: int = -1) -> int:
    """Wait until every worker has joined; returns the rank of the last to join (by the
    workers' clocks). Unlike horovod's, workers that joined do not stand in for the others'
    allreduces: every worker must make the same collective calls."""
    c = client()
    arrived = torch.zeros(c.size, dtype=torch.float64)
    arrived[c.rank] = time.time()
    times = c.push_pull(arrived, "join.arrivals", average=False).wait()
    return int(torch.argmax(times))

