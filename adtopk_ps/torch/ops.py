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

Names: an operation named ``x`` is the collective ``<kind>.x`` (``byteps``,
``allreduce``, ``broadcast``, ``allgather``), so the same name in two kinds
of call does not collide. An unnamed one (where byteps and horovod allow
that) is named by the order of this worker's unnamed calls of its kind, as in
horovod. Every call is first agreed by its name across the workers (the
scheduler's coordinator): a call whose dtype, shape, op, root or compression
differs on one worker, or that failed on one worker's side, is refused on
every worker with the same :class:`~adtopk_ps.client.errors.CollectiveError`, and
the next call works. Its data then travels under a key made from the name,
dtype and shape alone, never from how many calls came before it.
"""
from __future__ import annotations

import enum
import itertools
import re
import weakref
from dataclasses import dataclass, replace
from typing import Callable

import torch

from adtopk_ps.client.handle import Agreement, Handle
from adtopk_ps.client.errors import CollectiveError
from adtopk_ps.client.ps_client import PSClient
from adtopk_ps.cluster.coordinator import JOIN, check_name
from adtopk_ps.compression import Compressor, SparsificationPolicy
from adtopk_ps.core.dtypes import FLOAT_DTYPES
from adtopk_ps.torch.agreement import compressor_label
from adtopk_ps.torch.compressors import Compression, compressor_of, is_cast
from adtopk_ps.torch.runtime import client

FLOATS = tuple(FLOAT_DTYPES.values())  # what travels as it is
UNNAMED_SLOTS = 16  # data keys that unnamed calls of one kind cycle through
_UNNAMED = re.compile(r"^(.*\.noname)\.(\d+)((?:\.grad)*)$")  # a gradient's call keeps its slot
EXACT = 1 << 53  # float64 holds every integer below this


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
        self.slots: dict[str, Handle] = {}  # an unnamed call's data slot -> its last user


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
    if tensor.is_meta:
        raise ValueError(f"{what}: a tensor on the meta device has no values to send; "
                         f"materialise it first (e.g. to_empty(device=...) and initialise)")
    if tensor.dtype in FLOATS:
        return tensor.detach().contiguous()
    if tensor.dtype == torch.bool or not (tensor.is_floating_point() or tensor.is_complex()):
        largest = max(abs(int(tensor.max())), abs(int(tensor.min()))) \
            if tensor.dtype == torch.int64 and tensor.numel() else 0  # Python ints: no overflow
        if largest * size >= EXACT:
            raise ValueError(f"{what}: int64 values up to {largest} summed over {size} workers "
                             f"may reach 2**53, beyond what travels exactly (as float64)")
        return tensor.detach().to(torch.float64).contiguous()
    raise ValueError(f"{what}: tensors of dtype {tensor.dtype} are not supported; supported: "
                     f"{[str(d) for d in FLOATS]}, integer types and bool")


def dtype_name(dtype: torch.dtype) -> str:
    """``float32`` for torch.float32: how requests and key names spell a dtype."""
    return str(dtype).removeprefix("torch.")


def _slot(name: str) -> str | None:
    """The data slot of an unnamed call's name (``allreduce.noname.17`` -> ``allreduce.noname.slot1``);
    None for a named one."""
    match = _UNNAMED.match(name)
    return f"{match[1]}.slot{int(match[2]) % UNNAMED_SLOTS}{match[3]}" if match else None


def key_name(name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> str:
    """The key a collective's data travels under: its name (an unnamed call's slot), the dtype
    and shape it travels in (so that a name used again with another shape gets another key)."""
    return f"{_slot(name) or name}|{dtype_name(dtype)}|{'x'.join(map(str, shape)) or 'scalar'}"


def collective_name(kind: str, name: str | None) -> str:
    """``kind.name``; an unnamed call is named by how many unnamed calls of its kind this
    worker made before it (horovod's rule: every worker makes its unnamed calls in one order).
    Every call so named is agreed, so a worker whose call failed on its side still counts it.
    A given name is checked here (:func:`~adtopk_ps.cluster.coordinator.check_name`): one that
    is not valid UTF-8 or is over ``MAX_NAME_BYTES`` raises ``ValueError`` on this worker
    before anything is sent (a worker whose name passes waits as for a call skipped).

    An unnamed call's data cycles through :data:`UNNAMED_SLOTS` keys (see :func:`claim`), so
    that a loop of unnamed calls does not make a key per call."""
    if name is None:
        return client().unnamed_name(kind)
    return f"{kind}.{check_name(name)}"


def refuse_everywhere(name: str, error: BaseException) -> None:
    """This worker's side of collective ``name`` failed: every other worker's call of it is
    refused with the reason, once each has made it; then ``error`` is raised here."""
    try:
        client().collective(name, {}, failed=f"{type(error).__name__}: {error}").wait()
    except (CollectiveError, TimeoutError):
        pass
    raise error


def _route(compressor: Compressor | None, wire: torch.Tensor) -> Compressor | None:
    """What compresses ``wire``: a cast (fp16) every floating tensor; a sparsifier the tensors
    the optimizer would sparsify too (2-D and up, not small), others travel dense."""
    if compressor is None or is_cast(compressor):
        return compressor
    return None if SparsificationPolicy(compressor.ratio).route(wire).dense else compressor


def claim(name: str) -> None:
    """Wait until an unnamed call's data slot is free: its last user is done (told to the
    scheduler as any wait is, so that a last user no worker will complete is refused)."""
    slot = _slot(name)
    previous = _table(client()).slots.get(slot) if slot is not None else None
    if previous is not None:
        previous.settle()


def occupy(name: str, handle: Handle) -> None:
    """An unnamed call's ``handle`` holds its data slot until it is done."""
    slot = _slot(name)
    if slot is not None:
        _table(client()).slots[slot] = handle


def _register(c: PSClient, name: str, handle: Handle,
              finish: Callable[[torch.Tensor], torch.Tensor]) -> int:
    occupy(name, handle)
    table = _table(c)
    ident = next(table.ids)
    table.ops[ident] = _Op(handle, finish)
    return ident


def submit_agreed(tensor: torch.Tensor, *, what: str, kind: str, average: bool | None = None,
            op: object = None, compression: object = None, priority: int | None = None,
            inplace: bool = False, root: int | None = None, name: str | None = None,
            full_name: str | None = None, scale: tuple[float, float] = (1.0, 1.0)) -> int:
    """Start one agreed sum; returns its handle (for :func:`poll` and :func:`synchronize`).
    ``root``: only that rank contributes (a
    broadcast). ``full_name`` is used as it is; otherwise ``kind`` and ``name`` make it (see
    :func:`collective_name`). Anything wrong on this worker's side (``op``, ``average``,
    ``compression``, the tensor, ``root``) is refused on every worker
    (:func:`refuse_everywhere`): it is checked after the call has its name."""
    c = client()
    name = full_name or collective_name(kind, name)
    claim(name)
    try:
        average = averages(op, average)
        compressor = compressor_of(compression)
        wire = _wire(tensor, what, c.size)
        integral = wire.dtype != tensor.dtype
        if integral and average and tensor.dtype == torch.bool:
            raise ValueError(f"{what}: the average of a bool tensor is not defined; use op=Sum")
        if root is not None and (not isinstance(root, int) or not 0 <= root < c.size):
            raise ValueError(f"{what}: root_rank {root!r} is not a worker rank (0..{c.size - 1})")
    except (TypeError, ValueError) as exc:
        refuse_everywhere(name, exc)
    pre, post = scale
    send = wire
    if root is not None and c.rank != root:
        send = torch.zeros_like(wire)
    elif pre != 1.0:  # an integer tensor is scaled in float64 and cut to its dtype, as horovod
        send = wire * pre if not integral else (wire * pre).to(tensor.dtype).to(wire.dtype)
    route = None if integral else _route(compressor, send)
    # a contiguous floating tensor in place receives the answer in its own memory
    direct = inplace and not integral and send.data_ptr() == tensor.data_ptr()
    key = key_name(name, send.dtype, tuple(send.shape))
    match = {"kind": kind, "dtype": dtype_name(tensor.dtype),
             "shape": list(tensor.shape), "op": "average" if average else "sum",
             "scale": [pre, post], "root": root,
             "compression": "none" if route is None else compressor_label(route)}

    def start(agreement: Agreement, handle: Handle) -> None:
        c.push_agreed(handle, key, send, route, c.size if average and not integral else 1,
                      tensor.detach() if direct else None, priority)

    handle = c.collective(name, match, start, own=[key, dtype_name(send.dtype), list(send.shape)],
                          standin=root is None)

    def finish(result: torch.Tensor) -> torch.Tensor:
        if integral:
            result = (result * post if post != 1.0 else result).to(tensor.dtype)
            if average:
                result = result.floor_divide_(c.size)
        elif post != 1.0:
            result = result.mul_(post)
        if inplace and result.data_ptr() != tensor.data_ptr():
            with torch.no_grad():
                tensor.copy_(result)
        return tensor if inplace else result

    return _register(c, name, handle, finish)


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
    return submit_agreed(tensor, what="push_pull_async", average=average, compression=compression,
                   priority=_byteps_priority(priority), kind="byteps", name=name)


def push_pull_async_inplace(tensor: torch.Tensor, average: bool = True, name: str | None = None,
                            version: int = 0, priority: int = 0, staleness: int = 0) -> int:
    """Like :func:`push_pull_async`, the result written into ``tensor``."""
    _no_staleness(staleness)
    return submit_agreed(tensor, what="push_pull_async_inplace", average=average,
                   priority=_byteps_priority(priority), inplace=True, kind="byteps", name=name)


byteps_push_pull = push_pull_async_inplace


def push_pull_inplace(tensor: torch.Tensor, average: bool = True, name: str | None = None,
                      version: int = 0, priority: int = 0, staleness: int = 0) -> torch.Tensor:
    """Sum (or average) ``tensor`` over every worker, in place; returns ``tensor``."""
    return synchronize(push_pull_async_inplace(tensor, average, name, version, priority, staleness))


@dataclass(frozen=True)
class _CallSpec:
    """Everything about one differentiable reduction but the tensor."""

    kind: str
    what: str
    name: str | None
    average: bool | None
    compression: object
    op: object = None
    priority: int | None = None
    scale: tuple[float, float] = (1.0, 1.0)
    full_name: str | None = None  # set for a gradient's call: the forward's name + ".grad"


class _Reduce(torch.autograd.Function):
    """A push_pull whose backward push_pulls the gradient the same way, under the forward's
    name and ``.grad`` (never the unnamed-call order, which a backward pass run on some
    workers only would shift)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, spec: _CallSpec) -> torch.Tensor:
        ident = submit_agreed(tensor, what=spec.what, average=spec.average, op=spec.op,
                        compression=spec.compression, priority=spec.priority, kind=spec.kind,
                        name=spec.name, full_name=spec.full_name, scale=spec.scale)
        ctx.spec, ctx.name = spec, _op(ident, pop=False).handle.name
        return synchronize(ident)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _Reduce.apply(grad, replace(ctx.spec, full_name=f"{ctx.name}.grad")), None


def _gradient_sum(grad: torch.Tensor, forward: str) -> torch.Tensor:
    """The sum over the workers of ``grad``, the gradient of the call named ``forward``."""
    return synchronize(submit_agreed(grad, what="allreduce", kind="allreduce", op=Sum,
                               full_name=f"{forward}.grad"))


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
    return _Reduce.apply(tensor, _CallSpec("byteps", "push_pull", name, average, compression,
                                            priority=_byteps_priority(priority)))


def declare(name: str, staleness: int = 0) -> int:
    """byteps' ``declare``: checks ``name``. Keys come from names alone here, so the order in
    which workers declare (or do not) changes nothing."""
    _no_staleness(staleness)
    check_name(name)
    return 0


# --- horovod ---------------------------------------------------------------------------------

def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                    op: object = None, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0) -> int:
    """Start averaging (``op=Average``, the default) or summing ``tensor`` over every worker."""
    return submit_agreed(tensor, what="allreduce_async", average=average, op=op, kind="allreduce",
                   name=name, scale=(prescale_factor, postscale_factor))


def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                     op: object = None, prescale_factor: float = 1.0,
                     postscale_factor: float = 1.0) -> int:
    """Like :func:`allreduce_async`, the result written into ``tensor``."""
    return submit_agreed(tensor, what="allreduce_async_", average=average, op=op, inplace=True,
                   kind="allreduce", name=name, scale=(prescale_factor, postscale_factor))


def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression: object = Compression.none, op: object = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> torch.Tensor:
    """The average (``op=Average``, the default) or sum (``op=Sum``) of ``tensor`` over every
    worker, as a new tensor; differentiable.

    Example::

        loss = hvd.allreduce(loss, op=hvd.Average)
    """
    return _Reduce.apply(tensor, _CallSpec("allreduce", "allreduce", name, average, compression,
                                            op=op, scale=(prescale_factor, postscale_factor)))


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
               op: object = None, prescale_factor: float = 1.0,
               postscale_factor: float = 1.0) -> torch.Tensor:
    """:func:`allreduce` in place; returns ``tensor``."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor,
                                        postscale_factor))


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None) -> int:
    """Start copying the root's ``tensor`` to every worker (a new tensor on each)."""
    return submit_agreed(tensor, what="broadcast_async", average=False, root=root_rank,
                   kind="broadcast", name=name)


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None) -> int:
    """Like :func:`broadcast_async`, the root's value written into ``tensor``."""
    return submit_agreed(tensor, what="broadcast_async_", average=False, root=root_rank,
                   inplace=True, kind="broadcast", name=name)


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, root_rank: int, name: str | None) -> torch.Tensor:
        ident = broadcast_async(tensor, root_rank, name)
        ctx.root_rank, ctx.name = root_rank, _op(ident, pop=False).handle.name
        return synchronize(ident)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        summed = _gradient_sum(grad, ctx.name)  # every worker's output came from the root's input
        return (summed if client().rank == ctx.root_rank else torch.zeros_like(summed)), None, None


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None) -> torch.Tensor:
    """The root's ``tensor`` on every worker, as a new tensor; differentiable (the root's
    gradient is the sum of every worker's, as horovod's test_horovod_broadcast_grad expects).

    Example::

        seed = hvd.broadcast(torch.tensor(seed), root_rank=0).item()
    """
    return _Broadcast.apply(tensor, root_rank, name)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None) -> torch.Tensor:
    """:func:`broadcast` in place; returns ``tensor``."""
    return synchronize(broadcast_async_(tensor, root_rank, name))


def allgather_async(tensor: torch.Tensor, name: str | None = None) -> int:
    """Start concatenating every worker's ``tensor`` along dimension 0 (first dimensions may
    differ between workers, the others must not). The workers agree the dtype and every
    dimension but the first, and learn each other's first dimension; each pushes a table
    with its own rows filled."""
    c = client()
    name = collective_name("allgather", name)
    claim(name)
    try:
        t = tensor.unsqueeze(0) if isinstance(tensor, torch.Tensor) and tensor.dim() == 0 else tensor
        wire = _wire(t, "allgather", c.size)
    except (TypeError, ValueError) as exc:
        refuse_everywhere(name, exc)
    match = {"kind": "allgather", "dtype": dtype_name(t.dtype), "shape[1:]": list(t.shape[1:])}

    def start(agreement: Agreement, handle: Handle) -> None:
        offset, total = _rows(agreement, c.rank)[0], sum(int(n) for n in agreement.own.values())
        table = torch.zeros((total, *t.shape[1:]), dtype=wire.dtype, device=wire.device)
        table[offset:offset + t.shape[0]] = wire
        c.push_agreed(handle, key_name(name, table.dtype, tuple(table.shape)), table)

    def finish(result: torch.Tensor) -> torch.Tensor:
        return result.to(t.dtype)

    handle = c.collective(name, match, start, own=int(t.shape[0]))
    return _register(c, name, handle, finish)


def _rows(agreement: Agreement, rank: int) -> tuple[int, int]:
    """Worker ``rank``'s first row and row count in an agreed allgather."""
    counts = [int(agreement.own[r]) for r in range(len(agreement.own))]
    return sum(counts[:rank]), counts[rank]


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, name: str | None) -> torch.Tensor:
        ident = allgather_async(tensor, name)
        handle = _op(ident, pop=False).handle
        result = synchronize(ident)
        ctx.offset, ctx.rows = _rows(handle.agreement, client(paused_ok=True).rank)
        ctx.name = handle.name
        return result

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _gradient_sum(grad, ctx.name).narrow(0, ctx.offset, ctx.rows), None


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
    """Wait until every worker has joined; returns the rank of the last to join, the same on
    every worker. While a worker waits here, the others' allreduces and push_pulls go on
    with it standing in with zeros (an average still divides by every worker, as in
    horovod); any other collective they call is refused on each of them, as horovod does."""
    return client().collective(JOIN, {"kind": "join"}).wait().last
