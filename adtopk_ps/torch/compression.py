"""``Compression``: byteps' and horovod's namespace of gradient compressions, with ours in it.

Scripts written for byteps or horovod pass ``compression=bps.Compression.fp16``
(or ``.none``); our sparsifiers are reached the same way, so ADTopk is one
argument away. Every API that takes ``compression=`` (the optimizer, the
functional ops, the DDP wrapper) turns it into a :class:`Compressor` (or
None for none) through :func:`compressor_of`, which refuses what it does not
know, naming it.
"""
from __future__ import annotations

from typing import Mapping

import torch

from ..compression import (COMPRESSORS, Compressor, Dense, SparsificationPolicy, create,
                           parameters)


class FP16(Dense):
    """Every element, as float16 on the wire; the result comes back in the tensor's dtype.

    Magnitudes beyond float16's range are clamped to it before the cast.
    """

    name = "fp16"

    def __init__(self):
        super().__init__(value_dtype="fp16")

    def __repr__(self) -> str:
        return "Compression.fp16"


class EveryTensor(SparsificationPolicy):
    """Routes every tensor through the compressor, 1-D and small ones included: a cast
    (fp16) saves bytes on any tensor, unlike a sparsifier."""

    def is_dense(self, shape, dtype: torch.dtype) -> bool:
        """Never: every tensor goes through the compressor."""
        return False


def _sparsifier(name: str):
    def make(ratio: float = 0.01, ef: bool = True, **params) -> Compressor:
        return create(name, ratio=ratio, ef="vanilla" if ef else None, **params)
    make.__name__ = name.replace("-", "_")
    make.__doc__ = (f"The {name!r} sparsifier keeping ``ratio`` of the elements, with error "
                    f"feedback (``ef``) carrying the rest into the next step; other keyword "
                    f"parameters: {[p for p in parameters(name) if p != 'ratio']}.")
    return staticmethod(make)


class Compression:
    """Gradient compressions by name, as ``byteps.torch.Compression`` / ``horovod.torch.Compression``.

    ``none`` sends tensors as they are; ``fp16`` sends every floating tensor
    as float16 (both ways) and returns it in its own dtype; the sparsifiers
    (``adtopk``, ``adtopk_i``, ``topk``, ``randomk``, ``dgc``, ``gaussiank``,
    ``threshold``) keep ``ratio`` of the elements, with error feedback by
    default. The optimizer sends 1-D and small tensors dense under a
    sparsifier (see :class:`SparsificationPolicy`).

    Example::

        opt = bps.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                       compression=bps.Compression.adtopk(ratio=0.01))
    """

    none = None
    fp16: Compressor = FP16()
    adtopk = _sparsifier("adtopk")
    adtopk_i = _sparsifier("adtopk-i")
    topk = _sparsifier("topk")
    randomk = _sparsifier("randomk")
    dgc = _sparsifier("dgc")
    gaussiank = _sparsifier("gaussiank")
    threshold = _sparsifier("threshold")


def compressor_of(compression: object) -> Compressor | None:
    """The compressor ``compression`` names: None for none; a :class:`Compressor` as it is;
    a name or byteps' dict (``{"compressor": "adtopk", "k": 0.01, "ef": "vanilla"}``) built
    by the registry. Anything else is refused, named."""
    if compression is None or compression == "none":
        return None
    if isinstance(compression, Compressor):
        return compression
    if isinstance(compression, (str, Mapping)):
        return create(compression)
    raise TypeError(f"unknown compression {compression!r} (a {type(compression).__name__}); use "
                    f"adtopk_ps.torch.Compression.none, .fp16, .adtopk(ratio=...) or another of "
                    f"its sparsifiers, a compressor name from {sorted(COMPRESSORS)}, or a "
                    f"byteps-style dict {{'compressor': name, ...}}")


def is_cast(compressor: Compressor | None) -> bool:
    """Whether ``compressor`` sends every element (a cast such as fp16), not a selection."""
    return compressor is not None and not compressor.sparse
