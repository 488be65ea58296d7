"""The compressed form of one tensor, and its exact byte encoding.

A payload is what a worker puts on the wire for one tensor: a small metadata
dict (sent as msgpack) plus raw little-endian buffers for values and indices.
Keeping the encoding here means ``Payload.nbytes`` is the real wire cost, and
the same ``accumulate_into`` serves decompression, error feedback and
server-side aggregation.
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field
from typing import Sequence

import msgpack
import torch

from .seeded import seeded_indices

#: Codecs a payload may carry.
#:  dense  - every element, in order
#:  fibre  - ``values``/``indices`` of shape ``[view[0], k, *view[2:]]``, indices
#:           are positions along axis 1 of ``view`` (ADTopk)
#:  coo    - flat positions into the tensor and their values
#:  seeded - values only; positions are regenerated from ``seed`` (random-k, see seeded.py)
CODECS = ("dense", "fibre", "coo", "seeded")

#: dtypes allowed on the wire, by name.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}
INDEX_DTYPES: dict[str, torch.dtype] = {
    "uint8": torch.uint8,
    "uint16": torch.uint16,
    "int32": torch.int32,
    "int64": torch.int64,
}
_NAME_OF = {v: k for k, v in {**DTYPES, **INDEX_DTYPES}.items()}


class PayloadError(ValueError):
    """A payload (or its frames) is malformed; the message says how."""


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of ``dtype``; a dtype the wire does not carry raises ``PayloadError``."""
    try:
        return _NAME_OF[dtype]
    except KeyError:
        raise PayloadError(f"dtype {dtype} is not supported; valid: {sorted(DTYPES)}") from None


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


def seed_for(name: str, step: int, base: int = 0) -> int:
    """A seed that every process derives identically from a tensor name and step."""
    return (zlib.crc32(f"{name}:{step}".encode()) ^ (base * 0x9E3779B1)) & 0x7FFFFFFF


@dataclass
class Payload:
    """One compressed tensor: its codec, shape and dtype, and the value (and index) buffers that go on the wire."""

    codec: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    values: torch.Tensor
    indices: torch.Tensor | None = None
    view: tuple[int, ...] | None = None
    seed: int | None = None
    # the compressor saw a NaN or an infinity in its input (not part of the encoding: a push
    # carries it as a header flag)
    nonfinite: bool = field(default=False, compare=False)
    # values and indices already copied to host memory (the CUDA kernel's pinned buffer), which
    # buffers() hands out instead of staging them again
    host: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, compare=False, repr=False)

    @property
    def numel(self) -> int:
        """Elements of the tensor the payload stands for (not of what it carries)."""
        return math.prod(self.shape)

    @property
    def count(self) -> int:
        """Number of values carried."""
        return self.values.numel()

    def meta(self) -> dict:
        """The msgpack-able description of this payload (no tensor data)."""
        meta: dict = {
            "codec": self.codec,
            "shape": list(self.shape),
            "dtype": dtype_name(self.dtype),
            "vdtype": dtype_name(self.values.dtype),
            "count": self.count,
        }
        if self.indices is not None:
            meta["idtype"] = dtype_name(self.indices.dtype)
        if self.view is not None:
            meta["view"] = list(self.view)
            meta["k"] = self.values.shape[1]
        if self.seed is not None:
            meta["seed"] = self.seed
        return meta

    @property
    def nbytes(self) -> int:
        """Exact bytes this payload puts on the wire: metadata + values + indices."""
        size = len(msgpack.packb(self.meta())) + _buffer_nbytes(self.values)
        if self.indices is not None:
            size += _buffer_nbytes(self.indices)
        return size

    def frames(self) -> list:
        """Metadata then raw buffers, ready for a zmq multipart send."""
        return [msgpack.packb(self.meta()), *self.buffers()]

    def buffers(self) -> list:
        """The values, then the indices if any, as zero-copy buffers."""
        if self.host is not None:
            return [_as_buffer(t) for t in self.host]
        if self.indices is None:
            return [_as_buffer(self.values)]
        return [_as_buffer(self.values), _as_buffer(self.indices)]

    @classmethod
    def from_frames(cls, frames: Sequence, max_numel: int = 1 << 31) -> "Payload":
        """Rebuild a payload from :meth:`frames`, validating before touching memory."""
        if len(frames) < 2:
            raise PayloadError(f"expected at least 2 frames (meta, values), got {len(frames)}")
        try:
            meta = msgpack.unpackb(bytes(frames[0]))
        except Exception as exc:  # msgpack raises several unrelated types
            raise PayloadError(f"metadata frame is not msgpack: {exc}") from None
        return cls.from_meta(meta, frames[1:], max_numel=max_numel)

    @classmethod
    def from_meta(cls, meta: object, buffers: Sequence, max_numel: int = 1 << 31) -> "Payload":
        """Rebuild a payload from untrusted metadata and buffers, checking every field before touching memory."""
        spec = _check_meta(meta, max_numel)
        has_indices = spec["codec"] in ("fibre", "coo")
        if len(buffers) != 1 + has_indices:
            raise PayloadError(
                f"codec {spec['codec']!r} needs {1 + has_indices} buffer(s), got {len(buffers)}"
            )
        values = _from_buffer(buffers[0], spec["vdtype"], spec["count"], "values")
        indices = None
        if has_indices:
            indices = _from_buffer(buffers[1], spec["idtype"], spec["count"], "indices")
        view = spec.get("view")
        if spec["codec"] == "fibre":
            vshape = (view[0], spec["k"], *view[2:])
            values, indices = values.view(vshape), indices.view(vshape)
        payload = cls(spec["codec"], tuple(spec["shape"]), spec["dtype"], values, indices,
                      tuple(view) if view is not None else None, spec.get("seed"))
        payload.check_indices()
        return payload

    def check_indices(self) -> None:
        """Refuse positions outside the tensor (what a peer sent is not trusted)."""
        if self.indices is None or self.indices.numel() == 0:
            return
        bound = self.view[1] if self.codec == "fibre" else self.numel
        idx = self.indices
        if idx.element_size() < 4:  # torch has no min/max for uint16
            idx = idx.int()
        low, top = (int(v) for v in torch.aminmax(idx))
        if low < 0 or top >= bound:
            raise PayloadError(f"index out of range: [{low}, {top}] not within [0, {bound})")

    def positions(self) -> torch.Tensor:
        """Flat or axis-1 positions as int64, ready for scatter."""
        if self.codec == "seeded":
            return seeded_indices(self.seed, self.numel, self.count, self.values.device)
        return self.indices.long()

    def flat_positions(self) -> torch.Tensor:
        """Positions into the flattened tensor (fibre payloads carry axis-1 ones)."""
        if self.codec == "dense":
            raise PayloadError("a dense payload has no positions")
        pos = self.positions()
        if self.codec != "fibre":
            return pos.view(-1)
        lead, n, rest = self.view[0], self.view[1], math.prod(self.view[2:])
        row = torch.arange(lead, device=pos.device).view(lead, 1, 1) * (n * rest)
        col = torch.arange(rest, device=pos.device).view(1, 1, rest)
        return (row + pos.reshape(lead, -1, rest) * rest + col).view(-1)

    def accumulate_into(self, out: torch.Tensor, alpha: float = 1.0, divisor: int = 1) -> torch.Tensor:
        """``out += alpha * decompress(self) / divisor`` in place, without a dense expansion.

        Sparse values are scaled before they land, so averaging costs ``count``
        divisions instead of a pass over ``out``; a dense tensor divided after
        the fact gets the same bits, as every position receives one value.
        """
        self._check_target(out)
        vals = self.values.to(device=out.device, dtype=out.dtype)
        if alpha != 1.0:
            vals = vals * alpha
        if divisor != 1:
            vals = vals / divisor
        if self.codec == "dense":
            out.add_(vals.view(self.shape))
        elif self.codec == "fibre":
            out.view(self.view).scatter_add_(1, self.positions().to(out.device), vals)
        else:
            out.view(-1).scatter_add_(0, self.positions().to(out.device), vals)
        return out

    def write_into(self, out: torch.Tensor, divisor: int = 1) -> torch.Tensor:
        """``out[:] = decompress(self) / divisor``, on ``out``'s device, in one pass for dense payloads."""
        self._check_target(out)
        if self.codec != "dense":
            return self.accumulate_into(out.zero_(), divisor=divisor)
        vals = self.values.view(self.shape)
        if divisor == 1:
            return out.copy_(vals)
        if vals.dtype == out.dtype and vals.device == out.device:
            return torch.div(vals, divisor, out=out)
        return out.copy_(vals).div_(divisor)

    def _check_target(self, out: torch.Tensor) -> None:
        if tuple(out.shape) != self.shape:
            raise PayloadError(f"payload shape {self.shape} does not match buffer {tuple(out.shape)}")

    def decompress(self) -> torch.Tensor:
        """The dense tensor: zeros with the sent entries in place."""
        out = torch.empty(self.shape, dtype=self.dtype, device=self.values.device)
        return self.write_into(out)


def _buffer_nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _as_buffer(t: torch.Tensor) -> memoryview:
    """Zero-copy view of a tensor's bytes; a GPU tensor is staged once in pinned memory."""
    t = t.detach()
    if t.device.type != "cpu":
        staging = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.device.type == "cuda")
        t = staging.copy_(t)
    t = t.contiguous().view(-1)
    return memoryview(t.view(torch.uint8).numpy())


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


_REQUIRED = {"codec": str, "shape": list, "dtype": str, "vdtype": str, "count": int}
_OPTIONAL = {"idtype": str, "view": list, "k": int, "seed": int}
_FIELDS = {**_REQUIRED, **_OPTIONAL}
_NEEDS = {"dense": (), "fibre": ("idtype", "view", "k"), "coo": ("idtype",), "seeded": ("seed",)}


def _check_meta(meta: object, max_numel: int) -> dict:
    if not isinstance(meta, dict):
        raise PayloadError(f"metadata must be a map, got {type(meta).__name__}")
    unknown = meta.keys() - _FIELDS.keys()
    if unknown:
        raise PayloadError(f"unknown metadata field(s) {sorted(map(str, unknown))}")
    for key, typ in _FIELDS.items():
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
    for key, table in (("dtype", DTYPES), ("vdtype", DTYPES), ("idtype", INDEX_DTYPES)):
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
        if math.prod((view[0], k, *view[2:])) != count:
            raise PayloadError(f"count {count} does not match view {view} with k={k}")
    if codec == "seeded" and spec["seed"] < 0:
        raise PayloadError(f"seed {spec['seed']} is negative")
    return spec


def _check_dims(dims: list, what: str) -> list:
    if len(dims) > 8:
        raise PayloadError(f"{what} has {len(dims)} dimensions; at most 8 are allowed")
    for d in dims:
        if not isinstance(d, int) or isinstance(d, bool) or d < 0:
            raise PayloadError(f"{what} {dims!r:.80} must be non-negative integers")
    return dims
