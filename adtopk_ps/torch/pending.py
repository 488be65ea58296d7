"""Pending: what every way of averaging one tensor hands back before the average is in.

Two implementations follow it: a push_pull's :class:`~adtopk_ps.client.handle.Handle`
(through the servers) and the dense lane's :class:`~.dense_lane.Reduction`
(all-reduced among the workers). :class:`~.gradient_sync.GradientSync` and
:class:`~.nonfinite.NonFiniteGuard` hold either, through this interface only.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class Pending(Protocol):
    """The pending average of one tensor (or fusion bucket).

    Example::

        pending = client().push_pull(grad, "fc.weight")     # or lane.start("fc.bias", grad)
        average = pending.wait()
        if pending.nonfinite:
            print(pending.name, "held a NaN or an infinity on", pending.flagging_ranks())
    """

    name: str

    def wait(self, timeout: float | None = None) -> torch.Tensor:
        """The average; raises, naming the cause, where a peer failed or ``timeout`` (default:
        the job's) passed."""

    @property
    def nonfinite(self) -> bool:
        """After :meth:`wait`: whether some worker's part (or, all-reduced, their sum) held a
        NaN or an infinity, so that the average is not to be trusted; alike on every worker."""

    def flagging_ranks(self) -> list[int]:
        """Where :attr:`nonfinite`: the ranks whose own part held a NaN or an infinity,
        ascending (empty where only the sum overflowed). Every worker calls it alike, in the
        same order: all-reduced tensors find them with one more all-reduce."""
