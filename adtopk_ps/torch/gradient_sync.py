"""GradientSync: one object that averages a model's gradients over every worker.

Everything that synchronises gradients goes through it:
:func:`.DistributedOptimizer` (``step()`` waits for the averages, then
updates), byteps' :class:`.DistributedDataParallel` (the backward pass ends by
waiting for them) and :class:`.CrossBarrier` (each layer waits for its own, in
the next forward pass). It is built in one order, which the constructor
spells out:

1. every worker agrees what it will push (:mod:`.agreement`);
2. the links and the compressor are timed where the cost model or
   ``dense_transport="auto"`` needs them (:meth:`GradientCompression.calibrate`);
3. every tensor gets its route, and the plans their buckets and lane
   (:mod:`.plans`, :mod:`.fusion`, :mod:`.dense_lane`);
4. with overlap, a hook on every parameter starts its push when backward has
   accumulated its gradient.

Each pending average follows :class:`~.pending.Pending`, whether it goes
through the servers or is all-reduced among the workers.
"""
from __future__ import annotations

import contextlib
import hashlib
import itertools
import os
import weakref
from typing import Callable, Iterator, TypeVar

import torch

from adtopk_ps.client.errors import MembershipChanged
from adtopk_ps.compression import Route, compression_speed
from adtopk_ps.torch import fusion
from adtopk_ps.torch.agreement import agree, describe
from adtopk_ps.torch.dense_lane import DenseLane, Group, allreduce_s, worker_group
from adtopk_ps.torch.gradient_compression import Figures, GradientCompression
from adtopk_ps.torch.nonfinite import NonFiniteGuard
from adtopk_ps.torch.objects import allgather_object
from adtopk_ps.torch.part_state import parted, whole
from adtopk_ps.torch.pending import Pending
from adtopk_ps.torch.plans import Layout, Mode, Plan
from adtopk_ps.torch.runtime import client
from adtopk_ps.torch.trial import Trial

T = TypeVar("T")
#: the credit window a step trial times ordering by need with, without ``PS_CREDIT_BYTES``
AUTO_CREDIT = 256 << 10
PROBE_BYTES = 8 << 20  # the dense round trip timed for the cost model
_wrappers = itertools.count()
# every GradientSync of this process by the order they were made (every worker makes them in
# one order), for abandon_all and reform_all
_made = itertools.count()
_live: "weakref.WeakValueDictionary[int, GradientSync]" = weakref.WeakValueDictionary()


def _each_live() -> list[GradientSync]:
    """Every GradientSync of this process, in the order they were made."""
    return [sync for sync in (_live.get(i) for i in sorted(_live)) if sync is not None]


def abandon_all() -> None:
    """:meth:`GradientSync.abandon` every GradientSync of this process (no I/O): first thing
    after :class:`~adtopk_ps.client.errors.MembershipChanged`, before the caller restores
    its committed state (a restore that reads pending answers would raise again)."""
    for sync in _each_live():
        sync.abandon()


def reform_all() -> None:
    """Take up the new membership: acknowledge it and :meth:`GradientSync.reset` every
    GradientSync of this process in the order they were made (each agrees again with the
    other workers: all go in one order); a worker lost meanwhile starts it over.

    Example::

        abandon_all()
        state.restore()
        reform_all()
    """
    while True:
        client().acknowledge_membership()
        try:
            for sync in _each_live():
                sync.reset()
            return
        except MembershipChanged:
            abandon_all()


def for_wrapper(kind: str, named: list[tuple[str, torch.Tensor]], compression: object,
                backward_passes_per_step: int = 1, overlap: bool | str = "auto",
                credit: int | str | None = None, crossing: bool = False) -> GradientSync:
    """The GradientSync of a wrapper whose user updates the parameters elsewhere (byteps'
    DDP, CrossBarrier): under ``nonfinite="stop"``, with server keys that start with
    ``kind`` and how many wrappers this process made before (every worker makes them in one
    order), so that two wrapped models keep apart.

    Example::

        sync = for_wrapper("ddp", list(model.named_parameters()), Compression.none)
    """
    if not named:
        raise ValueError(f"{kind}: the model has no parameters that require gradients")
    return GradientSync(named, GradientCompression.of(compression), NonFiniteGuard("stop"),
                        backward_passes_per_step=backward_passes_per_step, overlap=overlap,
                        key_prefix=f"{kind}{next(_wrappers)}.", credit=credit, crossing=crossing)


class _Once:
    """A pending average, waited for (and checked by ``check``) once however many callers
    read it."""

    def __init__(self, pending: Pending, check: Callable[[Pending], None]):
        self._pending, self._check, self._answer = pending, check, None

    def __call__(self) -> torch.Tensor:
        if self._answer is None:
            answer = self._pending.wait()
            self._check(self._pending)
            self._answer = answer
        return self._answer


def _agree_figures(medians: list[float]) -> list[float]:
    """Every worker's step-trial medians, averaged: all must route alike."""
    mine = torch.tensor(medians, dtype=torch.float64)
    return client().push_pull(mine, f"step-trial.{len(medians)}").wait().tolist()


class GradientSync:
    """Averages the gradients of ``named`` parameters over every worker, into ``p.grad``.

    ``named``: (name, parameter) of every parameter the caller updates, in
    the same order on every worker; those that do not require gradients
    join when they do (see :meth:`wait_all`). ``key_prefix`` goes before
    every server key. ``overlap``: push each gradient from a hook as
    backward accumulates it (True), in :meth:`wait_all` (False), or time
    both (``"auto"``, :mod:`.trial`). ``fusion_bytes`` caps the buckets that
    small dense gradients share. ``summed``: :meth:`wait_all` leaves the
    workers' sum in ``p.grad`` instead of their average (horovod's ``op=Sum``);
    the workers must agree on it. ``credit``: the process's credit window in bytes
    (client/credit.py; None leaves it as it is), or ``"auto"``: the window
    ``PS_CREDIT_BYTES`` gives where it is set, and otherwise a trial of pushes ordered by
    need behind :data:`AUTO_CREDIT` against none. ``crossing``:
    a step's answers are waited for in the next step (CrossBarrier), so a step trial runs
    each mode two steps at a time and times the second.

    Example::

        sync = GradientSync(model.named_parameters(), GradientCompression("adtopk"),
                            NonFiniteGuard("stop"), overlap=True)
        loss.backward()          # pushes leave from the hooks
        sync.wait_all()          # every p.grad is now the average
        sync.finish_step(optimizer.step)
    """

    def __init__(self, named: list[tuple[str, torch.Tensor]], compression: GradientCompression,
                 guard: NonFiniteGuard, *, backward_passes_per_step: int = 1,
                 overlap: bool | str = "auto", fusion_bytes: int | None = None,
                 summed: bool = False, key_prefix: str = "", credit: int | str | None = None,
                 crossing: bool = False):
        if isinstance(backward_passes_per_step, bool) or not isinstance(backward_passes_per_step, int) \
                or backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step must be an integer >= 1, got "
                             f"{backward_passes_per_step!r}")
        if overlap not in (True, False, "auto"):
            raise ValueError(f"overlap must be True, False or 'auto', got {overlap!r}")
        if credit not in (None, "auto") and (isinstance(credit, bool) or not isinstance(credit, int)
                                             or credit < 0):
            raise ValueError(f"credit must be bytes >= 0, 'auto' or None, got {credit!r}")
        if credit != "auto":
            self._credits = [credit]
        elif os.environ.get("PS_CREDIT_BYTES", "").strip():  # the engine keeps that window
            self._credits = [None]
        else:
            self._credits = [0, AUTO_CREDIT]
        self._block = 2 if crossing else 1
        named = list(named)
        seen: set[str] = set()
        twice = sorted({n for n, _ in named if n in seen or seen.add(n)})
        if twice:
            raise ValueError(f"parameter names must be unique; named twice: {twice[:5]}")
        self.compression, self.guard, self.key_prefix = compression, guard, key_prefix
        self._every = [(key_prefix + n, p) for n, p in named]
        self._named = [(n, p) for n, p in self._every if p.requires_grad]
        self._settings = (overlap, backward_passes_per_step, summed)
        self._capacity = fusion.fusion_bytes() if fusion_bytes is None else fusion_bytes
        self._passes_per_step = backward_passes_per_step
        self._passes: dict[int, int] = {}
        self._handles: dict[int, Pending] = {}
        self._bucket_handles: dict[str, Pending] = {}
        self._hooks: list = []
        self._on_abandon: list[Callable[[], None]] = []  # its wrappers' (see abandoned)
        self._steps = 0
        while True:
            try:
                self._agree()                                    # 1. the same on every worker
                self._group, self._lane_device = self._measure()  # 2. timed where asked
                self._start_plans(overlap)                       # 3. routes, plans; 4. hooks
                break
            except MembershipChanged:  # (elastic) a worker lost meanwhile: the rest set up anew
                abandon_all()
                reform_all()
        _live[next(_made)] = self

    # -- what it synchronises -------------------------------------------------------------

    @property
    def named(self) -> list[tuple[str, torch.Tensor]]:
        """(server name, parameter) of every parameter whose gradient it averages now."""
        return list(self._named)

    def members(self, name: str) -> list[str]:
        """The tensors in the bucket called ``name`` (none for a tensor's own name)."""
        names = {id(p): n for n, p in self._named}
        return [names[id(p)] for b in self.buckets for p, _ in b.members if b.name == name]

    @property
    def buckets(self) -> list[fusion.Bucket]:
        """The current plan's fusion buckets."""
        return self._plan.layout.buckets

    @property
    def trial(self) -> Trial | None:
        """The step trial timing overlap and plans (:mod:`.trial`), None where there is none."""
        return self._trial

    @property
    def choosing(self) -> bool:
        """Whether a step trial is still timing its modes."""
        return self._trial is not None and self._trial.choice is None

    @property
    def overlap(self) -> bool:
        """Whether gradients leave during backward in the coming step."""
        return self._overlap

    @property
    def allreduce_bytes(self) -> int:
        """Bytes this worker has sent and received all-reducing dense tensors (by the ring's
        figure); what goes through the servers, the client counts."""
        return sum(plan.layout.lane.bytes_moved for plan in self._plans
                   if plan.layout is not None and plan.layout.lane is not None)

    @property
    def in_flight(self) -> bool:
        """Whether some gradient of this step has been counted or pushed and not waited for."""
        return bool(self._handles or self._bucket_handles or self._passes)

    def check_zero_grad(self) -> None:
        """Raise where zeroing the gradients now would lose some: pushes in flight, or a step's
        backward passes only partly accumulated (``backward_passes_per_step``)."""
        if self._handles or self._bucket_handles:
            raise RuntimeError("zero_grad() while gradients are in flight; call step() or "
                               "synchronize() first")
        if self._passes:  # (counted by the overlap hooks; without them this cannot be seen)
            raise RuntimeError(
                f"zero_grad() between the {self._passes_per_step} backward passes of one step "
                f"(backward_passes_per_step) would drop the gradients accumulated so far; call "
                f"step() after the last pass first")

    # -- settings between steps ---------------------------------------------------------

    def set_backward_passes_per_step(self, passes: int) -> None:
        """How many backward passes accumulate into one step from now on (between steps)."""
        if isinstance(passes, bool) or not isinstance(passes, int) or passes < 1:
            raise ValueError(f"backward_passes_per_step must be an integer >= 1, got {passes!r}")
        if self.in_flight:
            raise RuntimeError("set_backward_passes_per_step() in the middle of a step; call "
                               "step() first")
        self._passes_per_step = passes

    def set_overlap(self, overlap: bool) -> None:
        """Push each gradient as backward produces it (True), or all of them in
        :meth:`wait_all`; ends a step trial (one still timing goes back to the cost model's
        routes). Between steps only."""
        self._hook_up(overlap)
        if self._trial is not None and self._trial.choice is None:
            self._use_plan(self._plans[0])
        self._trial = None

    @contextlib.contextmanager
    def hooks_paused(self) -> Iterator[None]:
        """Backward passes inside push nothing (their gradients accumulate in ``p.grad``);
        the overlap hooks come back after. Between steps only.

        Example::

            with sync.hooks_paused():
                model(chunk).sum().backward()   # accumulated locally
        """
        overlap = self._overlap
        self._hook_up(False)
        try:
            yield
        finally:
            self._hook_up(overlap)

    # -- one step ---------------------------------------------------------------------------

    def start(self, name: str, p: torch.Tensor, grad: torch.Tensor | None) -> None:
        """Start ``p``'s push now (its gradient ``grad`` is ready; None pushes zeros): alone,
        into its bucket (which leaves once full) or into the all-reduce lane."""
        bucket = self._plan.layout.bucket_of.get(id(p))
        lane = self._plan.layout.lane
        if bucket is not None:
            if bucket.put(p, grad):
                self._bucket_handles[bucket.name] = lane.start(bucket.name, bucket.buffer) \
                    if lane is not None else client().push_pull(
                        bucket.buffer, bucket.name, step=self._steps, out=bucket.buffer)
            return
        if grad is None:
            grad = torch.zeros_like(p)
        if id(p) in self._handles:
            raise RuntimeError(f"gradient of {name!r} pushed twice before step(); with gradient "
                               f"accumulation set backward_passes_per_step")
        comp, ratio = self.compression.for_tensor(name)
        if comp is None and lane is not None:
            self._handles[id(p)] = lane.start(name, grad)
            return
        # the average lands in the gradient's own memory: no buffer to allocate, no copy after
        # (a non-contiguous one, e.g. channels_last, gets a buffer: answers land in flat views)
        self._handles[id(p)] = client().push_pull(grad, name, comp, ratio=ratio, step=self._steps,
                                                  out=grad if grad.is_contiguous() else None)

    def start_missing(self) -> None:
        """Push what the hooks have not (every parameter, without overlap); parameters that got
        no gradient push zeros: every worker must push every key each step, or the others wait
        forever."""
        bucket_of = self._plan.layout.bucket_of
        for name, p in self._named:
            bucket = bucket_of.get(id(p))
            if id(p) not in self._handles and (bucket is None or id(p) not in bucket.ready):
                self.start(name, p, p.grad)

    def wait_all(self) -> None:
        """Push what is missing, wait for every average and write it into ``p.grad`` (the sum,
        where ``summed``).

        Raises :class:`~.nonfinite.NonFiniteGradient` on every worker alike where some
        worker's gradient held a NaN or an infinity, under ``nonfinite="stop"``. Parameters
        whose ``requires_grad`` changed since the plans were laid out join (or leave) here,
        on every worker alike.
        """
        self.start_missing()
        waited = []
        for bucket in self.buckets:
            handle = self._bucket_handles.pop(bucket.name)
            bucket.unpack(handle.wait())
            waited.append((bucket.name, handle))
        bucket_of = self._plan.layout.bucket_of
        for name, p in self._named:
            if id(p) in bucket_of:
                continue
            handle = self._handles.pop(id(p))
            averaged = handle.wait()
            waited.append((name, handle))
            if p.grad is None:
                p.grad = averaged.to(p.dtype)
            elif averaged is not p.grad:
                p.grad.copy_(averaged)
        if self._settings[2]:  # summed: the servers answer averages; the sum is W times that
            workers = client().size
            for _, p in self._named:
                if p.grad is not None:
                    p.grad.mul_(workers)
        self._passes.clear()
        self.guard.inspect(waited, self._steps, client().rank, self.members)
        self._follow_requires_grad()

    def hand_over(self) -> dict[int, Callable[[], torch.Tensor]]:
        """End this step without waiting: push what is left and hand every average over, per
        parameter (by id), as a call that waits for it and returns it (:mod:`.cross_barrier`
        applies each when its layer needs it); a non-finite answer raises there under
        ``nonfinite="stop"``. A fusion bucket's members read slices of its buffer: use each
        answer before the next backward pass.

        Example::

            answers = sync.hand_over()
            grad = answers[id(p)]()   # waits for p's average
        """
        self.start_missing()
        step, rank = self._steps, client().rank

        def once(name: str, pending: Pending) -> _Once:
            # a non-finite answer stops every worker alike, at the same layer
            return _Once(pending, lambda h: self.guard.inspect([(name, h)], step, rank, self.members))
        answers: dict[int, Callable[[], torch.Tensor]] = {}
        for bucket in self.buckets:
            whole = once(bucket.name, self._bucket_handles.pop(bucket.name))
            for p, offset in bucket.members:
                answers[id(p)] = lambda whole=whole, p=p, offset=offset: \
                    whole().narrow(0, offset, p.numel()).view_as(p)
            bucket.ready.clear()
        bucket_of = self._plan.layout.bucket_of
        for name, p in self._named:
            if id(p) not in bucket_of:
                answers[id(p)] = once(name, self._handles.pop(id(p)))
        self._passes.clear()
        self._steps += 1
        self._next_mode()
        return answers

    def finish_step(self, update: Callable[[], T]) -> T | None:
        """After :meth:`wait_all`: count the step and run ``update`` (the optimizer's step),
        unless some worker's gradient was non-finite under ``nonfinite="skip"`` (then every
        worker skips it alike); a step trial moves on to its next mode."""
        self._steps += 1
        if self.guard.found:  # (only under "skip": "stop" raised in wait_all)
            self.guard.skip(client().rank, self.compression.compressor, self.members)
            result = None
        else:
            result = update()
        self._next_mode()
        return result

    def _next_mode(self) -> None:
        """A step ended: a step trial moves on to its next mode."""
        if self._trial is not None:
            mode = self._trial.next_mode()
            if mode.plan is not self._plan:
                self._use_plan(mode.plan)
            if mode.overlap != self._overlap:
                self._hook_up(mode.overlap)
            self._use_credit(mode.credit)

    @staticmethod
    def _use_credit(window: int | None) -> None:
        """The process's credit window (one per process: the last to set it wins)."""
        if window is not None and client().credit != window:
            client().credit = window

    def abandoned(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` when this step's pushes are abandoned (:meth:`abandon`): a wrapper
        forgets what it holds of them (CrossBarrier its pending updates, DDP its queued end of
        backward).

        Example::

            sync.abandoned(self._pending.clear)
        """
        self._on_abandon.append(callback)

    def abandon(self) -> None:
        """The workers changed (an elastic job re-formed, :mod:`.elastic`): forget this step's
        pushes and their answers, here and in the wrappers (no I/O)."""
        self._handles.clear()
        self._bucket_handles.clear()
        self._passes.clear()
        for plan in self._plans:
            for bucket in plan.layout.buckets if plan.layout is not None else ():
                bucket.ready.clear()
        for callback in self._on_abandon:
            callback()

    def reset(self) -> None:
        """After the workers changed: :meth:`abandon`, then agree again with the new
        membership and lay the plans out again (a step trial starts over). The caller has
        restored its last committed state, this object's included (:meth:`load_state_dict`)."""
        self.abandon()
        overlap = self._settings[0]
        self._agree()
        self._start_plans(overlap if overlap == "auto" else self._overlap)

    # -- checkpoints ------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """The compressor's state (residuals, per-layer state), each tensor's whole rather
        than by partition (``part_state.py``: another job may cut it otherwise), and the
        steps taken."""
        return {"compression": whole(self.compression.state_dict()), "steps": self._steps}

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` saved, cut by this job's partitions."""
        c = client()

        def laid_out(name: str) -> tuple[tuple[int, ...], list[tuple[int, int]]] | None:
            layout = c.layout_of(name)
            return None if layout is None else (layout.shape, layout.blocks)

        # (a checkpoint kept by partition, as older ones are, is joined first: cut anew too)
        self.compression.load_state_dict(parted(whole(state["compression"]), laid_out))
        self._steps = state["steps"]

    # -- set-up -----------------------------------------------------------------------------

    def _agree(self) -> None:
        """Before anything is pushed (the cost model's probes, the all-reduce rendezvous), every
        worker must mean to push the same things; the cost model's routes follow from these."""
        overlap, passes, summed = self._settings
        self.compression.plan(self._named)
        agree(describe(self._named, self.compression, {
            "dense_transport": self.compression.dense_transport, "overlap": overlap,
            "backward_passes_per_step": passes, "op": "Sum" if summed else "Average",
            "nonfinite": self.guard.policy, "measure_costs": self.compression.measure_costs,
            "fusion_bytes": self._capacity,
            "BYTEPS_PARTITION_BYTES": client().config.partition_bytes}, self._capacity),
            allgather_object)

    def _measure(self) -> tuple[Group | None, torch.device]:
        """The workers' all-reduce group where dense tensors may take it, and the device it
        reduces on; the cost model's figures where it (or ``dense_transport="auto"``) wants them."""
        transport, elastic = self.compression.dense_transport, client().config.elastic
        if transport == "allreduce" and elastic:
            raise ValueError("dense_transport='allreduce' in an elastic job (PS_MIN_WORKERS): the "
                             "workers' all-reduce group cannot re-form without a lost worker; use "
                             "'ps' (or 'auto', which keeps to the servers there)")
        # "auto" keeps to the servers where their traffic is encrypted (worker_group refuses),
        # and where the workers may change
        devices = [p.device for _, p in self._named]
        group = worker_group(devices) if transport == "allreduce" or transport == "auto" and \
            not client().encrypted and not elastic else None
        # NCCL reduces on this worker's one GPU (worker_group's rule); gloo, from the CPU
        lane_device = devices[0] if group is not None and group.name() == "nccl" else torch.device("cpu")
        # the largest gradients are the ones the cost model decides about
        device = max(self._named, key=lambda named: named[1].numel())[1].device if self._named \
            else torch.device("cpu")
        if self.compression.wants_figures:
            self.compression.calibrate(self._figures(group, device, lane_device), client().size,
                                       self._capacity)
        return group, lane_device

    def _figures(self, group: Group | None, device: torch.device, lane_device: torch.device) -> Figures:
        """Time a dense round trip and a tiny key's through the servers, the group's
        all-reduce on ``lane_device`` and the compressor on ``device`` (the largest
        gradients'); every worker must route every tensor alike, or each waits for keys the
        others never push, so all take the mean of every worker's own figures."""
        c = client()
        probe = torch.zeros(PROBE_BYTES // 4)
        link = c.round_trip_s(probe, "cost-model.link", 3)
        key = c.round_trip_s(torch.zeros(1), "cost-model.key", 6)
        ring = allreduce_s(group, probe.to(lane_device), 3) if group is not None else 0.0
        inner = self.compression.compressor.base if self.compression.compressor is not None else None
        speed = compression_speed(inner, device=device) if inner is not None else 0.0  # (no residual)
        mine = torch.tensor([link, ring, speed, key], dtype=torch.float64)
        link, ring, speed, key = c.push_pull(mine, "cost-model.figures").wait().tolist()
        return Figures(link, ring, speed, key, probe.nbytes)

    def _start_plans(self, overlap: bool | str) -> None:
        """Lay out the plans for the parameters that need gradients now, and start the step
        trial where ``overlap`` is "auto"."""
        self.compression.plan(self._named)
        self._lay_out_plans()
        self._agree_keys()
        overlaps = [True, False] if overlap == "auto" else [overlap]  # a trial starts with overlap
        # crossing the barrier, the answers of a step are read after the next has begun: its
        # trial keeps the first plan (its layout stays) and times the credits alone
        plans = self._plans[:1] if self._block > 1 else self._plans
        modes = [Mode(o, plan, c) for plan in plans for o in overlaps for c in self._credits]
        self._trial = Trial(modes, agree=_agree_figures, describe=str, block=self._block) \
            if len(modes) > 1 else None
        self._hook_up(modes[0].overlap)
        self._use_credit(modes[0].credit)

    def _follow_requires_grad(self) -> None:
        """Parameters whose ``requires_grad`` changed since the plans were laid out (a
        fine-tuning schedule unfreezing a backbone): the newly trainable ones' gradients of
        this step are averaged on their own, then every worker agrees the new set and lays
        out its plans again, so that no worker steps a gradient the others never saw. (A
        parameter frozen mid-run keeps pushing zeros until then: its momentum and weight
        decay still move it, alike on every worker, as in horovod.)"""
        trainable = [(n, p) for n, p in self._every if p.requires_grad]
        if [id(p) for _, p in trainable] == [id(p) for _, p in self._named]:
            return
        known = {id(p) for _, p in self._named}
        overlap, _, summed = self._settings
        handles = [(p, client().push_pull(p.grad if p.grad is not None else torch.zeros_like(p),
                                          f"{name}.unfrozen", average=not summed))
                   for name, p in trainable if id(p) not in known]
        for p, handle in handles:
            averaged = handle.wait()
            p.grad = averaged.to(p.dtype) if p.grad is None else p.grad.copy_(averaged)
        self._named = trainable
        self._agree()  # plans the new set too
        self._start_plans(overlap if overlap == "auto" else self._overlap)

    def _lay_out_plans(self) -> None:
        """The cost model's routes and, to time them against (see .trial), every tensor dense:
        each plan's buckets laid out now, none in a timed step."""
        fused = f"{self.key_prefix}fused."
        self._plans = [Plan(self.compression.routes, fused)]
        if self.compression.measure_costs and \
                not all(self.compression.dense(n) for n, _ in self._named):
            self._plans.append(Plan(dict.fromkeys(self.compression.routes, Route(True, 1.0)),
                                    f"{fused}1.", every_dense=True))
        # every worker lays out the same plans in one order: the routes' first, so that the
        # servers share its keys by the bytes they move; the routes' plan is the one used
        for plan in [*self._plans, self._plans[0]]:
            self._use_plan(plan)

    def _agree_keys(self) -> None:
        """Every worker must have cut its tensors into the same keys on the same servers. The
        placement follows the order tensors were planned in (``PSClient.plan``): an elastic
        joiner that planned in one go what the others planned in two (a layer unfrozen
        meanwhile) would push other keys elsewhere. Refused on every worker, naming it,
        rather than left to hang."""
        c = client()
        names = sorted({name for name, _ in self._named} |
                       {b.name for plan in self._plans if plan.layout is not None
                        for b in plan.layout.buckets})
        laid = [(name, layout.blocks, [c.slicer.server_of(k, len(c.servers)) for k in layout.keys])
                for name in names if (layout := c.layout_of(name)) is not None]
        digest = hashlib.sha256(repr(laid).encode()).hexdigest()[:16]
        agree({"settings": {"the keys their tensors are cut into, and their servers": digest},
               "parameters": [], "buckets": []}, allgather_object, name=".agreement.keys")

    def _use_plan(self, plan: Plan) -> None:
        """Route by ``plan`` from the next gradient on (between steps only)."""
        self.compression.routes = plan.routes
        if plan.layout is None:
            plan.layout = self._lay_out(plan.prefix)
        self._plan = plan

    def _lay_out(self, prefix: str) -> Layout:
        """Buckets and the all-reduce lane for the current routes; declares what the servers
        will see."""
        dense = {name for name, _ in self._named if self.compression.dense(name)}
        buckets = fusion.plan_buckets(self._named, dense, self._capacity, prefix)
        bucket_of = {id(p): b for b in buckets for p, _ in b.members}
        # every dense tensor or bucket in the order backward completes them: a bucket at its
        # last member (the first in the model's order), so that a tensor ready inside a
        # bucket's span never waits for the bucket to fill
        units = list(dict.fromkeys(bucket_of[id(p)].name if id(p) in bucket_of else name
                                   for name, p in self._named if name in dense))[::-1]
        c = client()
        lane = DenseLane(self._group, units, c.timeout, c.check, self._lane_device) \
            if self.compression.allreduce else None
        routes = self.compression.routes
        c.plan([(name, p.detach(), None if name in dense else routes[name].ratio)
                for name, p in self._named
                if id(p) not in bucket_of and (lane is None or name not in dense)]
               + [(bucket.name, bucket.buffer, None) for bucket in (buckets if lane is None else ())])
        return Layout(buckets, bucket_of, lane)

    def _hook_up(self, overlap: bool) -> None:
        if self.in_flight:
            raise RuntimeError("set_overlap() while gradients are in flight; call step() or "
                               "synchronize() first")
        for handle in self._hooks:
            handle.remove()
        self._hooks = [p.register_post_accumulate_grad_hook(self._ready(name))
                       for name, p in self._named] if overlap else []
        self._overlap = overlap

    def _ready(self, name: str) -> Callable[[torch.Tensor], None]:
        """The hook that starts ``name``'s push once its last backward pass of the step has
        accumulated its gradient."""
        def hook(p: torch.Tensor) -> None:
            key = id(p)
            self._passes[key] = self._passes.get(key, 0) + 1
            if self._passes[key] == self._passes_per_step:
                self.start(name, p, p.grad)
        return hook
