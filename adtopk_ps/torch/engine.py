"""The optimizer's gradient machinery on its own, for wrappers that update parameters elsewhere.

:mod:`.parallel` (the DDP wrapper, whose user steps a plain optimizer) and
:mod:`.cross_barrier` (which updates each parameter when its layer needs it)
push gradients exactly as :func:`.DistributedOptimizer` does (hooks, partial
sparsification, fusion buckets, the cost model, the start-up agreement): they
wrap an optimizer whose own step changes nothing.
"""
from __future__ import annotations

import itertools
from typing import Iterable

import torch

from .optimizer import DistributedOptimizer

_instances = itertools.count()


class _NoStep(torch.optim.Optimizer):
    """Holds the parameters; its step changes nothing."""

    def __init__(self, params: Iterable[torch.Tensor]):
        super().__init__(list(params), {})

    @torch.no_grad()
    def step(self, closure=None):
        return closure() if closure is not None else None


def gradient_engine(named: list[tuple[str, torch.Tensor]], compression: object,
                    backward_passes_per_step: int, overlap: bool | str, kind: str):
    """A :func:`.DistributedOptimizer` over ``named`` that averages gradients into ``p.grad``
    and updates nothing. Its server keys start with ``kind`` and the number of engines this
    process made before it (every worker makes them in one order), so that two wrapped models
    keep apart."""
    params = [p for _, p in named]
    if not params:
        raise ValueError(f"{kind}: the model has no parameters that require gradients")
    return DistributedOptimizer(_NoStep(params), named, compression, backward_passes_per_step,
                                overlap=overlap, key_prefix=f"{kind}{next(_instances)}.")
