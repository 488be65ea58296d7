"""A sparse payload written into a dense CPU tensor in one pass (the compiled _sparse_write.c).

Decoding an answer (``Payload.write_into``) is, on torch's path, a ``zero_`` of the whole
partition and then a ``scatter_add_`` of the values: two passes over memory where one does.
Where the positions ascend, as a server's answers' and ADTopk's fibres' do, the compiled walk
zeroes and places in the same front-to-back pass, with torch's arithmetic, so the bits are the
same. It serves ``fibre`` and ``coo`` payloads into a contiguous CPU tensor of float32, float64,
float16 or bfloat16, from values of that dtype or, into float32, of a 16-bit one; anything
else, and positions that go back, stay on torch's path.
"""
from __future__ import annotations

import math
import torch

from adtopk_ps.core.dtypes import INDEX_DTYPES

try:
    from adtopk_ps.core import _sparse_write
except ImportError:  # built without a C compiler: torch's scatter does the work
    _sparse_write = None

#: dtype -> the code _sparse_write.c knows it by
_CODES = {torch.float32: 0, torch.float64: 1, torch.float16: 2, torch.bfloat16: 3}
_INDEX_TYPES = frozenset(INDEX_DTYPES.values())


def _on_cpu(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.is_contiguous()


def applies(out: torch.Tensor, codec: str, values: torch.Tensor, indices: torch.Tensor,
            view: tuple[int, ...] | None = None, rows: torch.Tensor | None = None) -> bool:
    """Whether :func:`write` can write a payload's parts (adtopk_ps/core/payload.py says what
    each codec carries) into ``out``, which has the shape of the tensor the payload stands for."""
    if _sparse_write is None or codec not in ("fibre", "coo"):
        return False
    if not (out.dtype in _CODES and _on_cpu(out) and out.numel() > 0 and _on_cpu(values)
            and indices.dtype in _INDEX_TYPES and _on_cpu(indices)
            and (values.dtype == out.dtype
                 or (out.dtype == torch.float32 and values.dtype in (torch.float16, torch.bfloat16)))):
        return False
    if codec == "coo":
        return values.dim() == 1 and indices.numel() == values.numel()
    if (view is None or len(view) < 2 or math.prod(view) != out.numel() or values.dim() != len(view)
            or tuple(values.shape[2:]) != tuple(view[2:]) or indices.shape != values.shape):
        return False
    if rows is None:
        return values.shape[0] == view[0]
    return (rows.dtype == torch.int64 and _on_cpu(rows) and rows.dim() == 1
            and rows.numel() == values.shape[0] <= view[0])


def write(out: torch.Tensor, codec: str, values: torch.Tensor, indices: torch.Tensor,
          view: tuple[int, ...] | None = None, rows: torch.Tensor | None = None,
          divisor: int = 1) -> bool:
    """``out[:] = decompress(payload) / divisor`` for a payload's parts where :func:`applies`,
    with the bits torch's ``zero_`` and ``scatter_add_`` would give; False where the positions
    go back (``out`` is then partly written: the caller takes torch's path). A position out of
    bounds raises the ``RuntimeError`` torch's scatter raises (``out`` then holds zeros and
    what landed first).

    Example::

        out = torch.empty(4)
        write(out, "coo", torch.tensor([3.0, 5.0]), torch.tensor([1, 3]), divisor=2)
        # True; out is tensor([0.0, 1.5, 0.0, 2.5])
    """
    if values.numel() == 0:  # nothing lands (an empty row set has no memory to point at)
        out.zero_()
        return True
    if codec == "fibre":
        lead, n, rest, k = values.shape[0], view[1], math.prod(view[2:]), values.shape[1]
    else:
        lead, n, rest, k = 1, out.numel(), 1, values.numel()
    return _sparse_write.write(out.data_ptr(), out.numel(), _CODES[out.dtype], values.data_ptr(),
                               _CODES[values.dtype], indices.data_ptr(), indices.element_size(),
                               0 if rows is None else rows.data_ptr(), lead, n, rest, k, divisor,
                               codec == "fibre")
