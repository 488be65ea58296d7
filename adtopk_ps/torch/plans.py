"""The routes a DistributedOptimizer can send its gradients by, and what a step trial times.

A :class:`Plan` is a route for every tensor (the cost model's, or every
tensor dense to time it against) together with its :class:`Layout`: the
fused buckets and the all-reduce lane those routes imply, laid out once
before any timed step. A :class:`Mode` is one way of running a step: with
or without overlap, under one plan, with or without pushes ordered by need (see
:mod:`.trial`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from adtopk_ps.compression import Route
from adtopk_ps.torch.dense_lane import DenseLane
from adtopk_ps.torch.fusion import Bucket


class Layout(NamedTuple):
    """A plan's fused buckets, the bucket of each bucketed parameter (by ``id``) and the lane
    that all-reduces dense tensors (None where they go through the servers)."""

    buckets: list[Bucket]
    bucket_of: dict[int, Bucket]
    lane: DenseLane | None


@dataclass(eq=False)
class Plan:
    """A route for every tensor by name; ``prefix`` keeps each plan's fused keys apart on the
    servers. Compared by identity, so a trial can key its timings by plan."""

    routes: dict[str, Route]
    prefix: str
    every_dense: bool = False
    layout: Layout | None = field(default=None, repr=False)


class Mode(NamedTuple):
    """One way of running a step: gradients pushed during backward (``overlap``) or in
    ``step()``, routed by ``plan``, behind a credit window of ``credit`` bytes (0: none;
    None: the process's window as it is)."""

    overlap: bool
    plan: Plan
    credit: int | None = None

    def __str__(self) -> str:
        ordered = "" if self.credit is None else ", pushes as they come" if not self.credit \
            else f", ordered by need ({self.credit >> 10} KiB credit)"
        return f"{'overlap' if self.overlap else 'no overlap'}" \
               f"{', every tensor dense' if self.plan.every_dense else ''}{ordered}"
