"""Timing calls on any device: a GPU runs its kernels after the call that launched them
returns, so a timing must wait for them."""
from __future__ import annotations

import time
from typing import Callable

import torch


def wait_for_device(device: torch.device | str) -> None:
    """Wait for the work queued on ``device`` (a GPU runs its kernels after the call that
    launched them returns; a timing that ends without waiting measures the launch alone)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fastest(call: Callable[[], object], repeats: int) -> float:
    """The fastest of ``repeats`` timed calls of ``call``, in seconds.

    Example::

        fastest(lambda: client.push_pull(x, "probe").wait(), 3)
    """
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - started)
    return best
