"""ADTopk's per-fibre top-k on CUDA as one Triton kernel, error feedback fused in.

One launch handles every tensor of a batch that shares a tile shape (a few
launches for a whole model). A program takes a block of whole fibres into
registers and, in that one pass over memory: adds the gradient into the
residual, finds each fibre's k-th largest |x| by bisection on the bits of
|x| (RTop-K's row-wise threshold search, exact), selects the entries above it
and the first of those equal to it, writes their values and narrowed
positions into one device buffer, and stores the residual with what was sent
set to zero. :class:`~adtopk_ps.compression.staging.Stage` then copies that
buffer to reused pinned host memory on a side stream.

What it selects, and in what order, is what the CPU kernel (``_fibre.c``)
writes for float32, so payloads are equal bit for bit:

- NaN counts as an infinite magnitude (it ties with an infinity).
- k <= 2 (and k < n): largest first; equal magnitudes by lower position.
- otherwise the C kernel's scan order: with ``g = group_size(n, k)`` groups of
  ``m = n // g``, position ``r*m + c`` (r < g) comes at ``c*g + r`` and the last
  ``n - g*m`` positions after all of those, in order. Ties at the k-th
  magnitude go to the earliest in that order, and the k positions are written
  in it; except where the k-th largest group maximum is the k-th largest
  magnitude (fewer than k entries above it, as in a fibre of zeros): then the
  entries above it come in scan order, and those equal to it fill the rest
  by position. A fibre with no groups (g = 0), or with a NaN among its grouped
  positions, is scanned in plain position order.

On CPU, float16 and bfloat16 take torch's own selections, whose order (and
choice among equal magnitudes) torch does not fix; there the kernel's
payloads hold the same entries where magnitudes are distinct, in the order
above. The residual is ``r + g`` rounded to the tensor's dtype, as torch
computes it.

Triton is optional: :func:`applies` is False where it cannot be imported, and
the CPU path (``select.py``) runs as before.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from functools import lru_cache

import torch

from ..dtypes import index_dtype, wire_name
from .staging import Stage, aligned

# bits of |x| below the sign, and the key of an infinity (a NaN's key is clipped to it)
_BITS = {torch.float32: 31, torch.float16: 15, torch.bfloat16: 15}
#: the wire's float dtypes (adtopk_ps/dtypes.py) this kernel selects in: all but float64
DTYPES = tuple(_BITS)
_INF_KEY = {torch.float32: 0x7F800000, torch.float16: 0x7C00, torch.bfloat16: 0x7F80}
_SMALL_K = 2  # the C kernel's SMALL_K: largest-first order up to here
_TILE = 4096  # elements per program that fibres are packed up to
# one row of the table per tensor: pointers, sizes, strides, its first program
_COLUMNS = 17


@lru_cache(maxsize=1)
def _triton():
    """The triton modules and the compiled kernel, or None without triton."""
    try:
        import triton  # noqa: F401  (imported lazily: it is optional)
        import triton.language as tl
    except ImportError:
        return None
    from . import _fibre_kernel
    return _fibre_kernel.kernel, tl


def interpreted() -> bool:
    """Whether Triton runs kernels in its interpreter (on CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


# CPU tensors take the kernel too (under Triton's interpreter): for tests of the wiring only,
# the CPU path is select.py's
CPU_TENSORS = False


def applies(x: torch.Tensor) -> bool:
    """Whether the kernel can select from ``x``: a CUDA tensor of a supported dtype, with
    triton importable."""
    if x.dtype not in DTYPES or x.dim() < 2 or x.numel() == 0:  # empty: select.py's arange
        return False
    if x.device.type != "cuda" and not (CPU_TENSORS and x.device.type == "cpu" and interpreted()):
        return False
    return _triton() is not None


def group_size(n: int, k: int) -> int:
    """The C kernel's group size for a fibre (``group_size`` in _fibre.c); 0: no groups."""
    for g in (16, 8, 4):
        if n // g >= 4 * k:
            return g
    return 0


@dataclass
class Item:
    """One tensor to select from: ``x`` viewed as [A, n, R] fibres along axis 1."""
    x: torch.Tensor  # what is selected from; with grad, the residual, updated in place
    grad: torch.Tensor | None
    k: int


@dataclass
class Selected:
    """One tensor's selection: device views into the stage's buffer and their host copies."""
    values: torch.Tensor
    indices: torch.Tensor
    host_values: torch.Tensor
    host_indices: torch.Tensor
    nonfinite: bool


def _three_d(x: torch.Tensor) -> torch.Tensor:
    return x.view(x.shape[0], x.shape[1], math.prod(x.shape[2:]))


def _config(n: int, k: int) -> tuple[bool, int, int, int]:
    """(small, groups in the tile, group length m, tile columns) for fibres of length n."""
    if k <= _SMALL_K and k < n:
        return True, 1, n, 1
    g = group_size(n, k) if k < n else 0
    if g == 0:
        return False, 1, n, 1
    return False, g, n // g, g


def select(items: list[Item], stage: Stage) -> list[Selected]:
    """Every item's per-fibre top-k into ``stage``'s buffer, then to its host buffer.

    Items with a ``grad`` are error feedback: ``x += grad`` first, and the
    selected entries of ``x`` end as zero. Returns once the host bytes are
    ready (they were copied on the side stream); the views stay valid until the
    next call on ``stage``.
    """
    kernel, tl = _triton()
    if not items:
        return []
    dtype = items[0].x.dtype
    layout, at = _lay_out(items)
    launches, starts, spans, programs = _plan_launches(items, layout)
    flags_at = at
    total = aligned(flags_at + programs)
    buffer = stage.device_buffer(total)
    for key, members, fb, first_program in launches:
        _launch(kernel, tl, key, members, fb, items, layout, buffer,
                buffer[flags_at + first_program:], stage, dtype)
    host = stage.to_host(total)
    stage.wait()
    results = []
    for i, item in enumerate(items):
        values_at, indices_at, count, idt = layout[i]
        shape = (item.x.shape[0], item.k, *item.x.shape[2:])
        results.append(Selected(
            _region(buffer, values_at, count, dtype).view(shape),
            _region(buffer, indices_at, count, idt).view(shape),
            _region(host, values_at, count, dtype).view(shape),
            _region(host, indices_at, count, idt).view(shape),
            bool(host[flags_at + starts[i]:flags_at + starts[i] + spans[i]].any())))
    return results


def _lay_out(items: list[Item]) -> tuple[list[tuple[int, int, int, torch.dtype]], int]:
    """Where each item's values and indices go in the stage's buffer (values at, indices at,
    count, index dtype), and the bytes they take; items the kernel cannot take are refused."""
    dtype, device = items[0].x.dtype, items[0].x.device
    layout, at = [], 0
    for item in items:
        x = item.x
        if x.dtype != dtype or x.device != device or x.dtype not in DTYPES or x.dim() < 2:
            raise ValueError(f"fibre kernel: every tensor must be {dtype} on {device} with "
                             f"dim() >= 2, got {x.dtype} {tuple(x.shape)} on {x.device}")
        if item.grad is not None and (item.grad.shape, item.grad.dtype, item.grad.device) != \
                (x.shape, x.dtype, x.device):
            raise ValueError(f"fibre kernel: grad {tuple(item.grad.shape)} {item.grad.dtype} does "
                             f"not match {tuple(x.shape)} {x.dtype}")
        n = x.shape[1]
        if not 1 <= item.k <= n:
            raise ValueError(f"fibre kernel: k={item.k} outside [1, {n}] for {tuple(x.shape)}")
        count = x.shape[0] * item.k * math.prod(x.shape[2:])
        idt = index_dtype(n)
        values_at, at = at, aligned(at + count * x.element_size())
        indices_at, at = at, aligned(at + count * idt.itemsize)
        layout.append((values_at, indices_at, count, idt))
    return layout, at


def _plan_launches(items: list[Item], layout: list) -> tuple[list, dict[int, int], dict[int, int], int]:
    """One launch per kernel configuration: (key, its items, fibres per program, its first
    program) each; the first program and the number of programs of each item; all programs."""
    groups: dict[tuple, list[int]] = {}
    for i, item in enumerate(items):
        small, g, m, tail = _config(item.x.shape[1], item.k)
        key = (small, g, 1 << max(0, (m - 1).bit_length()), tail, layout[i][3].itemsize,
               item.grad is not None)
        groups.setdefault(key, []).append(i)
    # programs are numbered across launches: item i owns flags[starts[i]:starts[i] + spans[i]]
    launches, starts, spans, programs = [], {}, {}, 0
    for key, members in groups.items():
        small, g_tile, mb, tail, _, _ = key
        fb = 1 << (max(1, _TILE // (g_tile * mb)).bit_length() - 1)
        most = max(_fibres(items[i].x) for i in members)
        fb = min(fb, 1 << max(0, (most - 1).bit_length()))
        launches.append((key, members, fb, programs))
        for i in members:
            starts[i], spans[i] = programs, -(-_fibres(items[i].x) // fb)
            programs += spans[i]
    return launches, starts, spans, programs


def _fibres(x: torch.Tensor) -> int:
    return x.shape[0] * math.prod(x.shape[2:])


def _region(buffer: torch.Tensor, at: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    return buffer[at:at + count * dtype.itemsize].view(dtype)


_TL_INDEX = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}  # int16: uint16's bits


def _launch(kernel, tl, key, members, fb, items, layout, buffer, flags, stage, dtype) -> None:
    small, g_tile, mb, tail, index_bytes, feedback = key
    rows, owners, pid = [], [], 0
    base = buffer.data_ptr()
    for slot, i in enumerate(members):
        item = items[i]
        x3 = _three_d(item.x)
        grad3 = _three_d(item.grad) if feedback else x3
        n, k = x3.shape[1], item.k
        _, g, m, _ = _config(n, k)
        fibres = x3.shape[0] * x3.shape[2]
        span = -(-fibres // fb)
        values_at, indices_at, _, _ = layout[i]
        rows += [x3.data_ptr(), grad3.data_ptr(), base + values_at, base + indices_at, n, k,
                 x3.shape[2], fibres, g, m, *x3.stride(), *grad3.stride(), pid]
        owners += [slot] * span
        pid += span
    if pid == 0:
        return
    table = stage.table(rows + owners)
    warps = 4 if g_tile * mb * fb <= 2048 else 8 if g_tile * mb * fb <= 8192 else 16
    kernel[(pid,)](
        table, len(rows), flags,
        DT=getattr(tl, wire_name(dtype)), IDT=getattr(tl, _TL_INDEX[index_bytes]),
        BITS=_BITS[dtype], INF_KEY=_INF_KEY[dtype], FB=fb, G=g_tile, MB=mb, TB=tail,
        SMALL=small, FEEDBACK=feedback, W=_COLUMNS, num_warps=warps,
        enable_fp_fusion=True)  # Triton's default, stated: left unstated, Triton 3.9 warns
