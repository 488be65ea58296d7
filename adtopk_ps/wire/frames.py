"""How a payload goes on the wire: its fields in the message header, then raw buffers.

The header fields describe the payload (codec, shapes, dtypes by their wire names,
counts); the frames after the header are the values, the indices if any and, for a
fibre payload that leaves out rows, the set of rows it carries. Buffers are
little-endian and sent without copies; no float data travels inside msgpack.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import msgpack
import numpy as np
import torch

from adtopk_ps.core.dtypes import WIRE_DTYPES, index_dtype, wire_name
from adtopk_ps.core.payload import PayloadError

if TYPE_CHECKING:
    from adtopk_ps.core.payload import Payload

#: How a fibre payload's third frame names the rows it carries, whichever is smaller:
#:  bitmap - ceil(view[0] / 8) bytes, row r at bit r % 8 (least significant first) of
#:           byte r // 8; the bits past view[0] are zero
#:  list   - the rows in increasing order, in ``index_dtype(view[0])``
ROW_SETS = ("bitmap", "list")


def _name(dtype: torch.dtype) -> str:
    name = wire_name(dtype)
    if name is None:
        raise PayloadError(f"dtype {dtype} is not supported; valid: {sorted(WIRE_DTYPES)}")
    return name


def payload_fields(payload: Payload) -> dict:
    """The header fields that describe ``payload`` (no tensor data)."""
    fields: dict = {
        "codec": payload.codec,
        "shape": list(payload.shape),
        "dtype": _name(payload.dtype),
        "vdtype": _name(payload.values.dtype),
        "count": payload.count,
    }
    if payload.indices is not None:
        fields["idtype"] = _name(payload.indices.dtype)
    if payload.view is not None:
        fields["view"] = list(payload.view)
        fields["k"] = payload.values.shape[1]
    if payload.rows is not None:
        fields["rows"] = payload.rows.numel()
        fields["rowset"] = row_set(payload)
    if payload.seed is not None:
        fields["seed"] = payload.seed
    return fields


def payload_buffers(payload: Payload) -> list:
    """The values, then the indices if any, as zero-copy buffers, then the row set if any."""
    if payload.host is not None:
        data = list(payload.host)
    elif payload.indices is None:
        data = [payload.values]
    else:
        data = [payload.values, payload.indices]
    buffers = [_as_buffer(t) for t in data]
    if payload.rows is not None:
        buffers.append(_row_frame(payload))
    return buffers


def payload_nbytes(payload: Payload) -> int:
    """Bytes ``payload`` puts on the wire: its header fields packed alone, and its buffers."""
    size = len(msgpack.packb(payload_fields(payload))) + _tensor_nbytes(payload.values)
    if payload.indices is not None:
        size += _tensor_nbytes(payload.indices)
    if payload.rows is not None:
        size += row_set_nbytes(row_set(payload), payload.rows.numel(), payload.view[0])
    return size


def row_set(payload: Payload) -> str:
    """The smaller encoding of a fibre payload's ``rows`` (the bitmap on a tie)."""
    live, lead = payload.rows.numel(), payload.view[0]
    smaller = row_set_nbytes("list", live, lead) < row_set_nbytes("bitmap", live, lead)
    return "list" if smaller else "bitmap"


def row_set_nbytes(kind: str, live: int, lead: int) -> int:
    """Bytes of a row-set frame naming ``live`` of ``lead`` rows as a ``kind`` (see ``ROW_SETS``)."""
    if kind == "bitmap":
        return (lead + 7) // 8
    return live * index_dtype(lead).itemsize


def _row_frame(payload: Payload) -> memoryview:
    rows, lead = payload.rows.cpu(), payload.view[0]
    if row_set(payload) == "list":
        return _as_buffer(rows.to(index_dtype(lead)))
    mask = np.zeros(lead, dtype=bool)
    mask[rows.numpy()] = True
    return memoryview(np.packbits(mask, bitorder="little"))


def _tensor_nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _as_buffer(t: torch.Tensor) -> memoryview:
    """Zero-copy view of a tensor's bytes; a GPU tensor is staged once in pinned memory."""
    t = t.detach()
    if t.device.type != "cpu":
        staging = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.device.type == "cuda")
        t = staging.copy_(t)
    t = t.contiguous().view(-1)
    return memoryview(t.view(torch.uint8).numpy())
