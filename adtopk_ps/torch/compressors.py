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

from adtopk_ps.compression import (COMPRESSORS, Compressor, Dense, SparsificationPolicy, create,
                                   parameters)
from adtopk_ps.compression.select import all_finite
from adtopk_ps.core.dtypes import FLOAT_DTYPES
from adtopk_ps.core.payload import Payload


class FP16(Dense):
    """Every element, as float16 on the wire; the result comes back in the tensor's dtype.

    Magnitudes beyond float16's range are clamped to it before the cast.
    """

    name = "fp16"

    def __init__(self):
        super().__init__(value_dtype="fp16")

    def __repr__(self) -> str:
        return "Compression.fp16"


class HorovodCompressor:
    """horovod's compressor interface, for scripts that call it or subclass it:
    ``compress(tensor) -> (tensor, ctx)`` before the sum, ``decompress(tensor, ctx)`` after.
    Any class or object with these two is accepted as ``compression=`` (see
    :class:`UserCompressor`).

    Example::

        class Halve(hvd.Compression.Compressor):
            @staticmethod
            def compress(tensor):
                return tensor / 2, None

            @staticmethod
            def decompress(tensor, ctx):
                return tensor * 2

        hvd.allreduce(t, compression=Halve)
    """

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, object]:
        """The tensor to sum, and what :meth:`decompress` needs to undo it."""
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: object) -> torch.Tensor:
        """The summed tensor, as the caller's."""
        return tensor


class NoneCompressor(HorovodCompressor):
    """horovod's ``Compression.none``: every tensor as it is."""


class FP16Compressor(HorovodCompressor):
    """horovod's ``Compression.fp16``: floating tensors as float16, others as they are.
    As ``compression=`` it is :class:`FP16` on the wire."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, object]:
        """Floating tensors cast to float16; the context is the tensor's dtype."""
        return (tensor.to(torch.float16) if tensor.is_floating_point() else tensor), tensor.dtype

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: object) -> torch.Tensor:
        """Back to the dtype ``compress`` saw."""
        return tensor.to(ctx) if ctx.is_floating_point else tensor


class UserCompressor(Dense):
    """A user's horovod-style compressor on the wire: its ``compress`` makes the values that
    are summed (the same number of elements, a floating dtype), its ``decompress`` is
    applied to the answer, once averaged and cast back to the tensor's dtype."""

    def __init__(self, user: object):
        super().__init__()
        self.user = user
        self.name = f"horovod-style {getattr(user, '__name__', type(user).__name__)}"
        self._contexts: dict[str, object] = {}

    def compress(self, tensor: torch.Tensor, name: str, step: int = 0,
                 ratio: float | None = None) -> Payload:
        """The user's compressed tensor as a dense payload of ``tensor``'s shape."""
        values, ctx = self.user.compress(tensor.detach())
        if not isinstance(values, torch.Tensor) or values.numel() != tensor.numel() or \
                values.dtype not in FLOAT_DTYPES.values():
            raise ValueError(f"{self.name}.compress must return a floating tensor of "
                             f"{tensor.numel()} elements and a context; got {values!r:.80}")
        self._contexts[name] = ctx
        return Payload("dense", tuple(tensor.shape), tensor.dtype, values.reshape(-1),
                       nonfinite=not all_finite(values))

    def restore(self, answer: torch.Tensor, name: str) -> None:
        """``answer`` becomes the user's ``decompress`` of it."""
        restored = self.user.decompress(answer, self._contexts.pop(name, None))
        if restored is not answer:
            answer.copy_(restored.reshape(answer.shape))

    def __repr__(self) -> str:
        return self.name


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
    as float16 (both ways) and returns it in its own dtype (both have horovod's
    ``compress``/``decompress``, and a class of one's own with them is
    accepted too: :class:`HorovodCompressor`); the sparsifiers
    (``adtopk``, ``adtopk_i``, ``topk``, ``randomk``, ``dgc``, ``gaussiank``,
    ``threshold``) keep ``ratio`` of the elements, with error feedback by
    default. The optimizer sends 1-D and small tensors dense under a
    sparsifier (see :class:`SparsificationPolicy`).

    Example::

        opt = bps.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                       compression=bps.Compression.adtopk(ratio=0.01))
    """

    Compressor = HorovodCompressor
    none = NoneCompressor
    fp16 = FP16Compressor
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
    by the registry; horovod's ``Compression.fp16`` as :class:`FP16`; any other class or
    object with horovod's ``compress`` and ``decompress`` as a :class:`UserCompressor`.
    Anything else is refused, named."""
    if compression is None or compression == "none" or _is(compression, NoneCompressor):
        return None
    if isinstance(compression, Compressor):
        return compression
    if isinstance(compression, (str, Mapping)):
        return create(compression)
    if _is(compression, FP16Compressor):
        return FP16()
    if callable(getattr(compression, "compress", None)) and \
            callable(getattr(compression, "decompress", None)):
        return UserCompressor(compression)
    raise TypeError(f"unknown compression {compression!r} (a {type(compression).__name__}); use "
                    f"adtopk_ps.torch.Compression.none, .fp16, .adtopk(ratio=...) or another of "
                    f"its sparsifiers, a compressor name from {sorted(COMPRESSORS)}, or a "
                    f"byteps-style dict {{'compressor': name, ...}}")


def _is(compression: object, kind: type) -> bool:
    """Whether ``compression`` is the class ``kind`` (as horovod passes it) or an instance."""
    return compression is kind or (isinstance(compression, type) and issubclass(compression, kind)
                                   and compression.compress is kind.compress
                                   and compression.decompress is kind.decompress) \
        or type(compression) is kind


def is_cast(compressor: Compressor | None) -> bool:
    """Whether ``compressor`` sends every element (a cast such as fp16), not a selection."""
    return compressor is not None and not compressor.sparse
