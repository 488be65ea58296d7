"""Random-k: positions from a seed every process shares, so only values travel."""
from __future__ import annotations

import torch

from adtopk_ps.compression.base import Compressor, flat_of, global_k
from adtopk_ps.compression.select import all_finite
from adtopk_ps.core.payload import Payload
from adtopk_ps.core.seeded import seed_for, seeded_values


class RandomK(Compressor):
    """Random-k: k positions drawn from a seed every worker derives from the name and step, so only values travel."""

    name = "randomk"

    def __init__(self, ratio: float = 0.01, seed: int = 0, value_dtype: str | None = None):
        super().__init__(ratio, value_dtype)
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
        self.seed = seed

    def compress(self, tensor: torch.Tensor, name: str, step: int = 0,
                 ratio: float | None = None) -> Payload:
        """A ``seeded`` payload: the values at this name and step's random positions."""
        flat = flat_of(tensor)
        k = global_k(flat.numel(), self._ratio(ratio))
        seed = seed_for(name, step, self.seed)
        # the k values sent are all it reads otherwise: a NaN or an infinity elsewhere costs a read
        return Payload("seeded", tuple(tensor.shape), tensor.dtype,
                       self._values(seeded_values(seed, flat, k)), seed=seed, nonfinite=not all_finite(flat))
