"""DistributedOptimizer: gradients leave for the servers as soon as backward produces them.

The wrapped optimizer keeps its class (LR schedulers still accept it) and gets
a :class:`~.gradient_sync.GradientSync`, which pushes each gradient from a hook
as backward accumulates it (with overlap) or in ``step()``. ``step()`` waits
for the averages, which land in ``p.grad``, and then runs the wrapped
optimizer's own step.
"""
from __future__ import annotations

import contextlib
import functools
import warnings
from typing import Iterable, Mapping

import torch

from adtopk_ps.compression import Compressor
from adtopk_ps.torch.gradient_compression import GradientCompression
from adtopk_ps.torch.gradient_sync import GradientSync
from adtopk_ps.torch.nonfinite import NonFiniteGuard
from adtopk_ps.torch.ops import Average, averages


class _Distributed:
    """Mixed into the wrapped optimizer's own class: horovod's and byteps' optimizer API over
    its :attr:`gradient_sync`."""

    gradient_sync: GradientSync
    _synchronized: bool  # synchronize() ran and step() has not yet
    _skip: bool  # inside skip_synchronize()

    def set_backward_passes_per_step(self, passes: int) -> None:
        """How many backward passes accumulate into one step from now on (horovod's; between
        steps only)."""
        self.gradient_sync.set_backward_passes_per_step(passes)

    def set_overlap(self, overlap: bool) -> None:
        """Push each gradient as backward produces it (True), or all of them in ``step()``;
        ends an ``overlap="auto"`` trial. Between steps only: the benchmarks switch it step
        by step to measure, under the same conditions, what overlap hides."""
        self.gradient_sync.set_overlap(overlap)

    @property
    def choosing(self) -> bool:
        """Whether a step trial (:mod:`.trial`) is still timing its modes."""
        return self.gradient_sync.choosing

    @property
    def allreduce_bytes(self) -> int:
        """Bytes this worker has sent and received all-reducing dense tensors."""
        return self.gradient_sync.allreduce_bytes

    @property
    def overlap(self) -> bool:
        """Whether gradients leave during backward in the coming step."""
        return self.gradient_sync.overlap

    @property
    def skipped_steps(self) -> int:
        """Steps dropped on every worker for a NaN or an infinity (``nonfinite="skip"``)."""
        return self.gradient_sync.guard.skipped

    def synchronize(self) -> None:
        """Wait for every gradient; parameters that got none this step push zeros.

        Raises :class:`~.nonfinite.NonFiniteGradient` on every worker alike where some
        worker's gradient held a NaN or an infinity, under ``nonfinite="stop"``.
        """
        self.gradient_sync.wait_all()
        self._synchronized = True

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
        return self.gradient_sync.finish_step(functools.partial(super().step, closure))

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.gradient_sync.check_zero_grad()
        super().zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        state = super().state_dict()
        state["adtopk_ps"] = self.gradient_sync.state_dict()
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        ours = state_dict.pop("adtopk_ps", None)
        super().load_state_dict(state_dict)
        if ours is not None:
            self.gradient_sync.load_state_dict(ours)


def _named(optimizer: torch.optim.Optimizer,
           named_parameters: Iterable[tuple[str, torch.Tensor]] | None) -> list[tuple[str, torch.Tensor]]:
    """(name, parameter) of every parameter in ``optimizer``'s groups: ``named_parameters``'
    names, or param.<i> in the groups' order without them."""
    if named_parameters is None:
        return [(f"param.{i}", p) for i, p in enumerate(
            p for group in optimizer.param_groups for p in group["params"])]
    in_groups = {id(p) for group in optimizer.param_groups for p in group["params"]}
    named = [(name, p) for name, p in named_parameters if id(p) in in_groups]
    unnamed = len(in_groups - {id(p) for _, p in named})
    if unnamed:
        raise ValueError(f"named_parameters was given, but {unnamed} of the optimizer's "
                         f"parameters are not in it (as in horovod, every parameter must "
                         f"be named); pass model.named_parameters()")
    return named


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

    The gradients' machinery is the wrapped optimizer's ``gradient_sync``
    (:class:`~.gradient_sync.GradientSync`).

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
    sync = GradientSync(_named(optimizer, named_parameters), GradientCompression.of(compression),
                        guard, backward_passes_per_step=backward_passes_per_step, overlap=overlap,
                        fusion_bytes=fusion_bytes, summed=summed, key_prefix=key_prefix)
    cls = type(optimizer.__class__.__name__, (_Distributed, optimizer.__class__), {})
    wrapped = cls.__new__(cls)
    wrapped.__dict__.update(optimizer.__dict__)
    wrapped.gradient_sync, wrapped._synchronized, wrapped._skip = sync, False, False
    return wrapped
