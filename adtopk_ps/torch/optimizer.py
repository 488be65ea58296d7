"""DistributedOptimizer: gradients leave for the servers as soon as backward produces them.

With overlap, a hook on every parameter starts its compress + push as soon
as its gradient has been accumulated, so communication overlaps the rest of
the backward pass; without it, ``step()`` pushes them all (``overlap="auto"``,
the default, times both, see :mod:`.trial`). ``step()`` waits for the
answers, writes the averaged gradients into ``p.grad`` and then runs the
wrapped optimizer.
"""
from __future__ import annotations

import contextlib
import time
import warnings
from typing import Callable, Iterable, Mapping

import torch

from ..client import Handle
from ..compression import Compressor, CostModel, Route, SparsificationPolicy, compression_speed
from ..compression.cost import synchronize
from .agreement import agree, describe
from .compression import EveryTensor, compressor_of, is_cast
from .dense_lane import DenseLane, Group, Reduction, check_transport, worker_group
from .fusion import Bucket, fusion_bytes, plan_buckets
from .objects import allgather_object
from .ops import Average, averages
from .nonfinite import NonFiniteGuard
from .plans import Layout, Mode, Plan
from .trial import Trial
from .runtime import client, size


def _fastest(call: Callable[[], object], repeats: int) -> float:
    """The fastest of ``repeats`` timed calls (the first, which declares a key or connects,
    is the slow one the minimum leaves out)."""
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - started)
    return best


def _round_trip(probe: torch.Tensor, name: str, repeats: int) -> float:
    return _fastest(lambda: client().push_pull(probe, name, average=False).wait(), repeats)


class _Once:
    """A handle's answer, waited for (and checked by ``check``) once however many callers
    read it."""

    def __init__(self, handle: Handle | Reduction, check: Callable[[Handle | Reduction], None]):
        self._handle, self._check, self._answer = handle, check, None

    def __call__(self) -> torch.Tensor:
        if self._answer is None:
            answer = self._handle.wait()
            self._check(self._handle)
            self._answer = answer
        return self._answer


class GradientCompression:
    """One compressor plus the policy that says which tensors it gets, and at what density.

    Example::

        compression = bps.GradientCompression(
            {"compressor": "adtopk", "k": 0.01, "ef": "vanilla"},
            SparsificationPolicy(0.01, min_compress_bytes=65536), dense_transport="auto")
        opt = bps.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                       compression=compression)
    """

    def __init__(self, compression: Compressor | str | Mapping | None = None,
                 policy: SparsificationPolicy | None = None, measure_costs: bool = False,
                 dense_transport: str = "ps"):
        """``measure_costs``: time the link and the compressor when the optimizer starts, and
        send dense every tensor for which sparsifying would not pay (:class:`CostModel`).
        ``dense_transport``: how tensors sent dense travel: through the servers (``"ps"``),
        all-reduced among the workers (``"allreduce"``, :mod:`.dense_lane`), or whichever of the
        two measures faster when the optimizer starts (``"auto"``)."""
        self.compressor = compressor_of(compression)
        ratio = self.compressor.ratio if self.compressor is not None else 1.0
        # a cast (Compression.fp16) goes to every tensor; a sparsifier where it pays
        self.policy = policy or (EveryTensor(ratio) if is_cast(self.compressor)
                                 else SparsificationPolicy(ratio))
        self.measure_costs = measure_costs and self.compressor is not None
        self.dense_transport = check_transport(dense_transport)
        self.allreduce = dense_transport == "allreduce"  # "auto" decides in calibrate()
        self.costs: CostModel | None = None  # what calibrate() measured
        self.allreduce_bytes_per_s = 0.0  # likewise, where it timed the workers' all-reduce
        self.routes: dict[str, Route] = {}

    def calibrate(self, probe_bytes: int = 8 << 20, fusion: int = 0, group: Group | None = None,
                  device: torch.device | str = "cpu", lane_device: torch.device | str = "cpu") -> CostModel:
        """Measure dense push/pull throughput, a tiny key's round trip, compression speed on
        ``device`` (the gradients') and, given the workers' ``group``, all-reduce throughput on
        ``lane_device`` (where that group reduces); every worker must call it.
        ``fusion``: the optimizer's bucket capacity in bytes."""
        probe = torch.zeros(probe_bytes // 4)
        link = _round_trip(probe, "cost-model.link", 3)
        key = _round_trip(torch.zeros(1), "cost-model.key", 6)
        ring = 0.0
        if group is not None:
            on_lane = probe.to(lane_device)

            def all_reduce():
                group.allreduce([on_lane]).wait()
                synchronize(on_lane.device)  # (NCCL's wait returns once its kernels are queued)
            ring = _fastest(all_reduce, 3)
        inner = self.compressor.base if self.compressor is not None else None  # no residual for the probe
        speed = compression_speed(inner, device=device) if inner is not None else 0.0
        mine = torch.tensor([link, ring, speed, key], dtype=torch.float64)
        # every worker must route every tensor alike, or each waits for keys the others never
        # push: all decide from the same figures, the mean of every worker's own
        link, ring, speed, key = client().push_pull(mine, "cost-model.figures").wait().tolist()
        if self.dense_transport == "auto":
            self.allreduce = group is not None and ring < link
        moved = 2 * probe.numel() * probe.element_size()
        self.allreduce_bytes_per_s = moved / ring if ring else 0.0
        self.costs = CostModel(moved / link, speed, client().size, key_s=key, fusion_bytes=fusion,
                               dense_bytes_per_s=self.allreduce_bytes_per_s if self.allreduce else 0.0)
        if self.measure_costs:
            self.policy.cost_model = self.costs
        return self.costs

    def plan(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Route every named tensor (dense or sparse, and at what density) before the first push."""
        self.routes = self.policy.plan(named)

    def dense(self, name: str) -> bool:
        """Whether ``name`` travels dense."""
        return self.compressor is None or self.routes[name].dense

    def for_tensor(self, name: str) -> tuple[Compressor | None, float | None]:
        """The compressor and density for ``name``; ``(None, None)`` where it travels dense."""
        if self.dense(name):
            return None, None
        return self.compressor, self.routes[name].ratio

    def state_dict(self) -> dict:
        """The compressor's state (residuals, per-layer state) for a checkpoint."""
        return self.compressor.state_dict() if self.compressor is not None else {}

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` saved."""
        if self.compressor is not None:
            self.compressor.load_state_dict(state)


def _agree(medians: list[float]) -> list[float]:
    """Every worker's step-trial medians, averaged: all must route alike."""
    mine = torch.tensor(medians, dtype=torch.float64)
    return client().push_pull(mine, f"step-trial.{len(medians)}").wait().tolist()


class _Distributed:
    """Mixed into the wrapped optimizer's own class, so LR schedulers still accept it."""

    def _setup(self, named_parameters, compression, backward_passes_per_step: int,
               overlap: bool | str, fusion: int | None, summed: bool = False,
               key_prefix: str = "") -> None:
        if backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
        if overlap not in (True, False, "auto"):
            raise ValueError(f"overlap must be True, False or 'auto', got {overlap!r}")
        self._every = [(key_prefix + n, p) for n, p in self._names(named_parameters)]
        self._named = [(n, p) for n, p in self._every if p.requires_grad]
        self._key_prefix = key_prefix
        self._settings = (overlap, backward_passes_per_step, summed)
        self._compression = compression if isinstance(compression, GradientCompression) \
            else GradientCompression(compression)
        capacity = fusion_bytes() if fusion is None else fusion
        self._agree_on_settings(overlap, backward_passes_per_step, summed, capacity)
        group, lane_device = self._measure(capacity)
        self._compression.plan(self._named)
        self._passes_per_step = backward_passes_per_step
        self._passes: dict[int, int] = {}
        self._handles: dict[int, Handle | Reduction] = {}
        self._bucket_handles: dict[str, Handle | Reduction] = {}
        self._synchronized = False
        self._skip = False
        self._ps_steps = 0
        self._capacity, self._group, self._lane_device = capacity, group, lane_device
        self._hooks: list = []
        self._start_plans(overlap)

    def _start_plans(self, overlap: bool | str) -> None:
        """Lay out the plans for the parameters that need gradients now, and start the step
        trial where ``overlap`` is "auto"."""
        self._lay_out_plans()
        overlaps = [True, False] if overlap == "auto" else [overlap]  # a trial starts with overlap
        modes = [Mode(o, plan) for plan in self._plans for o in overlaps]
        self._trial = Trial(modes, agree=_agree, describe=str) if len(modes) > 1 else None
        self._hook_up(modes[0].overlap)

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
        overlap, passes, summed = self._settings
        handles = [(p, client().push_pull(p.grad if p.grad is not None else torch.zeros_like(p),
                                          f"{name}.unfrozen", average=not summed))
                   for name, p in trainable if id(p) not in known]
        for p, handle in handles:
            averaged = handle.wait()
            p.grad = averaged.to(p.dtype) if p.grad is None else p.grad.copy_(averaged)
        self._named = trainable
        self._agree_on_settings(overlap, passes, summed, self._capacity)  # plans the new set too
        self._start_plans(overlap if overlap == "auto" else self.overlap)

    def _names(self, named_parameters) -> list[tuple[str, torch.Tensor]]:
        """(name, parameter) of every parameter in this optimizer's groups: ``named_parameters``'
        names, or param.<i> in the groups' order without them. Duplicate names are refused."""
        if named_parameters is None:
            return [(f"param.{i}", p) for i, p in enumerate(
                p for group in self.param_groups for p in group["params"])]
        in_groups = {id(p) for group in self.param_groups for p in group["params"]}
        named = [(name, p) for name, p in named_parameters if id(p) in in_groups]
        names = [n for n, _ in named]
        if len(set(names)) != len(names):
            raise ValueError("named_parameters has duplicate names")
        unnamed = len(in_groups - {id(p) for _, p in named})
        if unnamed:
            raise ValueError(f"named_parameters was given, but {unnamed} of the optimizer's "
                             f"parameters are not in it (as in horovod, every parameter must "
                             f"be named); pass model.named_parameters()")
        return named

    def _agree_on_settings(self, overlap: bool | str, backward_passes_per_step: int, summed: bool,
                           capacity: int) -> None:
        """Before anything is pushed (the cost model's probes, the all-reduce rendezvous), every
        worker must mean to push the same things; the cost model's routes follow from these."""
        self._compression.plan(self._named)
        agree(describe(self._named, self._compression, {
            "dense_transport": self._compression.dense_transport, "overlap": overlap,
            "backward_passes_per_step": backward_passes_per_step, "op": "Sum" if summed else "Average",
            "nonfinite": self._guard.policy, "measure_costs": self._compression.measure_costs,
            "fusion_bytes": capacity,
            "BYTEPS_PARTITION_BYTES": client().config.partition_bytes}, capacity), allgather_object)

    def _measure(self, capacity: int) -> tuple[Group | None, torch.device]:
        """The workers' all-reduce group where dense tensors may take it, and the device it
        reduces on; the cost model's figures where it (or ``dense_transport="auto"``) wants them."""
        transport = self._compression.dense_transport
        # "auto" keeps to the servers where their traffic is encrypted (worker_group refuses)
        devices = [p.device for _, p in self._named]
        group = worker_group(devices) if transport == "allreduce" or transport == "auto" and \
            not client().encrypted else None
        # NCCL reduces on this worker's one GPU (worker_group's rule); gloo, from the CPU
        lane_device = devices[0] if group is not None and group.name() == "nccl" else torch.device("cpu")
        # the largest gradients are the ones the cost model decides about
        device = max(self._named, key=lambda named: named[1].numel())[1].device if self._named \
            else torch.device("cpu")
        if self._compression.measure_costs or transport == "auto":
            self._compression.calibrate(fusion=capacity, group=group, device=device,
                                        lane_device=lane_device)
        return group, lane_device

    def _lay_out_plans(self) -> None:
        """The cost model's routes and, to time them against (see .trial), every tensor dense:
        each plan's buckets laid out now, none in a timed step."""
        fused = f"{self._key_prefix}fused."
        self._plans = [Plan(self._compression.routes, fused)]
        if self._compression.measure_costs and \
                not all(self._compression.dense(n) for n, _ in self._named):
            self._plans.append(Plan(dict.fromkeys(self._compression.routes, Route(True, 1.0)),
                                    f"{fused}1.", every_dense=True))
        for plan in reversed(self._plans):  # (every worker lays out the same plans in one order)
            self._use_plan(plan)

    def _use_plan(self, plan: Plan) -> None:
        """Route by ``plan`` from the next gradient on (between steps only)."""
        self._compression.routes = plan.routes
        if plan.layout is None:
            plan.layout = self._lay_out(plan.prefix)
        self._plan = plan

    @property
    def _buckets(self) -> list[Bucket]:
        """The current plan's fused buckets."""
        return self._plan.layout.buckets

    @property
    def _bucket_of(self) -> dict[int, Bucket]:
        """The current plan's bucket of each bucketed parameter, by ``id``."""
        return self._plan.layout.bucket_of

    @property
    def _lane(self) -> DenseLane | None:
        """The current plan's all-reduce lane, None where dense tensors go through the servers."""
        return self._plan.layout.lane

    def _lay_out(self, prefix: str) -> Layout:
        """Buckets and the all-reduce lane for the current routes; declares what the servers
        will see."""
        dense = {name for name, _ in self._named if self._compression.dense(name)}
        buckets = plan_buckets(self._named, dense, self._capacity, prefix)
        bucket_of = {id(p): b for b in buckets for p, _ in b.members}
        # every dense tensor or bucket in the order backward completes them: a bucket at its
        # last member (the first in the model's order), so that a tensor ready inside a
        # bucket's span never waits for the bucket to fill
        units = list(dict.fromkeys(bucket_of[id(p)].name if id(p) in bucket_of else name
                                   for name, p in self._named if name in dense))[::-1]
        lane = DenseLane(self._group, units, client().timeout, client().check, self._lane_device) \
            if self._compression.allreduce else None
        c = client()
        for name, p in self._named:
            if id(p) not in bucket_of and (lane is None or name not in dense):
                c.declare(name, p.detach())
        for bucket in buckets if lane is None else ():
            c.declare(bucket.name, bucket.buffer)
        return Layout(buckets, bucket_of, lane)

    def set_backward_passes_per_step(self, passes: int) -> None:
        """How many backward passes accumulate into one step from now on (horovod's; between
        steps only)."""
        if isinstance(passes, bool) or not isinstance(passes, int) or passes < 1:
            raise ValueError(f"backward_passes_per_step must be an integer >= 1, got {passes!r}")
        if self._handles or self._bucket_handles or self._passes:
            raise RuntimeError("set_backward_passes_per_step() in the middle of a step; call "
                               "step() first")
        self._passes_per_step = passes

    def set_overlap(self, overlap: bool) -> None:
        """Push each gradient as backward produces it (True), or all of them in ``step()``;
        ends an ``overlap="auto"`` trial (one still timing goes back to the cost model's routes).

        Between steps only: the benchmarks switch it step by step to measure,
        under the same conditions, what overlap hides.
        """
        self._hook_up(overlap)
        if self._trial is not None and self._trial.choice is None:
            self._use_plan(self._plans[0])
        self._trial = None

    @property
    def choosing(self) -> bool:
        """Whether a step trial (:mod:`.trial`) is still timing its modes."""
        return self._trial is not None and self._trial.choice is None

    @property
    def allreduce_bytes(self) -> int:
        """Bytes this worker has sent and received all-reducing dense tensors (by the ring's
        figure); what goes through the servers, the client counts."""
        return sum(plan.layout.lane.bytes_moved for plan in self._plans
                   if plan.layout is not None and plan.layout.lane is not None)

    @property
    def overlap(self) -> bool:
        """Whether gradients leave during backward in the coming step."""
        return self._overlap

    def _hook_up(self, overlap: bool) -> None:
        if self._handles or self._bucket_handles or self._passes:
            raise RuntimeError("set_overlap() while gradients are in flight; call step() or "
                               "synchronize() first")
        for handle in self._hooks:
            handle.remove()
        self._hooks = [p.register_post_accumulate_grad_hook(self._make_hook(name))
                       for name, p in self._named] if overlap else []
        self._overlap = overlap

    def _make_hook(self, name: str):
        def hook(p: torch.Tensor) -> None:
            key = id(p)
            self._passes[key] = self._passes.get(key, 0) + 1
            if self._passes[key] == self._passes_per_step:
                self._start(name, p, p.grad)
        return hook

    def _start(self, name: str, p: torch.Tensor, grad: torch.Tensor | None) -> None:
        bucket = self._bucket_of.get(id(p))
        if bucket is not None:
            if bucket.put(p, grad):
                self._bucket_handles[bucket.name] = self._lane.start(bucket.name, bucket.buffer) \
                    if self._lane is not None else client().push_pull(
                        bucket.buffer, bucket.name, step=self._ps_steps, out=bucket.buffer)
            return
        if grad is None:
            grad = torch.zeros_like(p)
        if id(p) in self._handles:
            raise RuntimeError(f"gradient of {name!r} pushed twice before step(); with gradient "
                               f"accumulation set backward_passes_per_step")
        comp, ratio = self._compression.for_tensor(name)
        if comp is None and self._lane is not None:
            self._handles[id(p)] = self._lane.start(name, grad)
            return
        # the average lands in the gradient's own memory: no buffer to allocate, no copy after
        # (a non-contiguous one, e.g. channels_last, gets a buffer: answers land in flat views)
        self._handles[id(p)] = client().push_pull(grad, name, comp, ratio=ratio, step=self._ps_steps,
                                                  out=grad if grad.is_contiguous() else None)

    def _start_missing(self) -> None:
        """Push what the hooks have not (every parameter, without overlap); parameters that got
        no gradient push zeros: every worker must push every key each step, or the others wait
        forever."""
        for name, p in self._named:
            bucket = self._bucket_of.get(id(p))
            if id(p) not in self._handles and (bucket is None or id(p) not in bucket.ready):
                self._start(name, p, p.grad)

    def _hand_over(self) -> dict[int, Callable[[], torch.Tensor]]:
        """End this step on the engine's side without waiting: push what is left and hand every
        answer over, per parameter (by id), as a call that waits for its averaged gradient and
        returns it (:mod:`.cross_barrier` applies each when its layer needs it); a non-finite
        answer raises there under ``nonfinite="stop"``, the engine's policy. A fusion
        bucket's members read slices of its buffer: use each answer before the next backward
        pass."""
        self._start_missing()
        step, rank = self._ps_steps, client().rank

        def once(name: str, handle: Handle | Reduction) -> _Once:
            # a non-finite answer stops every worker alike, at the same layer
            return _Once(handle, lambda h: self._guard.inspect([(name, h)], step, rank,
                                                               self._members))
        answers: dict[int, Callable[[], torch.Tensor]] = {}
        for bucket in self._buckets:
            whole = once(bucket.name, self._bucket_handles.pop(bucket.name))
            for p, offset in bucket.members:
                answers[id(p)] = lambda whole=whole, p=p, offset=offset: \
                    whole().narrow(0, offset, p.numel()).view_as(p)
            bucket.ready.clear()
        for name, p in self._named:
            if id(p) not in self._bucket_of:
                answers[id(p)] = once(name, self._handles.pop(id(p)))
        self._passes.clear()
        self._ps_steps += 1
        return answers

    def synchronize(self) -> None:
        """Wait for every gradient; parameters that got none this step push zeros.

        Raises :class:`~.nonfinite.NonFiniteGradient` on every worker alike where some
        worker's gradient held a NaN or an infinity, under ``nonfinite="stop"``.
        """
        self._start_missing()
        waited = []
        for bucket in self._buckets:
            handle = self._bucket_handles.pop(bucket.name)
            bucket.unpack(handle.wait())
            waited.append((bucket.name, handle))
        for name, p in self._named:
            if id(p) in self._bucket_of:
                continue
            handle = self._handles.pop(id(p))
            averaged = handle.wait()
            waited.append((name, handle))
            if p.grad is None:
                p.grad = averaged.to(p.dtype)
            elif averaged is not p.grad:
                p.grad.copy_(averaged)
        self._passes.clear()
        self._synchronized = True
        self._guard.inspect(waited, self._ps_steps, client().rank, self._members)
        self._follow_requires_grad()

    def _members(self, name: str) -> list[str]:
        """The tensors in the bucket called ``name`` (none for a tensor's own name)."""
        names = {id(p): n for n, p in self._named}
        return [names[id(p)] for b in self._buckets if b.name == name for p, _ in b.members]

    @property
    def skipped_steps(self) -> int:
        """Steps dropped on every worker for a NaN or an infinity (``nonfinite="skip"``)."""
        return self._guard.skipped

    @contextlib.contextmanager
    def skip_synchronize(self):
        """For a step() after a manual synchronize() (e.g. to clip gradients in between)."""
        self._skip = True
        try:
            yield
        finally:
            self._skip = False

    def step(self, closure=None):
        if not self._skip:
            if self._synchronized:  # horovod's warning; synchronizing again keeps workers in step
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() "
                              "context after optimizer.synchronize(): the gradients are "
                              "averaged again, which costs a round; use `with "
                              "optimizer.skip_synchronize(): optimizer.step()`", stacklevel=2)
            self.synchronize()
        elif not self._synchronized:
            raise RuntimeError("step() inside skip_synchronize() needs synchronize() first")
        self._synchronized = False
        self._ps_steps += 1
        if self._guard.found:  # (only under "skip": "stop" raised in synchronize)
            self._guard.skip(client().rank, self._compression.compressor, self._members)
            loss = None
        else:
            loss = super().step(closure)
        if self._trial is not None:
            mode = self._trial.next_mode()
            if mode.plan is not self._plan:
                self._use_plan(mode.plan)
            if mode.overlap != self.overlap:
                self._hook_up(mode.overlap)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._handles or self._bucket_handles:
            raise RuntimeError("zero_grad() while gradients are in flight; call step() or "
                               "synchronize() first")
        if self._passes:  # (counted by the overlap hooks; without them this cannot be seen)
            raise RuntimeError(
                f"zero_grad() between the {self._passes_per_step} backward passes of one step "
                f"(backward_passes_per_step) would drop the gradients accumulated so far; call "
                f"step() after the last pass first")
        super().zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        state = super().state_dict()
        state["adtopk_ps"] = {"compression": self._compression.state_dict(),
                              "steps": self._ps_steps}
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        ours = state_dict.pop("adtopk_ps", None)
        super().load_state_dict(state_dict)
        if ours is not None:
            self._compression.load_state_dict(ours["compression"])
            self._ps_steps = ours["steps"]


def DistributedOptimizer(optimizer: torch.optim.Optimizer,
                         named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
                         compression: Compressor | str | Mapping | GradientCompression | None = None,
                         backward_passes_per_step: int = 1,
                         op: object = Average, gradient_predivide_factor: float = 1.0, *,
                         overlap: bool | str = "auto",
                         fusion_bytes: int | None = None,
                         nonfinite: str = "stop",
                         key_prefix: str = "") -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that ``step()`` applies gradients averaged over every worker.

    ``compression`` is a compressor, a name, a byteps-style dict
    (``{"compressor": "adtopk", "k": 0.01, "ef": "vanilla"}``) or a
    :class:`GradientCompression` with its own policy, cost model and dense
    transport (through the servers or all-reduced among the workers).
    Tensors the policy sends dense (biases, norms, small layers) skip the
    compressor. ``overlap=True`` pushes each gradient during the backward
    pass, ``False`` everything in ``step()``; the default ``"auto"`` times
    steps both ways and keeps the faster (:mod:`.trial`: overlap pays where
    a core is free, pushing after backward where none is); with the cost
    model the same trial also times every tensor dense.
    ``fusion_bytes`` caps the buckets that small dense gradients share
    (default ``PS_FUSION_BYTES`` or 4 MiB; 0 sends each on its own).
    ``key_prefix`` goes before every server key of this optimizer's gradients
    (its parameters' names and its fusion buckets), so that two optimizers in
    one process (two models) keep apart.
    ``op`` (horovod's): ``Average`` (the default) or ``Sum`` of the workers'
    gradients; ``gradient_predivide_factor`` is accepted for horovod scripts
    and changes nothing (the servers' sums do not overflow as NCCL's fp16 ones can).
    Every worker calls it; before anything is pushed they compare what they
    will push and, where any differs, raise :class:`.Disagreement` on every
    worker, naming both sides (:mod:`.agreement`).

    ``nonfinite``: where some worker's gradient holds a NaN or an infinity,
    ``"stop"`` (the default) raises :class:`~.nonfinite.NonFiniteGradient` on
    every worker, naming the workers, tensors and step; ``"skip"`` skips the
    step on every worker alike with a warning, as ``torch.amp.GradScaler`` does
    (:mod:`.nonfinite`).

    Example::

        opt = bps.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                       compression=bps.Compression.adtopk(ratio=0.01))
    """
    guard = NonFiniteGuard(nonfinite)  # a bad policy is refused before any setup
    summed = not averages(op)
    if isinstance(gradient_predivide_factor, bool) or \
            not isinstance(gradient_predivide_factor, (int, float)) or gradient_predivide_factor <= 0:
        raise ValueError(f"gradient_predivide_factor must be a positive number, "
                         f"got {gradient_predivide_factor!r}")
    if gradient_predivide_factor != 1.0 and summed:
        raise ValueError("gradient_predivide_factor applies to op=Average only, as in horovod")
    cls = type(optimizer.__class__.__name__, (_Distributed, optimizer.__class__), {})
    wrapped = cls.__new__(cls)
    wrapped.__dict__.update(optimizer.__dict__)
    wrapped._guard = guard
    wrapped._setup(named_parameters, compression, backward_passes_per_step, overlap, fusion_bytes,
                   summed, key_prefix)
    if summed:  # the servers answer averages; the sum is size() times that
        def to_sum(opt, args, kwargs):
            for _, p in opt._named:
                if p.grad is not None:
                    p.grad.mul_(size())
        wrapped.register_step_pre_hook(to_sum)
    return wrapped
