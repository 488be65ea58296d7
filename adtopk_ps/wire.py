"""The wire format: one zmq multipart message per request or reply.

Frame 0 is a msgpack header (protocol version, op, key, round, sender and,
for messages that carry a tensor, the payload's codec, dtype, shape and
counts); the frames after it are the raw little-endian value and index
buffers, sent without copies. No float data ever travels inside msgpack.

``decode`` validates the header schema, the dtypes, the frame lengths and
the index ranges before any tensor is built, and raises only ``WireError``.

A push may say ``nonfinite: true`` (its compressor saw a NaN or an infinity);
a result then lists, in ``nonfinite``, the ranks whose pushes of that round
said so, the same list to every worker.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import msgpack

from .compression.payload import Payload, PayloadError

#: 2: seeded (random-k) payloads draw their positions with compression/seeded.py's counter hash
PROTOCOL = 2

#: ops a header may name; ``TENSOR_OPS`` carry a payload.
TENSOR_OPS = frozenset({"push", "result"})
CONTROL_OPS = frozenset({
    "register", "addressbook", "barrier", "barrier_done", "heartbeat", "finish", "shutdown",
    "node_lost", "error",
})
OPS = TENSOR_OPS | CONTROL_OPS

_ENVELOPE = {"v": int, "op": str, "key": int, "round": int, "sender": int}
_PAYLOAD_FIELDS = ("codec", "shape", "dtype", "vdtype", "count", "idtype", "view", "k", "seed")
_MAX_RANKS = 1 << 16
DEFAULT_MAX_MESSAGE_BYTES = 1 << 30
_MAX_HEADER_BYTES = 1 << 16


class WireError(ValueError):
    """A message is malformed or hostile; the text says what was wrong."""


@dataclass
class Message:
    """One decoded message: its header fields, its payload if it carries a tensor, and any other header keys."""

    op: str
    key: int = 0
    round: int = 0
    sender: int = 0
    payload: Payload | None = None
    extra: dict = field(default_factory=dict)


def encode(op: str, key: int = 0, round: int = 0, sender: int = 0,
           payload: Payload | None = None, **extra) -> list:
    """Frames for one message: the header, then the payload's buffers (zero-copy views)."""
    header = {"v": PROTOCOL, "op": op, "key": key, "round": round, "sender": sender}
    clash = set(extra) & (set(header) | set(_PAYLOAD_FIELDS))
    if clash:
        raise ValueError(f"extra header fields {sorted(clash)} clash with reserved names")
    header.update(extra)
    if payload is None:
        return [msgpack.packb(header)]
    header.update(payload.meta())
    return [msgpack.packb(header), *payload.buffers()]


def decode(frames: Sequence, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
           max_numel: int = 1 << 31) -> Message:
    """Parse and check a message; raises ``WireError`` for anything malformed."""
    if not frames:
        raise WireError("empty message")
    sizes = [memoryview(f).nbytes for f in frames]
    if sum(sizes) > max_bytes:
        raise WireError(f"message of {sum(sizes)} bytes exceeds the limit of {max_bytes}")
    if sizes[0] > _MAX_HEADER_BYTES:
        raise WireError(f"header of {sizes[0]} bytes exceeds the limit of {_MAX_HEADER_BYTES}")
    try:
        header = msgpack.unpackb(bytes(frames[0]), strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types
        raise WireError(f"header is not valid msgpack: {exc}") from None
    if not isinstance(header, dict):
        raise WireError(f"header must be a map, got {type(header).__name__}")
    for name, typ in _ENVELOPE.items():
        value = header.get(name)
        if not isinstance(value, typ) or isinstance(value, bool):
            raise WireError(f"header field {name!r} must be {typ.__name__}, got {value!r:.60}")
    if header["v"] != PROTOCOL:
        raise WireError(f"protocol version {header['v']} is not supported (this side speaks {PROTOCOL})")
    op = header["op"]
    if op not in OPS:
        raise WireError(f"unknown op {op!r}; valid: {sorted(OPS)}")
    for name in ("key", "round", "sender"):
        if not 0 <= header[name] < 1 << 63:
            raise WireError(f"header field {name!r} = {header[name]} is out of range")
    payload = None
    if op in TENSOR_OPS:
        meta = {k: header.pop(k) for k in _PAYLOAD_FIELDS if k in header}
        try:
            payload = Payload.from_meta(meta, frames[1:], max_numel=max_numel)
        except PayloadError as exc:
            raise WireError(f"{op} for key {header['key']}: {exc}") from None
    elif len(frames) > 1:
        raise WireError(f"{op} carries no tensor, but {len(frames) - 1} data frame(s) came with it")
    extra = {k: v for k, v in header.items() if k not in _ENVELOPE}
    if "nonfinite" in extra:
        _check_nonfinite(op, extra["nonfinite"])
    return Message(op, header["key"], header["round"], header["sender"], payload, extra)


def _check_nonfinite(op: str, flag: object) -> None:
    """A push's flag is a bool; a result's, the flagging ranks in increasing order."""
    if op == "push":
        if not isinstance(flag, bool):
            raise WireError(f"push field 'nonfinite' must be a bool, got {flag!r:.60}")
    elif op == "result":
        if not isinstance(flag, list) or not 0 < len(flag) <= _MAX_RANKS or not all(
                type(r) is int and 0 <= r < _MAX_RANKS for r in flag) or flag != sorted(set(flag)):
            raise WireError(f"result field 'nonfinite' must list distinct worker ranks in "
                            f"increasing order, got {flag!r:.60}")
    else:
        raise WireError(f"{op} carries no 'nonfinite' field; only push and result do")


def envelope(frames: Sequence) -> tuple[int, int]:
    """Best-effort (key, round) of a message that ``decode`` refused, so the error reply
    reaches the push it is about (a message over the size limit still has a readable
    header); (0, 0) when even that cannot be read."""
    try:
        if memoryview(frames[0]).nbytes <= _MAX_HEADER_BYTES:
            header = msgpack.unpackb(bytes(frames[0]), strict_map_key=True)
            key, rnd = header["key"], header["round"]
            if all(type(v) is int and 0 <= v < 1 << 63 for v in (key, rnd)):
                return key, rnd
    except Exception:  # anything unreadable gets the default
        pass
    return 0, 0
