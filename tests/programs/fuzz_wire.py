"""atheris (coverage-guided) fuzzing of everything a server does with a message's bytes:
``wire.decode``, then, for a push, the aggregator. Anything but WireError or PushRejected
is a bug, and atheris exits non-zero with the input that caused it.

    python fuzz_wire.py --seeds DIR            # write a seed corpus of valid messages
    python fuzz_wire.py DIR -runs=20000        # fuzz, starting from it

An input is ``n`` (one byte) frames, each a 4-byte little-endian length and its bytes;
what is left over is the last frame.
"""
import struct
import sys
from pathlib import Path

import atheris
import msgpack  # noqa: F401  imported first, so that only the project's code is instrumented
import numpy  # noqa: F401
import torch  # noqa: F401

with atheris.instrument_imports(include=["adtopk_ps", "server"]):
    from adtopk_ps import wire
    from server.aggregator import Aggregator, PushRejected


def frames_of(data: bytes) -> list[bytes]:
    if not data:
        return []
    count, at, frames = 1 + data[0] % 4, 1, []
    for _ in range(count - 1):
        (length,) = struct.unpack_from("<I", data, at) if at + 4 <= len(data) else (0,)
        at += 4
        frames.append(data[at:at + length])
        at += length
    frames.append(data[at:])
    return frames


def pack(frames: list[bytes]) -> bytes:
    out = bytes([len(frames) - 1])
    for frame in frames[:-1]:
        out += struct.pack("<I", len(frame)) + frame
    return out + frames[-1]


def one_input(data: bytes) -> None:
    frames = frames_of(data)
    if not frames:
        return
    try:
        msg = wire.decode(frames, max_bytes=1 << 20)
        if msg.op == wire.Op.PUSH and msg.payload is not None:
            Aggregator(2, max_bytes=1 << 22).push(msg.key, msg.round, msg.sender, msg.payload,
                                                   owned=True)
    except (wire.WireError, PushRejected):
        pass


def write_seeds(directory: Path) -> None:
    from adtopk_ps.compression import create
    directory.mkdir(parents=True, exist_ok=True)
    x = torch.randn(6, 20)
    for name in ("none", "adtopk", "topk", "randomk"):
        comp = create(name) if name == "none" else create(name, ratio=0.2)
        frames = wire.encode(wire.Op.PUSH, key=3, round=0, sender=1, payload=comp.compress(x, "t", 0))
        (directory / name).write_bytes(pack([bytes(f) for f in frames]))
    for name, rows, live in (("adtopk-bitmap", 6, [1, 3, 4]), ("adtopk-list", 40, [5, 33])):
        y = torch.zeros(rows, 20)
        y[live] = torch.randn(len(live), 20)  # the zero rows are left out: a row set frame
        frames = wire.encode(wire.Op.PUSH, key=3, round=0, sender=1,
                             payload=create("adtopk", ratio=0.2).compress(y, "t", 0))
        (directory / name).write_bytes(pack([bytes(f) for f in frames]))
    (directory / "heartbeat").write_bytes(pack([bytes(wire.encode(wire.Op.HEARTBEAT)[0])]))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--seeds"]:
        write_seeds(Path(sys.argv[2]))
    else:
        atheris.Setup(sys.argv, one_input)
        atheris.Fuzz()
