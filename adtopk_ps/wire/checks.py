"""Checks on a payload that came from a peer: every header field and every buffer length
is checked before a tensor is built, and every position before the payload is used.

What a peer sends is not trusted: a bad field, a short frame or an index out of range
raises ``PayloadError`` naming what was wrong, never an allocation sized by the sender
or a write out of bounds.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch

from adtopk_ps.core.dtypes import FLOAT_DTYPES, INDEX_DTYPES, index_dtype
from adtopk_ps.core.payload import CODECS, Payload, PayloadError
from adtopk_ps.wire.frames import ROW_SETS, row_set_nbytes
from adtopk_ps.wire.schema import PAYLOAD_FIELDS as FIELDS
from adtopk_ps.wire.schema import REQUIRED as _REQUIRED

try:
    from adtopk_ps.wire import _positions
except ImportError:  # built without a C compiler: torch's and numpy's ops make the same checks
    _positions = None

_NEEDS = {"dense": (), "fibre": ("idtype", "view", "k"), "coo": ("idtype",), "seeded": ("seed",)}
_POPCOUNT = np.array([bin(b).count("1") for b in range(256)], dtype=np.uint8)


def payload_from_fields(fields: object, buffers: Sequence, max_numel: int = 1 << 31) -> Payload:
    """Rebuild a payload from untrusted header fields and buffers, checking every field
    before touching memory."""
    spec = _check_fields(fields, max_numel)
    has_indices = spec["codec"] in ("fibre", "coo")
    needs = 1 + has_indices + ("rows" in spec)
    if len(buffers) != needs:
        rows = " with a row set" if "rows" in spec else ""
        raise PayloadError(f"codec {spec['codec']!r}{rows} needs {needs} buffer(s), got {len(buffers)}")
    values = _from_buffer(buffers[0], spec["vdtype"], spec["count"], "values")
    indices = rows = None
    if has_indices:
        indices = _from_buffer(buffers[1], spec["idtype"], spec["count"], "indices")
    view = spec.get("view")
    if spec["codec"] == "fibre":
        carried = view[0]
        if "rows" in spec:
            carried = spec["rows"]
            rows = _rows_from_buffer(buffers[2], spec["rowset"], carried, view[0])
        vshape = (carried, spec["k"], *view[2:])
        values, indices = values.view(vshape), indices.view(vshape)
    payload = Payload(spec["codec"], tuple(spec["shape"]), spec["dtype"], values, indices,
                      tuple(view) if view is not None else None, spec.get("seed"), rows)
    check_positions(payload)
    return payload


def check_positions(payload: Payload) -> None:
    """Refuse positions outside the tensor, and a row set that is not increasing rows of
    the view (what a peer sent is not trusted)."""
    if payload.rows is not None:
        _check_rows(payload.rows, payload.view[0], payload.values.shape[0])
    if payload.indices is None or payload.indices.numel() == 0:
        return
    bound = payload.view[1] if payload.codec == "fibre" else payload.numel
    low, top, _ = _span(payload.indices)
    if low < 0 or top >= bound:
        raise PayloadError(f"index out of range: [{low}, {top}] not within [0, {bound})")


def _span(positions: torch.Tensor) -> tuple[int, int, bool]:
    """The lowest and highest of some positions (at least one), and whether they strictly
    increase along their flat order: in one compiled pass where the extension is built and
    they lie contiguous on the CPU, by torch's reductions elsewhere."""
    if _positions is not None and positions.device.type == "cpu" and positions.is_contiguous():
        return _positions.span(positions.data_ptr(), positions.element_size(), positions.numel())
    flat = positions.reshape(-1)
    if flat.element_size() < 4:  # torch has no min/max for uint16
        flat = flat.int()
    low, top = (int(v) for v in torch.aminmax(flat))
    return low, top, bool((flat[1:] > flat[:-1]).all())


def _from_buffer(buf, dtype: torch.dtype, count: int, what: str) -> torch.Tensor:
    mv = memoryview(buf)
    item = dtype.itemsize
    if mv.nbytes != count * item:
        raise PayloadError(
            f"{what} frame has {mv.nbytes} bytes, expected {count} x {item} = {count * item}"
        )
    if count == 0:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(bytearray(mv) if mv.readonly else mv, dtype=dtype)


def _rows_from_buffer(buf, row_set: str, live: int, lead: int) -> torch.Tensor:
    """The carried rows named by a row-set frame (checked against ``live`` and ``lead``)."""
    mv = memoryview(buf)
    want = row_set_nbytes(row_set, live, lead)
    if mv.nbytes != want:
        raise PayloadError(f"row set frame ({row_set}) has {mv.nbytes} bytes, expected {want} "
                           f"for {live} of {lead} rows")
    if row_set == "list":
        return _from_buffer(mv, index_dtype(lead), live, "row set").long()
    # counted before anything is unpacked: memory in proportion to the frame and to ``live``
    if _positions is not None:  # counted (out 0) before the rows are given memory
        rows = None
        named = _positions.bitmap_rows(mv, lead, 0, live)
        if named == live:
            rows = torch.empty(live, dtype=torch.int64)
            _positions.bitmap_rows(mv, lead, rows.data_ptr(), live)
    else:
        rows, named = _unpack_bitmap(np.frombuffer(mv, dtype=np.uint8), lead, live)
    if named < 0:
        raise PayloadError(f"row set bitmap sets bits past its {lead} rows")
    if named != live:
        raise PayloadError(f"row set bitmap names {named} rows, the metadata says {live}")
    return rows


def _unpack_bitmap(data: np.ndarray, lead: int, live: int) -> tuple[torch.Tensor | None, int]:
    """:func:`_rows_from_buffer`'s unpacking without the compiled extension: the rows a
    bitmap names and how many (-1: bits past ``lead``), the rows only if they are ``live``."""
    if lead % 8 and data[-1] >> (lead % 8):
        return None, -1
    named = int(_POPCOUNT[data].sum(dtype=np.int64))
    if named != live:
        return None, named
    full = np.flatnonzero(data)
    byte, bit = np.nonzero(np.unpackbits(data[full], bitorder="little").reshape(-1, 8))
    return torch.from_numpy(full[byte] * 8 + bit), named


def _check_rows(rows: torch.Tensor, lead: int, carried: int) -> None:
    if rows.dim() != 1 or rows.numel() != carried:
        raise PayloadError(f"row set of shape {tuple(rows.shape)} for {carried} carried rows")
    if carried >= lead:
        raise PayloadError(f"row set names {carried} of {lead} rows; a payload carrying every "
                           "row has no row set")
    if carried == 0:
        return
    low, top, ordered = _span(rows)
    if not ordered or low < 0 or top >= lead:
        raise PayloadError(f"row set must be increasing rows within [0, {lead}), got "
                           f"{rows[:8].tolist()}{' ...' if carried > 8 else ''}")


def _check_fields(meta: object, max_numel: int) -> dict:
    if not isinstance(meta, dict):
        raise PayloadError(f"metadata must be a map, got {type(meta).__name__}")
    unknown = meta.keys() - FIELDS.keys()
    if unknown:
        raise PayloadError(f"unknown metadata field(s) {sorted(map(str, unknown))}")
    for key, typ in FIELDS.items():
        if key not in meta:
            if key in _REQUIRED:
                raise PayloadError(f"metadata lacks field {key!r}")
            continue
        if not isinstance(meta[key], typ) or isinstance(meta[key], bool):
            raise PayloadError(f"metadata field {key!r} must be {typ.__name__}, got {meta[key]!r:.60}")
    spec = dict(meta)
    codec = spec["codec"]
    if codec not in CODECS:
        raise PayloadError(f"unknown codec {codec!r}; valid: {list(CODECS)}")
    spec["shape"] = _check_dims(spec["shape"], "shape")
    numel = math.prod(spec["shape"])
    if numel > max_numel:
        raise PayloadError(f"tensor of {numel} elements exceeds the limit of {max_numel}")
    for key, table in (("dtype", FLOAT_DTYPES), ("vdtype", FLOAT_DTYPES), ("idtype", INDEX_DTYPES)):
        if key in spec:
            if spec[key] not in table:
                raise PayloadError(f"{key} {spec[key]!r} not allowed; valid: {sorted(table)}")
            spec[key] = table[spec[key]]
    count = spec["count"]
    if count < 0 or count > numel:
        raise PayloadError(f"count {count} outside [0, {numel}]")
    for key in _NEEDS[codec]:
        if key not in spec:
            raise PayloadError(f"codec {codec!r} needs metadata field {key!r}")
    if codec == "dense" and count != numel:
        raise PayloadError(f"dense payload carries {count} values for {numel} elements")
    if codec == "fibre":
        view = spec["view"] = _check_dims(spec["view"], "view")
        if len(view) < 2 or math.prod(view) != numel:
            raise PayloadError(f"view {view} is not a >=2-D view of shape {spec['shape']}")
        k = spec["k"]
        if not 1 <= k <= view[1]:
            raise PayloadError(f"k {k} outside [1, {view[1]}]")
        carried = _check_row_fields(spec, view[0])
        if math.prod((carried, k, *view[2:])) != count:
            rows = f" and {carried} rows" if "rows" in spec else ""
            raise PayloadError(f"count {count} does not match view {view} with k={k}{rows}")
    elif "rows" in spec or "rowset" in spec:
        raise PayloadError(f"codec {codec!r} carries no row set; only 'fibre' does")
    if codec == "seeded" and spec["seed"] < 0:
        raise PayloadError(f"seed {spec['seed']} is negative")
    return spec


def _check_row_fields(spec: dict, lead: int) -> int:
    """How many rows a fibre payload carries: all of them, or its row set's."""
    if "rows" not in spec and "rowset" not in spec:
        return lead
    if "rows" not in spec or "rowset" not in spec:
        raise PayloadError("metadata fields 'rows' and 'rowset' come together")
    if spec["rowset"] not in ROW_SETS:
        raise PayloadError(f"rowset {spec['rowset']!r} not allowed; valid: {list(ROW_SETS)}")
    if not math.prod(spec["view"]):
        raise PayloadError(f"a row set for a view of no elements ({spec['view']})")
    if not 0 <= spec["rows"] < lead:
        raise PayloadError(f"rows {spec['rows']} outside [0, {lead}): a payload carrying every row "
                           "has no row set")
    return spec["rows"]


def _check_dims(dims: list, what: str) -> list:
    if len(dims) > 8:
        raise PayloadError(f"{what} has {len(dims)} dimensions; at most 8 are allowed")
    for d in dims:
        if not isinstance(d, int) or isinstance(d, bool) or d < 0:
            raise PayloadError(f"{what} {dims!r:.80} must be non-negative integers")
    return dims
