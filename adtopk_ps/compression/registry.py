"""Compressors by name, built from keyword parameters or a byteps-style dict."""
from __future__ import annotations

import inspect
from typing import Mapping

from adtopk_ps.compression.adtopk import ADTopk, ADTopkInterleaved
from adtopk_ps.compression.base import Compressor
from adtopk_ps.compression.dense import Dense
from adtopk_ps.compression.dgc import DGC
from adtopk_ps.compression.gaussiank import GaussianK
from adtopk_ps.compression.memory import EF_KINDS, ErrorFeedback
from adtopk_ps.compression.randomk import RandomK
from adtopk_ps.compression.threshold import Threshold
from adtopk_ps.compression.topk import TopK

COMPRESSORS: dict[str, type[Compressor]] = {
    cls.name: cls
    for cls in (Dense, TopK, Threshold, ADTopk, ADTopkInterleaved, RandomK, DGC, GaussianK)
}

# byteps' dict spelling of the same parameters
_ALIASES = {"k": "ratio", "compressor_k": "ratio"}


def parameters(name: str) -> list[str]:
    """Keyword parameters a compressor accepts (besides ``ef``)."""
    sig = inspect.signature(COMPRESSORS[name].__init__)
    return [p for p in sig.parameters if p != "self"]


def create(spec: str | Mapping, **params) -> Compressor:
    """A compressor from a name and parameters, or from ``{"compressor": name, ...}``.

    ``ef="vanilla"`` wraps it with error feedback.

    Example::

        comp = create("adtopk", ratio=0.01, ef="vanilla")
        comp = create({"compressor": "adtopk", "k": 0.01, "ef": "vanilla"})   # byteps' form
        payload = comp.compress(grad, name="fc.weight", step=0)
    """
    if isinstance(spec, Mapping):
        params = {**spec, **params}
        if "compressor" not in params:
            raise ValueError(f"compression dict needs a 'compressor' key; got keys {sorted(params)}")
        spec = params.pop("compressor")
    if not isinstance(spec, str) or spec not in COMPRESSORS:
        raise ValueError(f"unknown compressor {spec!r}; valid: {sorted(COMPRESSORS)}")
    for alias, real in _ALIASES.items():
        if alias in params:
            if real in params:
                raise ValueError(f"give only one of {alias!r} and {real!r}")
            params[real] = params.pop(alias)
    ef = params.pop("ef", None)
    if ef not in (None, "none", *EF_KINDS):
        raise ValueError(f"ef must be one of {['none', *EF_KINDS]} or None, got {ef!r}")
    valid = parameters(spec)
    unknown = sorted(set(params) - set(valid))
    if unknown:
        raise ValueError(f"compressor {spec!r} does not take {unknown}; valid parameters: "
                         f"{valid + ['ef']}")
    compressor = COMPRESSORS[spec](**params)
    return ErrorFeedback(compressor) if ef in EF_KINDS else compressor
