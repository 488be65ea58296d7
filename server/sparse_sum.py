"""Sparse pushes summed in time proportional to what was pushed (the compiled _sparse_sum.c).

The aggregator's torch path does the same with a sort for the union of
positions and several indexing passes; this path lists each position as it
first lands and reads the answer back from that list, in ascending position
order as the torch path's union is (a worker's decode then writes its partition
front to back rather than at random). It applies to float32 buffers and values
on the CPU, which is what a server holds unless workers send other dtypes.
"""
from __future__ import annotations

import math

import torch

from adtopk_ps.core.dtypes import INDEX_DTYPES
from adtopk_ps.core.payload import Payload

try:
    from . import _sparse_sum
except ImportError:  # built without a C compiler: the aggregator's torch path does the work
    _sparse_sum = None


def applies_to(buffer: torch.Tensor) -> bool:
    """Whether this path can sum into ``buffer`` (and take its sums back)."""
    # (an extension built from an older source lacks the function: the torch path serves)
    return (hasattr(_sparse_sum, "take_nonzero") and buffer.dtype == torch.float32
            and buffer.device.type == "cpu" and buffer.is_contiguous())


def applies(payload: Payload, buffer: torch.Tensor) -> bool:
    """Whether this path can add ``payload`` into ``buffer``."""
    values, indices, rows = payload.values, payload.indices, payload.rows
    return (applies_to(buffer) and payload.codec in ("fibre", "coo") and values.dtype == torch.float32
            and values.device.type == "cpu" and values.is_contiguous()
            and indices.dtype in INDEX_DTYPES.values() and indices.is_contiguous()
            and (rows is None or (rows.dtype == torch.int64 and rows.device.type == "cpu"
                                  and rows.is_contiguous())))


def add(buffer: torch.Tensor, payload: Payload) -> torch.Tensor:
    """``buffer += decompress(payload)``; returns the flat positions that were zero before.
    A fibre payload's rows are all of the view's, or those its row set names."""
    if payload.codec == "fibre":
        view = payload.view
        lead, n, rest, k = payload.values.shape[0], view[1], math.prod(view[2:]), payload.values.shape[1]
    else:
        lead, n, rest, k = 1, buffer.numel(), 1, payload.count
    if payload.count == 0:  # nothing lands (an empty row set has no memory to point at)
        return torch.empty(0, dtype=torch.int64)
    rows = 0 if payload.rows is None else payload.rows.data_ptr()
    fresh = torch.empty(payload.count, dtype=torch.int64)
    count = _sparse_sum.add(buffer.data_ptr(), buffer.numel(), payload.indices.data_ptr(),
                            payload.indices.element_size(), lead, n, rest, k,
                            payload.values.data_ptr(), fresh.data_ptr(), rows)
    return fresh[:count]


def take_nonzero(buffer: torch.Tensor, listed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The nonzero entries of ``buffer`` at ``listed`` positions (positions, values), zeroed;
    the positions ascend and none is repeated, whatever the order of ``listed``.

    Example::

        buf = torch.tensor([0.0, 2.0, 0.0, 5.0])
        take_nonzero(buf, torch.tensor([3, 1, 3, 2]))  # (tensor([1, 3]), tensor([2., 5.])); buf is zeros
    """
    listed = listed.contiguous()
    positions = torch.empty(listed.numel(), dtype=torch.int64)
    values = torch.empty(listed.numel(), dtype=buffer.dtype)
    count = _sparse_sum.take_nonzero(buffer.data_ptr(), buffer.numel(), listed.data_ptr(), listed.numel(),
                              positions.data_ptr(), values.data_ptr())
    return positions[:count], values[:count]
