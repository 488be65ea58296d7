"""Selection kernels: which entries of a gradient to keep.

All kernels compare magnitudes |g|, run on the tensor's own device, and
return int64 positions (callers narrow the type for the wire).

A fibre selection (:func:`fibre_topk`, :func:`fibre_topk_feedback`) follows
one rule, so that the CUDA kernel (``fibre_triton.py``) and this CPU path
write the same payload, per fibre ``x[a, :, j...]`` of length ``n``:

1. an entry's key is |x|, a NaN's an infinity (a NaN ties with an infinity);
2. the ``k`` entries of largest key are selected, of equal keys the lower
   positions first (``k >= n``: every position);
3. the positions are written in ascending order along the fibre, and the
   values in the same order.

float32 contiguous CPU tensors take the compiled kernel (``_fibre.c``),
which follows it exactly, ties included. The other CPU paths (float16,
bfloat16, float64, strided tensors, an install without a C compiler) take
torch's selections: their positions are ascending too, and they select the
same entries wherever the keys at the k-th are distinct, but torch.topk
does not fix its choice among equal keys, and puts a NaN above an infinity.
"""
from __future__ import annotations

import math

import numpy as np
import torch

try:
    from adtopk_ps.compression import _fibre
except ImportError:  # built without a C compiler: the torch kernels below do the work
    _fibre = None

# Fibres shorter than this sort faster in one go (measured: benchmarks/compression.py).
_MIN_TWO_STAGE = 1024
# Group sizes outside this range measured slower on every layer shape tried.
_MIN_GROUP, _MAX_GROUP = 4, 8
# the wire's float dtypes (adtopk_ps/core/dtypes.py) that numpy can partition: it has no bfloat16
_NUMPY_DTYPES = (torch.float32, torch.float64, torch.float16)


def largest_along_1(x: torch.Tensor, k: int) -> torch.Tensor:
    """Positions along axis 1 of the ``k`` largest entries of ``x`` (unordered).

    torch.topk is fast when ``k`` is a small share of a row and slow from about
    2%; numpy's introselect (``argpartition``) costs the same for any ``k`` and
    measured up to twice as fast there, on rows of 2-D CPU tensors (along
    another axis of a 4-D one it was slower). The two-stage search's inner
    selections are all of that kind.
    """
    n = x.shape[1]
    if x.device.type != "cpu" or x.dtype not in _NUMPY_DTYPES or x.dim() != 2 or k * 50 < n:
        return x.topk(k, dim=1, sorted=False).indices
    return torch.from_numpy(np.argpartition(x.numpy(), n - k, axis=1)[:, n - k:])


def fibre_topk(x: torch.Tensor, k: int) -> torch.Tensor:
    """Positions along axis 1 of the ``k`` largest |x| in every fibre ``x[i, :, j...]``,
    ascending along the fibre (the rule of the module docstring).

    ``x`` has shape ``[A, n, *rest]``; the result ``[A, k, *rest]``.
    """
    n = x.shape[1]
    if k < n and _kernel_applies(x):
        return _kernel_topk(x, k)
    if k >= n:
        shape = [1] * x.dim()
        shape[1] = n
        return torch.arange(n, device=x.device).view(shape).expand(x.shape).contiguous()
    if k == 1:  # largest |x| is the max or the min: two reads, no |x| copy
        hi, at_hi = x.max(dim=1, keepdim=True)  # of equal values, the first
        lo, at_lo = x.min(dim=1, keepdim=True)
        return torch.where((hi > lo.neg()) | ((hi == lo.neg()) & (at_hi < at_lo)), at_hi, at_lo)
    return _search(x, k).sort(dim=1).values


def _search(x: torch.Tensor, k: int) -> torch.Tensor:
    """:func:`fibre_topk`'s torch selection for ``1 < k < n``, positions unordered.

    Long fibres use an exact two-stage search instead of one big sort. The
    fibre's positions are dealt into ``m`` strided groups of ``c`` elements;
    a group's score is its largest |x| (a vectorised max/min pass over the
    tensor that allocates nothing large). Only the ``k`` best-scoring groups
    can hold the fibre's top ``k``: a group holding one of them scores at
    least the k-th largest value, and at most ``k`` groups can. So the exact
    top-k runs on ``k * c`` candidates instead of ``n``, with ``c ~ sqrt(n / k)``
    (which balances the two top-k calls).
    """
    n = x.shape[1]
    c = min(_MAX_GROUP, int(math.sqrt(n / k)))
    if n < _MIN_TWO_STAGE or c < _MIN_GROUP:
        return largest_along_1(x.abs(), k)
    m = n // c
    lead, rest = x.shape[0], x.shape[2:]
    body = x.narrow(1, 0, c * m).view(lead, c, m, *rest)  # group j = positions j, j+m, ...
    # a group's score, max |x| over its c members, one slice at a time: two buffers of
    # 1/c of the tensor, where amax/amin over the strided axis measured slower
    score = body.select(1, 0).abs()
    scratch = torch.empty_like(score)
    for j in range(1, c):
        torch.maximum(score, torch.abs(body.select(1, j), out=scratch), out=score)
    groups = largest_along_1(score, k)  # [A, k, *rest]
    cand = body.gather(2, groups.unsqueeze(1).expand(lead, c, k, *rest)).view(lead, c * k, *rest)
    tail = n - c * m  # positions that fill no group are always candidates
    if tail:
        cand = torch.cat([cand, x.narrow(1, c * m, tail)], dim=1)
    best = largest_along_1(cand.abs_(), k)  # into [0, c*k + tail)
    row, col = best.div(k, rounding_mode="floor"), best.remainder(k)
    positions = row * m + groups.gather(1, col)
    if tail:
        positions = torch.where(best >= c * k, best - c * k + c * m, positions)
    return positions


def _kernel_applies(x: torch.Tensor) -> bool:
    """Whether the compiled kernel selects in ``x``: at every ``k``, so that every float32
    CPU selection follows the rule exactly, ties included, as the CUDA kernel's does."""
    return (_fibre is not None and x.device.type == "cpu" and x.dtype == torch.float32
            and x.is_contiguous())


def _kernel_topk(x: torch.Tensor, k: int) -> torch.Tensor:
    lead, n = x.shape[0], x.shape[1]
    rest = math.prod(x.shape[2:])
    out = torch.empty((lead, k, *x.shape[2:]), dtype=torch.int64)
    if out.numel():
        _fibre.fibre_topk(x.data_ptr(), lead, n, rest, k, out.data_ptr())
    return out


def fibre_topk_feedback(residual: torch.Tensor, grad: torch.Tensor, k: int, live_only: bool = False
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """Error feedback and selection in one pass over memory, or None where the kernel does not apply.

    ``residual += grad``; the positions of the ``k`` largest |residual| per
    fibre and their values are returned (as :func:`fibre_topk` selects and
    orders them), and those entries of ``residual``
    become zero (what was sent leaves the residual exactly). With
    ``live_only``, rows of the view (``residual[a]``) whose selection is all
    zeros are left out as the kernel writes them, and the third result lists
    the rows kept (None where every row is kept): what :func:`live_rows`
    finds, without another pass.
    """
    if not (k < residual.shape[1] and _kernel_applies(residual) and grad.is_contiguous()
            and (grad.shape, grad.dtype, grad.device) == (residual.shape, residual.dtype, residual.device)):
        return None
    lead, n = residual.shape[0], residual.shape[1]
    positions = torch.empty((lead, k, *residual.shape[2:]), dtype=torch.int64)
    values = torch.empty(positions.shape, dtype=residual.dtype)
    rows = torch.empty(lead, dtype=torch.int64) if live_only else None
    if positions.numel():
        written = _fibre.fibre_topk_feedback(residual.data_ptr(), grad.data_ptr(), lead, n,
                                             math.prod(residual.shape[2:]), k, positions.data_ptr(),
                                             values.data_ptr(), 0 if rows is None else rows.data_ptr())
        if written < lead:
            return positions[:written], values[:written], rows[:written]
    return positions, values, None


def global_topk(flat: torch.Tensor, k: int) -> torch.Tensor:
    """Flat positions of the ``k`` largest |flat| (exact, one global selection).

    A flat tensor is one long fibre, so the compiled kernel's group bound
    applies as it does to ADTopk's fibres (timings: docs/benchmark-compression.md);
    there the positions follow the fibre rule, as the fused error feedback
    path (``Compressor._coo_with_feedback``) writes them. Elsewhere they are
    unordered: a ``coo`` payload's positions need no order.
    """
    row = flat.view(1, -1)
    if k < flat.numel() and _kernel_applies(row):
        return _kernel_topk(row, k).view(-1)
    return flat.abs().topk(k, sorted=False).indices


def above(flat: torch.Tensor, threshold: float) -> torch.Tensor:
    """Flat positions where |flat| > threshold, and every NaN (top-k selects a NaN first too,
    so that a selection never hides one), without sorting."""
    return torch.nonzero(flat.abs().le(threshold).logical_not_()).view(-1)


def live_rows(values: torch.Tensor) -> torch.Tensor | None:
    """The rows of a fibre selection ``[A, k, *rest]`` holding a nonzero value (a NaN counts),
    or None where every row does. A dead unit's row selects only zeros, and leaving it out
    of the payload changes neither the sum nor the residual."""
    flat = values.flatten(1)
    if flat.shape[1] == 0:  # an empty axis selects nothing: no row to leave out
        return None
    live = flat.ne(0).any(1)
    if bool(live.all()):
        return None
    return live.nonzero().view(-1)


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether no entry of ``tensor`` is a NaN or an infinity.

    The selections above put a NaN or an infinity first, so a compressor asks
    this of the k values it selected; it costs a full read only where nothing
    else reads the tensor (dense, random-k). One aminmax pass (NaN propagates,
    an infinity is an extreme), where ``isfinite().all()`` builds a mask first.
    """
    if tensor.numel() == 0:
        return True
    lo, hi = torch.aminmax(tensor.detach())
    return math.isfinite(lo.item()) and math.isfinite(hi.item())


def trim(flat: torch.Tensor, positions: torch.Tensor, k: int) -> torch.Tensor:
    """Keep at most ``k`` of ``positions``, the ones with the largest |flat|."""
    if positions.numel() <= k:
        return positions
    best = flat[positions].abs().topk(k, sorted=False).indices
    return positions[best]
