"""Messages: one zmq multipart message per request or reply.

Frame 0 is a msgpack header: the envelope (protocol version, op, key, round,
sender), then, for an op that carries a tensor, the payload's fields
(frames.py), then any other fields the op has; the frames after it are the
payload's buffers. ``decode`` checks the envelope and, with checks.py, the
payload before any tensor is built, and raises only ``WireError``.

A push may say ``nonfinite: true`` (its compressor saw a NaN or an infinity);
a result then lists, in ``nonfinite``, the ranks whose pushes of that round
said so, the same list to every worker. A push may ask for a receipt (``ack: true``):
the server sends ``received`` with its key and round as soon as it has taken it in.

A server that re-sparsifies its answers keeps a residual per sparse key, which a
checkpoint must hold as a worker's residuals are: ``fetch`` asks for a key's residual as
of its round, and the server answers ``residual`` with the tensor (none where it holds
none); a ``residual`` from a worker puts one back before the key's round completes.
A ``batch`` carries several messages to one peer in one (``counts``: each message's frames,
in order), so that a step's many small keys cost one send and one receive, not one each;
each message in it is decoded and checked on its own. A server answers in batches only a
peer that sends them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Sequence

import msgpack

from adtopk_ps.wire.schema import PAYLOAD_FIELDS as _PAYLOAD_FIELDS

if TYPE_CHECKING:
    from adtopk_ps.core.payload import Payload

#: 2: seeded (random-k) payloads draw their positions with core/seeded.py's counter hash
#: 3: fibre payloads may leave out rows that selected only zeros (``rows``, ``rowset`` and a
#:    third frame naming the rows carried; see frames.py)
#: 4: collectives agreed at the scheduler (negotiate, agreed, blocked, standin); register
#:    carries the cluster's shape
#: 5: a push may ask for a receipt (``ack: true``, a worker's credit window); the server
#:    then sends ``received`` for it before any answer
#: 6: fetch and residual: a re-sparsifying server's residuals into and out of checkpoints
#: 7: batch: several messages to one peer in one
#: 8: agreed lists each distinct ``own`` part once (``owns``), each rank's ``own`` its index
PROTOCOL = 8
MAX_BATCH = 4096  # messages in one batch (their counts fit the header's limit)


class Op(str, Enum):
    """What a message asks or tells; it travels as its value, a plain msgpack string."""

    PUSH = "push"  # worker -> server: one key's payload for one round
    RESULT = "result"  # server -> worker: the round's sum
    RECEIVED = "received"  # server -> worker: a push that asked (``ack``) has arrived
    REGISTER = "register"  # node -> scheduler: who it is and where it listens
    ADDRESSBOOK = "addressbook"  # scheduler -> node: its rank and the servers' addresses
    NEGOTIATE = "negotiate"  # worker -> scheduler: request ``round`` for a collective, by name
    AGREED = "agreed"  # scheduler -> worker: request ``round`` agreed (or refused, and why)
    BLOCKED = "blocked"  # worker -> scheduler: it now waits for request ``round`` (or no longer)
    STANDIN = "standin"  # scheduler -> joined worker: push zeros for this agreed sum
    STALL = "stall"  # server -> waiting workers and scheduler: rounds wait for these workers
    HEARTBEAT = "heartbeat"  # node <-> scheduler: still here (and, before the start, who is)
    FINISH = "finish"  # worker -> scheduler and servers: no push of its is left to come
    SHUTDOWN = "shutdown"  # scheduler -> node: the job is over
    NODE_LOST = "node_lost"  # scheduler -> node: a peer was lost; the job ends
    # scheduler -> node: the workers changed (elastic): the new epoch, this node's rank, the
    # number of workers and the servers; pushes and answers then carry the epoch
    RESHAPE = "reshape"
    ERROR = "error"  # any -> sender: what it sent was refused, and why
    FETCH = "fetch"  # worker -> server: the residual of ``key`` as of ``round``, for a checkpoint
    # server -> worker: the residual fetched (no tensor: none held); worker -> server: one to
    # put back before ``round`` of ``key`` completes (a resumed checkpoint's)
    RESIDUAL = "residual"
    BATCH = "batch"  # either way: several messages to one peer, their frames one after another

    def __str__(self) -> str:
        return self.value


#: ops that carry a payload
TENSOR_OPS = frozenset({Op.PUSH, Op.RESULT})
#: ops that carry one when their header describes it (``codec`` and the other payload fields)
MAYBE_TENSOR_OPS = frozenset({Op.RESIDUAL})
_VALID = sorted(op.value for op in Op)

_ENVELOPE = {"v": int, "op": str, "key": int, "round": int, "sender": int}
_MAX_RANKS = 1 << 16
DEFAULT_MAX_MESSAGE_BYTES = 1 << 30
_MAX_HEADER_BYTES = 1 << 16


class WireError(ValueError):
    """A message is malformed or hostile; the text says what was wrong."""


@dataclass
class Message:
    """One decoded message: its header fields, its payload if it carries a tensor, and any other header keys."""

    op: Op
    key: int = 0
    round: int = 0
    sender: int = 0
    payload: Payload | None = None
    extra: dict = field(default_factory=dict)


def encode(op: Op, key: int = 0, round: int = 0, sender: int = 0,
           payload: Payload | None = None, **extra) -> list:
    """Frames for one message: the header, then the payload's buffers (zero-copy views)."""
    header = {"v": PROTOCOL, "op": Op(op).value, "key": key, "round": round, "sender": sender}
    clash = set(extra) & (set(header) | set(_PAYLOAD_FIELDS))
    if clash:
        raise ValueError(f"extra header fields {sorted(clash)} clash with reserved names")
    header.update(extra)
    if payload is None:
        return [msgpack.packb(header)]
    from adtopk_ps.wire.frames import payload_buffers, payload_fields  # torch's, when a tensor goes
    header.update(payload_fields(payload))
    return [msgpack.packb(header), *payload_buffers(payload)]


def decode(frames: Sequence, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
           max_numel: int = 1 << 31, tensors: bool = True) -> Message:
    """Parse and check a message; raises ``WireError`` for anything malformed.

    ``tensors=False`` (the scheduler): a message carrying a tensor is refused before any of
    it is read, so that a stray push costs a node that never takes one neither the payload's
    checks nor torch's import."""
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
    try:
        op = Op(header["op"])
    except ValueError:
        raise WireError(f"unknown op {header['op']!r}; valid: {_VALID}") from None
    for name in ("key", "round", "sender"):
        if not 0 <= header[name] < 1 << 63:
            raise WireError(f"header field {name!r} = {header[name]} is out of range")
    payload = None
    carries = op in TENSOR_OPS or (op in MAYBE_TENSOR_OPS and "codec" in header)
    if carries and not tensors:
        raise WireError(f"{op} carries a tensor, which this node never takes")
    if carries:
        meta = {k: header.pop(k) for k in _PAYLOAD_FIELDS if k in header}
        from adtopk_ps.core.payload import PayloadError  # torch's, when a tensor comes
        from adtopk_ps.wire.checks import payload_from_fields
        try:
            payload = payload_from_fields(meta, frames[1:], max_numel=max_numel)
        except PayloadError as exc:
            raise WireError(f"{op} for key {header['key']}: {exc}") from None
    elif op == Op.BATCH:
        counts = header.get("counts")
        if not isinstance(counts, list) or not 0 < len(counts) <= MAX_BATCH or not all(
                type(c) is int and c > 0 for c in counts) or sum(counts) != len(frames) - 1:
            raise WireError(f"batch field 'counts' must list up to {MAX_BATCH} positive frame "
                            f"counts adding up to the {len(frames) - 1} frame(s) that follow, "
                            f"got {counts!r:.60}")
    elif len(frames) > 1:
        raise WireError(f"{op} carries no tensor, but {len(frames) - 1} data frame(s) came with it")
    extra = {k: v for k, v in header.items() if k not in _ENVELOPE}
    if "nonfinite" in extra:
        _check_nonfinite(op, extra["nonfinite"])
    if "ack" in extra and (op != Op.PUSH or type(extra["ack"]) is not bool):
        raise WireError(f"field 'ack' must be a bool on a push, got {extra['ack']!r:.60} on {op}")
    if "epoch" in extra and not (type(extra["epoch"]) is int and 0 < extra["epoch"] < 1 << 31):
        raise WireError(f"field 'epoch' must be a positive int, got {extra['epoch']!r:.60}")
    return Message(op, header["key"], header["round"], header["sender"], payload, extra)


def _check_nonfinite(op: Op, flag: object) -> None:
    """A push's flag is a bool; a result's, the flagging ranks in increasing order."""
    if op == Op.PUSH:
        if not isinstance(flag, bool):
            raise WireError(f"push field 'nonfinite' must be a bool, got {flag!r:.60}")
    elif op == Op.RESULT:
        if not isinstance(flag, list) or not 0 < len(flag) <= _MAX_RANKS or not all(
                type(r) is int and 0 <= r < _MAX_RANKS for r in flag) or flag != sorted(set(flag)):
            raise WireError(f"result field 'nonfinite' must list distinct worker ranks in "
                            f"increasing order, got {flag!r:.60}")
    else:
        raise WireError(f"{op} carries no 'nonfinite' field; only push and result do")


def batch(messages: list[list]) -> list:
    """Frames for one ``batch`` of ``messages`` (each a message's frames, as :func:`encode`
    makes them), in order.

    Example::

        send(sock, wire.batch([wire.encode(Op.PUSH, key=1, payload=p), wire.encode(Op.PUSH, key=2, payload=q)]))
    """
    header = msgpack.packb({"v": PROTOCOL, "op": Op.BATCH.value, "key": 0, "round": 0,
                            "sender": 0, "counts": [len(m) for m in messages]})
    return [header, *(f for m in messages for f in m)]


def unbatch(frames: Sequence, msg: Message) -> list[list]:
    """The messages of a ``batch`` that :func:`decode` returned as ``msg``, each as its frames,
    to be decoded on its own (where one is a batch again, its receiver refuses it: batches
    do not nest)."""
    out, at = [], 1
    for count in msg.extra["counts"]:
        out.append(list(frames[at:at + count]))
        at += count
    return out


def epoch_field(epoch: int) -> dict:
    """The header field that tags a message with an elastic job's membership: none before
    any re-form (epoch 0), so that a job that never re-forms sends what it always sent.

    Example::

        wire.encode(Op.PUSH, key=7, payload=p, **wire.epoch_field(engine.epoch))
    """
    return {"epoch": epoch} if epoch else {}


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
