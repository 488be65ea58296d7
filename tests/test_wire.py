"""The wire decoder: round trips, named errors, and fuzzing with random and mutated frames."""
import subprocess
import sys

import msgpack
import pytest
import torch
from hypothesis import given, strategies as st

from adtopk_ps import wire
from adtopk_ps.compression import create


def _push(name="adtopk", shape=(8, 50)):
    params = {} if name == "none" else {"ratio": 0.1}
    p = create(name, **params).compress(torch.randn(shape), "w", 2)
    return p, [bytes(f) for f in wire.encode(wire.Op.PUSH, key=(3 << 16) + 1, round=7, sender=1, payload=p)]


@pytest.mark.parametrize("name", ["none", "topk", "adtopk", "randomk"])
def test_push_round_trips(name):
    p, frames = _push(name)
    msg = wire.decode(frames)
    assert (msg.op, msg.key, msg.round, msg.sender) == (wire.Op.PUSH, (3 << 16) + 1, 7, 1)
    assert torch.equal(msg.payload.decompress(), p.decompress())
    header = msgpack.unpackb(frames[0])
    assert header["v"] == wire.PROTOCOL and header["codec"] == p.codec
    assert all(not isinstance(v, (bytes, float)) for v in header.values())  # no data in msgpack


def test_control_message_round_trips():
    msg = wire.decode(wire.encode(wire.Op.REGISTER, role="server", host="10.0.0.1", port=9000))
    assert msg.op == wire.Op.REGISTER and msg.payload is None
    assert msg.extra == {"role": "server", "host": "10.0.0.1", "port": 9000}


def test_a_residual_travels_with_its_tensor_or_says_none_is_held_by_having_none():
    held = create("none").compress(torch.randn(4, 6), "r")
    msg = wire.decode(wire.encode(wire.Op.RESIDUAL, key=5, round=3, payload=held))
    assert (msg.op, msg.key, msg.round) == (wire.Op.RESIDUAL, 5, 3)
    assert torch.equal(msg.payload.decompress(), held.decompress())
    assert wire.decode(wire.encode(wire.Op.RESIDUAL, key=5, round=3)).payload is None
    data = wire.encode(wire.Op.RESIDUAL, key=5, payload=held)[1:]
    with pytest.raises(wire.WireError, match="fetch carries no tensor, but 1 data frame"):
        wire.decode(wire.encode(wire.Op.FETCH, key=5) + data)
    with pytest.raises(wire.WireError, match="residual carries no tensor, but 1 data frame"):
        wire.decode(wire.encode(wire.Op.RESIDUAL, key=5) + data)


def test_ops_travel_as_strings_and_decode_to_the_enum():
    header = msgpack.unpackb(wire.encode(wire.Op.NEGOTIATE, round=2)[0])
    assert header["op"] == "negotiate" and type(header["op"]) is str  # the wire carries the value
    msg = wire.decode([msgpack.packb({**header, "op": "agreed"})])
    assert msg.op is wire.Op.AGREED
    with pytest.raises(ValueError, match="'explode' is not a valid Op"):
        wire.encode("explode")


def _header(frames, **changes):
    h = msgpack.unpackb(frames[0])
    h.update(changes)
    return [msgpack.packb({k: v for k, v in h.items() if v is not None}), *frames[1:]]


@pytest.mark.parametrize("changes, words", [
    ({"v": 99}, "protocol version 99 is not supported"),
    ({"v": None}, "'v' must be int"),
    ({"op": "explode"}, "unknown op 'explode'"),
    ({"key": -1}, "'key' = -1 is out of range"),
    ({"round": "3"}, "'round' must be int"),
    ({"sender": True}, "'sender' must be int"),
    ({"vdtype": "object"}, "vdtype 'object' not allowed"),
    ({"count": 10**6}, "count 1000000 outside"),
    ({"shape": [8, 50, 10**9]}, "exceeds the limit"),
])
def test_bad_headers_are_named(changes, words):
    _, frames = _push()
    with pytest.raises(wire.WireError) as err:
        wire.decode(_header(frames, **changes))
    assert words in str(err.value)


def test_structural_errors():
    _, frames = _push()
    with pytest.raises(wire.WireError, match="empty message"):
        wire.decode([])
    with pytest.raises(wire.WireError, match="not valid msgpack"):
        wire.decode([b"\xc1\xc1", *frames[1:]])
    with pytest.raises(wire.WireError, match="exceeds the limit of 100"):
        wire.decode(frames, max_bytes=100)
    with pytest.raises(wire.WireError, match="carries no tensor"):
        wire.decode([wire.encode(wire.Op.HEARTBEAT)[0], b"x"])
    with pytest.raises(wire.WireError, match="indices frame has"):
        wire.decode([frames[0], frames[1], frames[2][:-1]])
    with pytest.raises(ValueError, match="clash"):
        wire.encode(wire.Op.REGISTER, codec="x")


def _mutate(data, raw: bytes) -> bytes:
    raw = bytearray(raw)
    for _ in range(data.draw(st.integers(1, 3))):
        op = data.draw(st.sampled_from(["flip", "cut", "grow"]))
        if op == "flip" and raw:
            raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
        elif op == "cut" and raw:
            del raw[data.draw(st.integers(0, len(raw) - 1)):]
        else:
            raw += data.draw(st.binary(min_size=1, max_size=16))
    return bytes(raw)


@given(st.sampled_from(["none", "topk", "adtopk", "randomk"]), st.data())
def test_mutated_frames_decode_correctly_or_raise_wire_error(name, data):
    _, frames = _push(name)
    which = data.draw(st.integers(0, len(frames) - 1))
    frames[which] = _mutate(data, frames[which])
    if data.draw(st.booleans()):
        frames = frames[:data.draw(st.integers(0, len(frames)))]
    try:
        msg = wire.decode(frames)
    except wire.WireError:
        return
    if msg.payload is not None:  # what decodes is self-consistent and safe to use
        assert tuple(msg.payload.decompress().shape) == msg.payload.shape


@given(st.lists(st.binary(max_size=80), max_size=4))
def test_random_frames_raise_only_wire_error(frames):
    try:
        wire.decode(frames)
    except wire.WireError:
        pass


@given(st.dictionaries(st.sampled_from(["v", "op", "key", "round", "sender", "codec", "shape",
                                        "dtype", "vdtype", "count", "idtype", "view", "k", "seed",
                                        "extra"]),
                       st.one_of(st.integers(-2, 2**40), st.text(max_size=8), st.none(),
                                 st.lists(st.integers(-1, 70), max_size=4), st.booleans())),
       st.lists(st.binary(max_size=64), max_size=3))
def test_random_headers_raise_only_wire_error(header, buffers):
    try:
        wire.decode([msgpack.packb(header), *buffers])
    except wire.WireError:
        pass


@given(st.lists(st.tuples(st.integers(0, 2**40), st.sampled_from(["topk", "none", "finish"])),
                min_size=1, max_size=8))
def test_a_batch_carries_its_messages_whole_and_in_order(items):
    messages = []
    for key, kind in items:
        if kind == "finish":
            messages.append(wire.encode(wire.Op.FINISH, sender=key % 7))
        else:
            payload = create(kind, **({"ratio": 0.1} if kind == "topk" else {})).compress(
                torch.randn(6, 10), "x", 0)
            messages.append(wire.encode(wire.Op.PUSH, key=key, round=1, sender=0, payload=payload))
    frames = wire.batch(messages)
    msg = wire.decode(frames)
    assert msg.op == wire.Op.BATCH and msg.extra["counts"] == [len(m) for m in messages]
    parts = wire.unbatch(frames, msg)
    assert [[bytes(f) for f in p] for p in parts] == [[bytes(f) for f in m] for m in messages]
    for part, message in zip(parts, messages):
        got, want = wire.decode(part), wire.decode(message)
        assert (got.op, got.key, got.round, got.sender) == (want.op, want.key, want.round, want.sender)


@pytest.mark.parametrize("counts", [[], [0, 1], [1, 1], [2], [-1, 2], [True], "1", [1.0]])
def test_a_batch_whose_counts_do_not_fit_its_frames_is_refused(counts):
    push = wire.encode(wire.Op.FINISH, sender=1)
    header = {**msgpack.unpackb(wire.batch([push])[0]), "counts": counts}
    with pytest.raises(wire.WireError, match="batch field 'counts'"):
        wire.decode([msgpack.packb(header), *push])


def test_a_node_that_never_takes_tensors_refuses_one_before_reading_it():
    """The scheduler decodes with ``tensors=False``: a push or a residual with a payload is
    refused by name, what it routes still decodes, and a stray push never makes it import
    torch (seconds of a loop that answers every node's heartbeats)."""
    payload = create("adtopk", ratio=0.25).compress(torch.randn(4, 8), "t")
    for op in (wire.Op.PUSH, wire.Op.RESIDUAL):
        frames = wire.encode(op, key=3, payload=payload)
        assert wire.decode(frames).payload is not None
        with pytest.raises(wire.WireError, match=f"{op} carries a tensor, which this node never takes"):
            wire.decode(frames, tensors=False)
    assert wire.decode(wire.encode(wire.Op.RESIDUAL, key=3), tensors=False).payload is None
    assert wire.decode(wire.encode(wire.Op.HEARTBEAT, sender=2), tensors=False).sender == 2
    stray = [msgpack.packb({"v": wire.PROTOCOL, "op": "push", "key": 1, "round": 0, "sender": 0,
                            "codec": "dense", "shape": [2], "dtype": "float32", "vdtype": "float32",
                            "count": 2}), bytes(8)]
    code = ("import sys, msgpack\n"
            "from adtopk_ps.cluster import scheduler\n"
            "from adtopk_ps import wire\n"
            f"frames = [bytes.fromhex('{stray[0].hex()}'), bytes(8)]\n"
            "try:\n    wire.decode(frames, tensors=False)\nexcept wire.WireError as exc:\n    print(exc)\n"
            "print('torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         check=True).stdout.splitlines()
    assert out == ["push carries a tensor, which this node never takes", "False"], out
