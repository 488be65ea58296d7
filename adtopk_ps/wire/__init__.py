"""The wire format: what nodes send each other, and the checks on what they receive.

- messages.py: the ops (``Op``), ``encode`` and ``decode`` of one message (a msgpack
  header, then raw buffers), the envelope every message has, and ``batch``/``unbatch``,
  several messages to one peer in one.
- frames.py: how a compressed tensor (core/payload.py's ``Payload``) goes into
  a message: its header fields and its zero-copy buffers, and ``payload_nbytes``, the
  exact bytes they come to.
- checks.py: the checks on a payload from a peer, made before any tensor is built.

Example::

    from adtopk_ps import wire
    frames = wire.encode(wire.Op.PUSH, key=7, round=0, sender=1, payload=payload)
    msg = wire.decode(frames)          # raises wire.WireError for anything malformed
    assert msg.op == wire.Op.PUSH and msg.payload.shape == payload.shape
    wire.payload_nbytes(payload)       # the payload's share of the frames' bytes
"""
from adtopk_ps.wire.messages import (DEFAULT_MAX_MESSAGE_BYTES, MAX_BATCH, PROTOCOL, TENSOR_OPS,
                                     Message, Op,
                                     WireError, batch, decode, encode, envelope, epoch_field,
                                     unbatch)


def __getattr__(name: str):
    """``payload_nbytes`` on first use: frames.py needs torch, which the scheduler never imports."""
    if name == "payload_nbytes":
        from adtopk_ps.wire.frames import payload_nbytes
        return payload_nbytes
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["DEFAULT_MAX_MESSAGE_BYTES", "MAX_BATCH", "PROTOCOL", "TENSOR_OPS", "Message", "Op", "WireError",
           "batch", "decode", "encode", "envelope", "epoch_field", "payload_nbytes", "unbatch"]
