"""The dtypes the wire carries, by the names it carries them under: one table that the
payload, the wire's checks and the compressors' options derive from. A selection kernel
lists the subset it supports next to its code (fibre_triton.py's ``DTYPES``, select.py's
numpy path), and names a dtype by its wire name, which is also Triton's.

A float dtype may carry values (and name a tensor's dtype); an index dtype may carry
positions. Nothing else travels.
"""
from __future__ import annotations

import torch

#: wire name -> float dtype, for values and the tensor a payload stands for
FLOAT_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}
#: wire name -> index dtype, for positions (and a fibre payload's listed rows)
INDEX_DTYPES: dict[str, torch.dtype] = {
    "uint8": torch.uint8,
    "uint16": torch.uint16,
    "int32": torch.int32,
    "int64": torch.int64,
}
#: every dtype the wire carries, by name
WIRE_DTYPES: dict[str, torch.dtype] = {**FLOAT_DTYPES, **INDEX_DTYPES}
_NAME_OF: dict[torch.dtype, str] = {dtype: name for name, dtype in WIRE_DTYPES.items()}


def wire_name(dtype: torch.dtype) -> str | None:
    """The name ``dtype`` travels under; None for a dtype the wire does not carry."""
    return _NAME_OF.get(dtype)


def index_dtype(length: int) -> torch.dtype:
    """Smallest index type holding positions ``0 .. length-1``.

    Unsigned 8/16-bit first (what makes ADTopk messages compact), then the
    signed 32/64-bit types that torch can index with.
    """
    if length <= 1 << 8:
        return torch.uint8
    if length <= 1 << 16:
        return torch.uint16
    if length <= 1 << 31:
        return torch.int32
    return torch.int64
