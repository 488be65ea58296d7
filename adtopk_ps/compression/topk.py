"""Exact global top-k: the traditional sparsifier ADTopk is compared with."""
from __future__ import annotations

import torch

from adtopk_ps.compression.base import Compressor, flat_of, global_k
from adtopk_ps.compression.select import global_topk
from adtopk_ps.core.payload import Payload


class TopK(Compressor):
    """Exact global top-k of |g| over the whole tensor, flat positions on the wire."""

    name = "topk"

    def compress(self, tensor: torch.Tensor, name: str, step: int = 0,
                 ratio: float | None = None) -> Payload:
        """A ``coo`` payload of the k largest |g|."""
        flat = flat_of(tensor)
        k = global_k(flat.numel(), self._ratio(ratio))
        return self._coo(tensor, flat, global_topk(flat, k))

    def compress_with_feedback(self, tensor: torch.Tensor, residual: torch.Tensor, name: str,
                               step: int = 0, ratio: float | None = None) -> Payload | None:
        """As :meth:`compress`, with error feedback fused into the selection (see ``ErrorFeedback``)."""
        return self._coo_with_feedback(tensor, residual, ratio)
