"""Partial sparsification: which tensors travel dense, and at what density the rest do.

Biases and norms (``dim() < 2``) and small tensors gain nothing from
sparsification: their index overhead and per-message cost outweigh the bytes
saved. In budget mode the density of the remaining layers rises so the total
volume stays ``ratio * sum(numel)``, as the ADTopk authors do.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Mapping

import torch

from adtopk_ps.compression.base import check_ratio
from adtopk_ps.compression.cost import CostModel
from adtopk_ps.core.env import env_int

DEFAULT_MIN_COMPRESS_BYTES = 65536


@dataclass(frozen=True)
class Route:
    """How one tensor travels: dense, or sparse at ``ratio``."""

    dense: bool
    ratio: float


class SparsificationPolicy:
    """Which tensors are sparsified, and at what density (partial sparsification).

    Example::

        policy = SparsificationPolicy(ratio=0.01, min_compress_bytes=65536)
        routes = policy.plan(model.named_parameters())   # name -> Route(dense, ratio)
    """

    def __init__(self, ratio: float = 0.01, min_compress_bytes: int | None = None,
                 budget: bool = False, environ: Mapping[str, str] | None = None,
                 cost_model: CostModel | None = None):
        self.ratio = check_ratio(ratio)
        if min_compress_bytes is None:
            min_compress_bytes = env_int("BYTEPS_MIN_COMPRESS_BYTES", DEFAULT_MIN_COMPRESS_BYTES,
                                         minimum=0, environ=environ)
        elif isinstance(min_compress_bytes, bool) or not isinstance(min_compress_bytes, int) \
                or min_compress_bytes < 0:
            raise ValueError(f"min_compress_bytes must be a non-negative integer, "
                             f"got {min_compress_bytes!r}")
        self.min_compress_bytes = min_compress_bytes
        self.budget = budget
        self.cost_model = cost_model
        self.sparse_ratio = self.ratio

    def is_dense(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> bool:
        """Dense by shape and size, or where the measured costs say sparsifying does not pay."""
        itemsize = dtype.itemsize
        numel = math.prod(shape)
        if len(shape) < 2 or numel * itemsize < self.min_compress_bytes:
            return True
        return self.cost_model is not None and not self.cost_model.sparse_pays(numel, itemsize,
                                                                               self.ratio)

    def plan(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, Route]:
        """Routes for a whole model; in budget mode this fixes the sparse density."""
        tensors = [(name, tuple(t.shape), t.dtype) for name, t in tensors]
        total = sum(math.prod(shape) for _, shape, _ in tensors)
        dense = sum(math.prod(shape) for _, shape, dtype in tensors if self.is_dense(shape, dtype))
        self.sparse_ratio = self.ratio
        if self.budget and total > dense:
            left = total * self.ratio - dense
            if left <= 0:
                raise ValueError(
                    f"budget mode: dense tensors alone send {dense} elements, over the budget of "
                    f"{total * self.ratio:.0f} (ratio {self.ratio} of {total}); lower "
                    f"min_compress_bytes (now {self.min_compress_bytes}) or raise the ratio")
            self.sparse_ratio = left / (total - dense)
        return {name: self._route(shape, dtype) for name, shape, dtype in tensors}

    def route(self, tensor: torch.Tensor) -> Route:
        """The route of one tensor by its shape, size and, with a cost model, its measured price."""
        return self._route(tuple(tensor.shape), tensor.dtype)

    def _route(self, shape: tuple[int, ...], dtype: torch.dtype) -> Route:
        if self.is_dense(shape, dtype):
            return Route(True, 1.0)
        return Route(False, self.sparse_ratio)
