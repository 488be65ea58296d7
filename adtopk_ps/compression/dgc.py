"""DGC: the threshold is estimated from a small random sample of |g|."""
from __future__ import annotations

import math

import torch

from adtopk_ps.compression.base import Compressor, check_ratio, flat_of, global_k
from adtopk_ps.compression.select import above, global_topk, trim
from adtopk_ps.core.payload import Payload
from adtopk_ps.core.seeded import seed_for


class DGC(Compressor):
    """Deep Gradient Compression's selection: a threshold from a random sample of |g|, trimmed to k."""

    name = "dgc"

    def __init__(self, ratio: float = 0.01, sample_ratio: float = 0.01,
                 value_dtype: str | None = None):
        super().__init__(ratio, value_dtype)
        self.sample_ratio = check_ratio(sample_ratio, "sample_ratio")

    def compress(self, tensor: torch.Tensor, name: str, step: int = 0,
                 ratio: float | None = None) -> Payload:
        """A ``coo`` payload of the entries over the sampled threshold, at most k of them."""
        flat = flat_of(tensor)
        numel = flat.numel()
        ratio = self._ratio(ratio)
        k = global_k(numel, ratio)
        samples = min(numel, max(global_k(numel, self.sample_ratio), 64))
        gen = torch.Generator(device="cpu").manual_seed(seed_for(name, step))
        picks = torch.randint(0, numel, (samples,), generator=gen).to(flat.device)
        sample = flat[picks].abs()
        threshold = float(sample.topk(global_k(samples, ratio), sorted=False).values.min())
        if not math.isfinite(threshold):  # the sample holds a NaN or an infinity
            return self._coo(tensor, flat, global_topk(flat, k))
        positions = above(flat, threshold)
        if positions.numel() == 0:  # a sample can overshoot on spiky layers
            positions = above(flat, threshold * 0.5)
        return self._coo(tensor, flat, trim(flat, positions, k))
