"""Whether sparsifying a tensor pays, from speeds measured on this job's machine and links.

Sending a tensor dense costs its bytes twice (push, then the dense answer;
or, all-reduced among the workers, about as many bytes in and out of each).
Sparsifying costs the compression, the sparse push, and an answer that can
be as large as W workers' selections together. A sparse tensor is also a
key of its own, where a small dense one rides in a fusion bucket: the fixed
cost of one more key (encoding, a server's decode and aggregation, the
answer; a tiny key's round trip) is charged to it. Where the link is fast
and the tensor small, dense wins, and the policy should send it dense.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from adtopk_ps.compression.base import Compressor
from adtopk_ps.core.timing import wait_for_device

# conservative bytes per kept element: the value plus a 4-byte position
_INDEX_BYTES = 4


@dataclass(frozen=True)
class CostModel:
    """Speeds measured in the job (link, compression, one more key) that price sending a tensor sparse against dense."""

    bytes_per_s: float  # dense push + pull throughput through the servers
    compress_s_per_element: float
    workers: int
    key_s: float = 0.0  # what one more key costs: a tiny push_pull's round trip
    fusion_bytes: int = 0  # dense tensors up to this size ride in a fusion bucket
    # the same figure for the route dense tensors take, where that is not the servers (an
    # all-reduce among the workers); 0: the servers
    dense_bytes_per_s: float = 0.0

    def sparse_pays(self, numel: int, itemsize: int, ratio: float) -> bool:
        """Whether compressing, sending and answering ``numel`` entries at ``ratio`` takes less time than sending them dense."""
        dense_bytes = numel * itemsize
        sparse_bytes = numel * ratio * (itemsize + _INDEX_BYTES)
        answer = min(self.workers * sparse_bytes, dense_bytes)
        dense = 2 * dense_bytes / (self.dense_bytes_per_s or self.bytes_per_s)
        sparse = self.compress_s_per_element * numel + (sparse_bytes + answer) / self.bytes_per_s
        if dense_bytes < self.fusion_bytes:  # dense, it would add no key
            sparse += self.key_s
        return sparse < dense


def compression_speed(compressor: Compressor, elements: int = 1 << 20, repeats: int = 3,
                      device: torch.device | str = "cpu") -> float:
    """Seconds per element, the best of a few calls on a random [1024, elements/1024] tensor
    on ``device``: the gradients' own, whose speed the routes depend on.

    Example::

        speed = compression_speed(create("adtopk", ratio=0.01), device=grad.device)
    """
    x = torch.randn(1024, max(1, elements // 1024),
                    generator=torch.Generator().manual_seed(0)).to(device)
    best = float("inf")  # (the best leaves out the first call, which loads a GPU's kernels)
    for i in range(repeats):
        wait_for_device(x.device)
        started = time.perf_counter()
        compressor.compress(x, "cost-model-probe", i)
        wait_for_device(x.device)
        best = min(best, time.perf_counter() - started)
    return best / x.numel()
