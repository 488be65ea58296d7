"""No compression: the baseline every sparsifier is measured against."""
from __future__ import annotations

import torch

from adtopk_ps.compression.base import Compressor
from adtopk_ps.compression.select import all_finite
from adtopk_ps.core.payload import Payload


class Dense(Compressor):
    """No compression: every element, in order (the ``dense`` codec)."""

    name = "none"
    sparse = False

    def __init__(self, value_dtype: str | None = None):
        super().__init__(1.0, value_dtype)

    def compress(self, tensor: torch.Tensor, name: str, step: int = 0,
                 ratio: float | None = None) -> Payload:
        """Every element as it is; one read of the tensor finds a NaN or an infinity in it."""
        values = self._values(tensor.detach().reshape(-1))
        return Payload("dense", tuple(tensor.shape), tensor.dtype, values,
                       nonfinite=not all_finite(tensor))
