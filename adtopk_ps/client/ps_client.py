"""The worker's side of the parameter server (ps-lite's KVWorker): the caller's API.

``push_pull`` returns at once with a handle; the engine thread (engine.py)
compresses, sends and collects the answers. ``declare`` gives a tensor its key
layout (cluster/membership.py's ``KeyLayout``), whose keys come from the tensor's name,
dtype and shape alone.

``collective`` is the other way in, for calls that the workers' code may make
differently: the scheduler first agrees the call by its name across every
worker (coordinator.py), and only then does ``start`` push, under a key that
comes from the name alone. A call that differs on one worker is refused on
every worker, with the same error.
"""
from __future__ import annotations

import logging
import re
import time
from typing import Callable

import torch
import zmq

from adtopk_ps import wire
from adtopk_ps.client.engine import Engine
from adtopk_ps.client.errors import CollectiveError, MembershipChanged
from adtopk_ps.client.handle import Agreement, Handle
from adtopk_ps.client.ledger import Ledger
from adtopk_ps.client.server_residuals import keys_of, saved, to_restore
from adtopk_ps.client.slicer import Slicer
from adtopk_ps.cluster.coordinator import MAX_AGREED_NAME_BYTES, check_name
from adtopk_ps.cluster.membership import ClusterConfig, KeyLayout, make_key, name_id
from adtopk_ps.cluster.placement import Item, exchange_bytes
from adtopk_ps.cluster.transport import ClusterError, security
from adtopk_ps.compression import Compressor, Dense
from adtopk_ps.core.dtypes import FLOAT_DTYPES
from adtopk_ps.core.env import env_int
from adtopk_ps.core.timing import fastest

WIRE_FLOATS = tuple(FLOAT_DTYPES.values())  # the dtypes a push carries
PRUNE_AT = 1024  # collectives remembered by name before the finished ones are dropped
_UNNAMED = re.compile(r"^(.*)\.noname\.(\d+)$")
WAITING_NOTICE_S = 5.0  # between the notices of a worker waiting for others to join

log = logging.getLogger("adtopk_ps")

__all__ = ["PSClient"]


class PSClient:
    """One worker's connection to the scheduler and every server."""

    def __init__(self, config: ClusterConfig | None = None, ctx: zmq.Context | None = None):
        self.config = config or ClusterConfig.from_env(role="worker")
        self.timeout = float(env_int("PS_PUSH_PULL_TIMEOUT_S", 600, minimum=1))
        self.ctx = ctx or zmq.Context.instance()
        # a bad PS_CURVE_KEYS fails here, naming the variable
        self.encrypted = security(self.ctx).keys is not None
        self._layouts: dict[tuple, KeyLayout] = {}  # by name, dtype and shape
        self._named_layouts: dict[str, KeyLayout] = {}  # by name, the last declared
        self._order: dict[str, int] = {}  # names in the order first declared: later goes first
        self._steps: dict[str, int] = {}
        self._last: dict[str, Handle] = {}
        self._collectives: dict[str, Handle] = {}  # by name, the last collective of each
        self._unnamed: dict[str, int] = {}  # unnamed collectives made so far, by kind
        self._closed = False
        self.slicer = Slicer(self.config.num_servers, self.config.partition_bytes,
                             self.config.placement, self.config.elastic)
        self._engine = Engine(self.config, self.ctx, self.slicer)
        self._engine.on_standin = self._stand_in
        try:
            self._engine.start()
        except BaseException:
            self._closed = True
            raise

    @property
    def rank(self) -> int:
        """This worker's rank, as the scheduler gave it."""
        return self._engine.rank

    @property
    def engine(self) -> Engine:
        """The engine thread's side of this connection."""
        return self._engine

    @property
    def servers(self) -> list[str]:
        """The servers' addresses, by server rank."""
        return self._engine.servers

    @property
    def bytes_pushed(self) -> int:
        """Bytes of every push sent so far."""
        return self._engine.ledger.bytes_pushed

    @property
    def bytes_pulled(self) -> int:
        """Bytes of every answer received so far."""
        return self._engine.ledger.bytes_pulled

    @property
    def ledger(self) -> Ledger:
        """Bytes pushed to and pulled from each server so far, and the width of the answers to
        sparse pushes (:mod:`adtopk_ps.client.ledger`)."""
        return self._engine.ledger

    @property
    def compress_seconds(self) -> float:
        """Seconds the engine has spent compressing."""
        return self._engine.compress_seconds

    @property
    def credit(self) -> int:
        """The credit window in bytes (0: none; ``PS_CREDIT_BYTES``): pushes beyond it wait
        in need order (credit.py). Set between steps, it orders the coming pushes by need, or
        stops doing so.

        Example::

            client.credit = 256 << 10
        """
        return self._engine.credit

    @credit.setter
    def credit(self, window: int) -> None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 0:
            raise ValueError(f"credit must be an integer number of bytes >= 0, got {window!r}")
        self._engine.set_credit(window)

    def push_pull(self, tensor: torch.Tensor, name: str, compressor: Compressor | None = None,
                  average: bool = True, priority: int | None = None,
                  ratio: float | None = None, step: int | None = None,
                  out: torch.Tensor | None = None) -> Handle:
        """Start summing ``tensor`` across workers; do not modify it until the handle is done.

        ``out`` receives the result (default: a new tensor); it may be
        ``tensor`` itself, as a key's answer comes only after the server has
        every push of it, this worker's included. ``ratio`` overrides the
        compressor's density for this tensor (the partial-sparsification
        policy's per-layer choice); ``step`` is what the compressor sees
        (default: how often this name was pushed), which a resumed job sets
        so that seeds and schedules continue.

        Example::

            client = PSClient()                       # from the DMLC environment
            handle = client.push_pull(grad, "fc.weight", create("adtopk", ratio=0.01), out=grad)
            handle.wait()                             # grad now holds the average over workers
        """
        self.check()
        layout = self._declare(name, tensor)
        last = self._last.get(name)
        if last is not None and not last.done():
            raise ValueError(f"push_pull of {name!r} is still in flight; wait for it first")
        if step is None:
            step = self._steps.get(name, 0)
        self._steps[name] = step + 1
        given = out is not None
        if not given:
            out = torch.empty(layout.shape, dtype=layout.dtype, device=tensor.device)
        elif (out.shape, out.dtype, out.device) != (tensor.shape, tensor.dtype, tensor.device):
            raise ValueError(f"out for {name!r} is {out.dtype} {tuple(out.shape)} on {out.device}; "
                             f"the tensor is {tensor.dtype} {tuple(tensor.shape)} on {tensor.device}")
        handle = self._last[name] = Handle(self, name, out, len(layout.keys), average, given)
        self._engine.submit(self._priority(name, priority), handle, tensor.detach(), layout,
                            compressor or Dense(), step, ratio)
        return handle

    def collective(self, name: str, match: dict,
                   start: Callable[[Agreement, Handle], None] | None = None, *,
                   own: object = None, failed: str | None = None, standin: bool = False,
                   release: bool = False) -> Handle:
        """Agree a call named ``name`` with every worker, then run ``start`` (on the engine
        thread) to push its data, typically through :meth:`push_agreed`.

        ``match`` (msgpack-able) must be the same on every worker, or every worker's handle
        fails with the same :class:`CollectiveError` naming each side; ``own`` is this
        worker's part, which every worker receives in :attr:`Handle.agreement`; ``failed``
        says that this worker's side of the call failed, and why (every worker's handle then
        fails with it). ``standin``: a sum, to which a joined worker contributes zeros (``own`` is
        then what it pushes: key name, wire dtype and shape). ``release``: a
        worker that finishes is not waited for (a barrier). Without ``start`` the handle
        completes with the agreement. A name that is not valid UTF-8, or is longer than
        ``MAX_AGREED_NAME_BYTES``, raises ``ValueError`` here, before anything is sent.

        Example::

            handle = client.collective("allreduce.loss", {"dtype": "float32", "shape": []})
            handle.wait()      # raises CollectiveError if another worker called it otherwise
        """
        self.check()
        check_name(name, MAX_AGREED_NAME_BYTES)
        last = self._collectives.get(name)
        if last is not None and not last.done():
            raise ValueError(f"a collective named {name!r} is still in flight on this worker; "
                             f"synchronize it before using the name again")
        if len(self._collectives) > PRUNE_AT:  # forget finished calls' names now and then
            self._collectives = {n: h for n, h in self._collectives.items() if not h.done()}
        handle = self._collectives[name] = Handle(self, name, None, 0, False)
        fields = {"name": name, "match": match, "own": own, "failed": failed,
                  "standin": standin, "release": release}
        handle.reqid = reqid = self._engine.new_request()  # set before the answer can clear it
        self._engine.negotiate(reqid, fields, _Collective(handle, start))
        return handle

    def push_agreed(self, handle: Handle, key_name: str, tensor: torch.Tensor,
                    compressor: Compressor | None = None, divisor: int = 1,
                    out: torch.Tensor | None = None, priority: int | None = None) -> None:
        """Push an agreed collective's ``tensor`` under ``key_name``, whose key comes from
        the name alone; ``handle`` completes with the sum divided by ``divisor``."""
        layout = self._declare(key_name, tensor)
        given = out is not None
        if not given:
            out = torch.empty(layout.shape, dtype=layout.dtype, device=tensor.device)
        step = self._steps.get(key_name, 0)
        self._steps[key_name] = step + 1
        handle.begin(out, len(layout.keys), divisor, given)
        self._engine.submit(self._priority(key_name, priority), handle, tensor.detach(), layout,
                            compressor or Dense(), step, None)

    def round_trip_s(self, probe: torch.Tensor, name: str, repeats: int) -> float:
        """The fastest of ``repeats`` push_pull round trips of ``probe`` under ``name``, in
        seconds (the first, which declares the key and connects, is the slow one the minimum
        leaves out); every worker calls it alike.

        Example::

            link_s = client.round_trip_s(torch.zeros(1 << 20), "cost-model.link", 3)
        """
        return fastest(lambda: self.push_pull(probe, name, average=False).wait(), repeats)

    def unnamed_name(self, kind: str) -> str:
        """The name of this worker's next unnamed collective of ``kind`` (horovod's rule: by
        order, so every worker must make its unnamed calls in one order)."""
        n = self._unnamed.get(kind, 0)
        self._unnamed[kind] = n + 1
        return f"{kind}.noname.{n}"

    def _stand_in(self, fields: dict) -> None:
        """A joined worker's part in a call the others made (the engine thread calls this):
        an unnamed one counts here too, and a sum gets this worker's zeros."""
        unnamed = _UNNAMED.match(fields["name"])
        if unnamed:
            kind, n = unnamed[1], int(unnamed[2])
            self._unnamed[kind] = max(self._unnamed.get(kind, 0), n + 1)
        if fields["push"] is None:
            return
        key_name, dtype, shape = fields["push"]
        zeros = torch.zeros(shape, dtype=getattr(torch, dtype))
        handle = Handle(self, key_name, None, 0, False)
        self.push_agreed(handle, key_name, zeros)

    def barrier(self, timeout: float | None = None) -> None:
        """Wait until every worker has reached this barrier (a worker that finished is not
        waited for)."""
        self.collective(".barrier", {"kind": "barrier"}, release=True).wait(timeout)

    def shutdown(self, timeout: float = 10.0, failed: str | None = None, status: int = 1) -> None:
        """Tell the scheduler this worker is done and stop the engine; ``failed``: the error
        this worker's process ends on, which makes the job fail with ``status``."""
        if self._closed:
            return
        self._closed = True
        self._engine.stop(timeout, failed, status)

    @property
    def size(self) -> int:
        """The number of workers in the job now (fewer after an elastic re-form)."""
        return self._engine.size

    def check(self) -> None:
        """Raise what ended this worker's part in the job (a lost peer, a refused push), if
        any, or the re-form of an elastic job that the caller has not acknowledged."""
        if self._engine.error is not None:
            raise self._engine.error
        if self._engine.changed is not None:
            raise self._engine.changed
        if self._closed:
            raise ClusterError("the parameter-server client has been shut down")

    @property
    def joined_epoch(self) -> int:
        """The epoch of the running (elastic) job this worker joined; 0 for one there from the
        start. A joiner takes the others' state from them (``adtopk_ps.torch.elastic``)."""
        return self._engine.joined_epoch

    @property
    def epoch(self) -> int:
        """How many times the job has re-formed (elastic jobs)."""
        return self._engine.epoch

    @property
    def reforming(self) -> bool:
        """Whether a re-form is being taken in, or the job waits below its minimum of workers
        for some to join (elastic jobs)."""
        return not self._engine.resumed.is_set()

    @property
    def membership_change(self) -> MembershipChanged | None:
        """The re-form the caller has not acknowledged yet (:meth:`acknowledge_membership`),
        which every call raises meanwhile; None where there is none."""
        return self._engine.changed

    def acknowledge_membership(self) -> None:
        """The caller has gone back to its last committed state after
        :class:`~adtopk_ps.client.errors.MembershipChanged`: calls go through again, among
        the new membership. While the job waits below its minimum for workers to join, this
        waits with it (saying so every few seconds), up to the scheduler's timeout."""
        engine = self._engine
        while not engine.resumed.wait(WAITING_NOTICE_S):
            log.warning("worker %d: %s", engine.rank, engine.waiting)
        if engine.error is not None:
            raise engine.error
        with engine.lock:
            engine.changed = None
        self._last.clear()
        self._collectives.clear()
        self._unnamed.clear()  # every survivor numbers its unnamed collectives afresh, alike

    def server_residuals(self, timeout: float | None = None) -> list[dict]:
        """What the servers hold back from their answers (``BYTEPS_SERVER_COMPRESSOR``) for
        every key declared so far, as of each key's next round, for a checkpoint; empty where
        the servers do not re-sparsify. Call it between steps, with every push of this worker
        answered: the keys' rounds cannot move on while this worker has not pushed them, so
        the residuals are those of the step just taken. A server refuses a key whose round
        asked has not begun there (this worker's push of it unanswered): ``PushPullError``.

        Example::

            state = {"model": model.state_dict(), "optimizer": opt.state_dict(),
                     "servers": client.server_residuals()}
        """
        self.check()
        keys = keys_of(self._layouts)
        call = self._engine.fetch_residuals(list(keys))
        return saved(call.wait(self.timeout if timeout is None else timeout), keys)

    def restore_server_residuals(self, entries: list[dict]) -> None:
        """Put back what :meth:`server_residuals` saved, before this worker's first push of
        each key (the resumed job's first step). An entry that fits no key of this job, or
        whose residual is not a finite tensor of its dtype, raises ``ValueError`` naming it.
        A server that cannot take one (it does not re-sparsify, or the key holds another
        shape) refuses it: this raises :class:`PushPullError` naming why, and the server
        refuses every later push of that key.

        Example::

            client.restore_server_residuals(state["servers"])
        """
        self.check()
        self._engine.restore_residuals(to_restore(entries, self._layout_for)).wait(self.timeout)

    def quiesce(self, timeout: float | None = None) -> None:
        """Wait until every push_pull started so far has its answer (or has failed: its own
        handle reports that)."""
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        for name, handle in [*self._last.items(), *self._collectives.items()]:
            if not handle.wait_done(max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"push_pull of {name!r} still in flight after {timeout:.1f} s")

    def declare(self, name: str, tensor: torch.Tensor) -> int:
        """Give ``name`` its key layout for ``tensor``'s dtype and shape now (the torch
        integration declares every parameter at start); returns its tensor id.

        The id comes from the name, dtype and shape alone, never from what else was
        declared or pushed before, so workers may declare in any order; a name pushed with
        another shape gets another key.
        """
        return self._declare(name, tensor).id

    def _declare(self, name: str, tensor: torch.Tensor) -> KeyLayout:
        _check_pushable(name, tensor)
        shape = tuple(tensor.shape)
        layout = self._layouts.get((name, tensor.dtype, shape))
        if layout is None:
            layout = self._layouts[(name, tensor.dtype, shape)] = self._layout_for(name, tensor.dtype, shape)
            self._order.setdefault(name, len(self._order))
            self._named_layouts[name] = layout
        return layout

    def layout_of(self, name: str) -> KeyLayout | None:
        """The key layout ``name`` was last declared with (None where it was not): its shape
        and the row blocks its partitions hold."""
        return self._named_layouts.get(name)

    def plan(self, tensors: list[tuple[str, torch.Tensor, float | None]]) -> None:
        """Lay out, as one group, the keys of tensors every worker agreed to push, each
        given as (name, tensor, density: None where it travels dense): their row ranges
        spread over every server by the bytes each moves, push and answer
        (``cluster/placement.py``).
        Every worker must plan the same tensors in the same order; a tensor declared or
        planned before keeps its keys.

        Example::

            client.plan([("fc.weight", fc.weight, 0.01), ("fc.bias", fc.bias, None)])
        """
        items = []
        for name, tensor, ratio in tensors:
            _check_pushable(name, tensor)
            shape = tuple(tensor.shape)
            if (name, tensor.dtype, shape) not in self._layouts:
                items.append(Item(self._tensor_id(name, tensor.dtype, shape), shape,
                                  tensor.element_size(),
                                  exchange_bytes(shape, tensor.element_size(), ratio,
                                                 self.config.num_workers), ratio is not None))
        self.slicer.plan(items)
        for name, tensor, _ in tensors:
            self._declare(name, tensor)

    @staticmethod
    def _tensor_id(name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> int:
        return name_id(f"{name}|{str(dtype).removeprefix('torch.')}|{shape}")

    def _layout_for(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> KeyLayout:
        """The keys a tensor of ``dtype`` and ``shape`` declared as ``name`` has."""
        tensor_id = self._tensor_id(name, dtype, shape)
        blocks = self.slicer.blocks(tensor_id, shape, torch.empty((), dtype=dtype).element_size())
        return KeyLayout(tensor_id, shape, dtype, blocks,
                         [make_key(tensor_id, i) for i in range(len(blocks))])

    def _priority(self, name: str, priority: int | None) -> int:
        """``priority``, or by declaration order: with a credit window, by need (the first
        declared goes first: the next forward pass needs the first layers first); without
        one, the later declared first (the backward pass produces those first)."""
        if priority is not None:
            return priority
        return self._order[name] if self._engine.credit else -self._order[name]


def _check_pushable(name: str, tensor: object) -> None:
    """Refuse, naming the tensor, what the wire cannot carry, before it reaches the engine
    (whose failure would end this worker's part in the job)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name!r}: push_pull takes a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise ValueError(f"{name!r}: a {tensor.layout} tensor cannot be pushed; pass a dense one "
                         f"(a sparse gradient, as from nn.Embedding(sparse=True), is not "
                         f"supported: use sparse=False)")
    if tensor.is_meta:
        raise ValueError(f"{name!r}: a tensor on the meta device has no values to push")
    if tensor.dtype not in WIRE_FLOATS:
        raise ValueError(f"{name!r}: tensors of dtype {tensor.dtype} cannot be pushed; the wire "
                         f"carries {[str(d) for d in WIRE_FLOATS]} (the functional collectives "
                         f"also take integer and bool tensors)")


class _Collective:
    """A collective waiting for the scheduler's answer (engine.py's ``Negotiation``)."""

    def __init__(self, handle: Handle, start: Callable[[Agreement, Handle], None] | None):
        self.handle, self.start = handle, start

    def answered(self, msg: wire.Message) -> None:
        handle, x = self.handle, msg.extra
        handle.reqid = None
        if not x.get("ok"):
            handle.fail(CollectiveError(x.get("message", f"{handle.name} refused")))
            return
        owns = x.get("owns", [])  # each distinct part once; ``own`` indexes it by rank
        handle.agreement = Agreement({int(r): owns[i] for r, i in x.get("own", {}).items()},
                                     list(x.get("standins", [])), int(x.get("last", -1)))
        if self.start is None:
            handle.complete(handle.agreement)
            return
        try:
            self.start(handle.agreement, handle)
        except Exception as exc:  # noqa: BLE001 - the caller's synchronize() raises it
            handle.fail(exc)

    def fail(self, error: BaseException) -> None:
        self.handle.fail(error)
