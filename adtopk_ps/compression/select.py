"""Selection kernels: which entries of a gradient to keep.

All kernels compare magnitudes |g|, run on the tensor's own device, and
return int64 positions (callers narrow the type for the wire).
"""
from __future__ import annotations

import math

import torch

# Below this many chunks per fibre the two-stage search does not pay off.
_MIN_CHUNKS = 4


def fibre_topk(x: torch.Tensor, k: int) -> torch.Tensor:
    """Positions along axis 1 of the ``k`` largest |x| in every fibre ``x[i, :, j...]``.

    ``x`` has shape ``[A, n, *rest]``; the result ``[A, k, *rest]``.

    Long fibres use an exact two-stage search instead of one big sort. The
    fibre's ``n`` positions are dealt into ``m`` strided groups of ``c``
    elements; a group's score is its largest |x| (one vectorised pass over
    the tensor, no |x| copy). Only the ``k`` best-scoring groups can hold the
    fibre's top ``k``: a group holding one of them scores at least the k-th
    largest value, and at most ``k`` groups can. So the exact top-k runs on
    ``k * c`` candidates instead of ``n``, with ``c ~ sqrt(n / k)``.
    """
    n = x.shape[1]
    if k >= n:
        shape = [1] * x.dim()
        shape[1] = n
        return torch.arange(n, device=x.device).view(shape).expand(x.shape).contiguous()
    if k == 1:  # largest |x| is the max or the min: two reads, no |x| copy
        hi, at_hi = x.max(dim=1, keepdim=True)
        lo, at_lo = x.min(dim=1, keepdim=True)
        return torch.where(hi >= lo.neg(), at_hi, at_lo)
    c = int(math.sqrt(n / k))
    if c < _MIN_CHUNKS:
        return x.abs().topk(k, dim=1, sorted=False).indices
    m = n // c
    rest = x.shape[2:]
    lead = x.shape[0]
    body = x.narrow(1, 0, c * m).view(lead, c, m, *rest)
    score = torch.maximum(body.amax(dim=1), body.amin(dim=1).neg_())
    groups = score.topk(k, dim=1, sorted=False).indices  # [A, k, *rest]
    offsets = torch.arange(0, c * m, m, device=x.device).view(1, c, 1, *([1] * len(rest)))
    cand = (groups.unsqueeze(1) + offsets).view(lead, c * k, *rest)
    if c * m < n:  # the tail that did not fill a group is always a candidate
        tail = torch.arange(c * m, n, device=x.device).view(1, n - c * m, *([1] * len(rest)))
        cand = torch.cat([cand, tail.expand(lead, -1, *rest)], dim=1)
    best = x.gather(1, cand).abs_().topk(k, dim=1, sorted=False).indices
    return cand.gather(1, best)


def global_topk(flat: torch.Tensor, k: int) -> torch.Tensor:
    """Flat positions of the ``k`` largest |flat| (exact, one global selection)."""
    return flat.abs().topk(k, sorted=False).indices


def above(flat: torch.Tensor, threshold: float) -> torch.Tensor:
    """Flat positions where |flat| > threshold, without sorting."""
    return torch.nonzero(flat.abs() > threshold).view(-1)


def trim(flat: torch.Tensor, positions: torch.Tensor, k: int) -> torch.Tensor:
    """Keep at most ``k`` of ``positions``, the ones with the largest |flat|."""
    if positions.numel() <= k:
        return positions
    best = flat[positions].abs().topk(k, sorted=False).indices
    return positions[best]
