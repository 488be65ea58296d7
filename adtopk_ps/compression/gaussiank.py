"""Gaussian-k: the threshold comes from a normal fit of the gradient, then is rescaled."""
from __future__ import annotations

import math

import torch

from adtopk_ps.compression.base import Compressor, flat_of, global_k
from adtopk_ps.compression.select import above, global_topk, trim
from adtopk_ps.core.payload import Payload

_RESCALE_ROUNDS = 3


class GaussianK(Compressor):
    """Gaussian-k: a threshold from a normal fit of g, rescaled until about k entries pass."""

    name = "gaussiank"

    def compress(self, tensor: torch.Tensor, name: str, step: int = 0,
                 ratio: float | None = None) -> Payload:
        """A ``coo`` payload of the entries over the fitted threshold, at most k of them."""
        flat = flat_of(tensor)
        ratio = self._ratio(ratio)
        k = global_k(flat.numel(), ratio)
        stats = flat.float()
        mean = float(stats.mean())
        std = float(stats.std()) if flat.numel() > 1 else 0.0
        # two-sided tail of N(mean, std) that holds a `ratio` share of the mass
        z = math.sqrt(2.0) * float(torch.special.erfinv(torch.tensor(1.0 - ratio)))
        threshold = abs(mean) + z * std
        if not math.isfinite(threshold):  # a NaN or an infinity (or a fit that overflowed)
            return self._coo(tensor, flat, global_topk(flat, k))
        positions = above(flat, threshold)
        for _ in range(_RESCALE_ROUNDS):
            if positions.numel() > 4 * k / 3:
                threshold *= 1.3
            elif positions.numel() < 2 * k / 3:
                threshold *= 0.7
            else:
                break
            positions = above(flat, threshold)
        return self._coo(tensor, flat, trim(flat, positions, k))
