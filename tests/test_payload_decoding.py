"""The wire's payload decoder checks everything before it touches memory, and a decoded
payload is written into its tensor (the compiled sparse write) with torch's bits."""
import dataclasses
import math

import msgpack
import pytest
import torch
from hypothesis import given, settings, strategies as st

from adtopk_ps import wire
from adtopk_ps.compression import create
from adtopk_ps.core import sparse_write
from adtopk_ps.core.payload import Payload, PayloadError
from adtopk_ps.wire.checks import payload_from_fields

from strategies import ENVELOPE, encoded_payload_bytes


def _encode(p):
    return [bytes(f) for f in wire.encode(wire.Op.PUSH, key=3, round=1, sender=0, payload=p)]


def _decode(frames):
    return wire.decode(frames).payload


def _frames(name="adtopk", shape=(6, 40), **params):
    p = create(name, **params).compress(torch.randn(shape), "w", 1)
    return p, _encode(p)


def _with_meta(frames, **changes):
    meta = msgpack.unpackb(frames[0])
    meta.update(changes)
    return [msgpack.packb({k: v for k, v in meta.items() if v is not None}), *frames[1:]]


@pytest.mark.parametrize("changes, words", [
    ({"codec": "zstd"}, "unknown codec 'zstd'"),
    ({"dtype": "int8"}, "dtype 'int8' not allowed"),
    ({"vdtype": "complex64"}, "vdtype 'complex64' not allowed"),
    ({"idtype": "float32"}, "idtype 'float32' not allowed"),
    ({"shape": [6, -40]}, "non-negative integers"),
    ({"shape": [6, 41]}, "view [6, 40] is not"),
    ({"shape": [2**20, 2**20]}, "exceeds the limit"),
    ({"count": 7}, "count 7 does not match view"),
    ({"count": -1}, "count -1 outside"),
    ({"k": 0}, "k 0 outside"),
    ({"view": None}, "needs metadata field 'view'"),
    ({"count": "6"}, "'count' must be int"),
])
def test_bad_metadata_is_named(changes, words):
    _, frames = _frames()
    with pytest.raises(wire.WireError) as err:
        _decode(_with_meta(frames, **changes))
    assert words in str(err.value)


def test_unknown_payload_fields_are_named():
    # decode hands the payload checks only the payload's fields (others are the op's);
    # given any other, the checks name it
    _, frames = _frames()
    fields = {k: v for k, v in msgpack.unpackb(frames[0]).items() if k not in ENVELOPE}
    with pytest.raises(PayloadError, match=r"unknown metadata field\(s\) \['extra'\]"):
        payload_from_fields({**fields, "extra": 1}, frames[1:])


def test_out_of_range_index_is_refused():
    _, frames = _frames(shape=(6, 40), ratio=0.1)
    bad = bytearray(frames[2])
    bad[3] = 40  # positions along an axis of length 40 run 0..39
    with pytest.raises(wire.WireError, match=r"index out of range: \[\d+, 40\] not within \[0, 40\)"):
        _decode([frames[0], frames[1], bytes(bad)])


def test_truncated_and_missing_frames_are_refused():
    _, frames = _frames()
    with pytest.raises(wire.WireError, match="values frame has"):
        _decode([frames[0], frames[1][:-1], frames[2]])
    with pytest.raises(wire.WireError, match="needs 2 buffer"):
        _decode(frames[:2])
    with pytest.raises(wire.WireError, match="not valid msgpack"):
        _decode([b"\xc1", *frames[1:]])
    with pytest.raises(wire.WireError, match="must be a map"):
        _decode([msgpack.packb([1, 2]), *frames[1:]])


def _dead_rows(shape=(40, 64), dead=range(0, 40, 3), ratio=0.05):
    """An ADTopk payload of a gradient whose rows ``dead`` are zero, and its frames."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(len(dead)))
    x[list(dead)] = 0
    p = create("adtopk", ratio=ratio).compress(x, "w", 1)
    return x, p, _encode(p)


def test_rows_of_zeros_are_left_out_and_named():
    x, p, frames = _dead_rows()
    live = [r for r in range(40) if r % 3]
    assert p.rows.tolist() == live and p.values.shape == (len(live), 3)
    meta = msgpack.unpackb(frames[0])
    assert (meta["rows"], meta["rowset"], meta["count"]) == (len(live), "bitmap", len(live) * 3)
    assert frames[3] == _bitmap(live)
    assert encoded_payload_bytes(frames) == wire.payload_nbytes(p)
    back = _decode(frames)
    assert back.rows.tolist() == live and torch.equal(back.decompress(), p.decompress())
    assert torch.equal(back.decompress().ne(0).sum(1), torch.tensor([0 if r % 3 == 0 else 3 for r in range(40)]))


def test_a_few_live_rows_are_listed_and_a_payload_without_dead_rows_is_as_before():
    _, p, frames = _dead_rows(dead=[r for r in range(40) if r not in (5, 33)])
    meta = msgpack.unpackb(frames[0])
    assert (meta["rows"], meta["rowset"]) == (2, "list")  # 2 x uint8 against a 5-byte bitmap
    assert frames[3] == bytes([5, 33])
    assert torch.equal(_decode(frames).decompress(), p.decompress())
    _, p, frames = _dead_rows(dead=range(40))  # every row dead: nothing but the header
    assert msgpack.unpackb(frames[0])["rows"] == 0 and [len(f) for f in frames[1:]] == [0, 0, 0]
    assert not _decode(frames).decompress().any()
    _, p, frames = _dead_rows(dead=[])
    assert p.rows is None and len(frames) == 3 and "rows" not in msgpack.unpackb(frames[0])


def _bitmap(rows, lead=40):
    """Row r at bit r % 8 of byte r // 8."""
    return bytes(sum(1 << (r % 8) for r in rows if r // 8 == b) for b in range((lead + 7) // 8))


@pytest.mark.parametrize("changes, row_frame, words", [
    ({"rowset": None}, None, "'rows' and 'rowset' come together"),
    ({"rows": None}, None, "'rows' and 'rowset' come together"),
    ({"rowset": "rle"}, None, "rowset 'rle' not allowed"),
    ({"rows": 40, "count": 120}, None, "rows 40 outside [0, 40)"),
    ({"rows": -1}, None, "rows -1 outside"),
    ({"rows": 3}, None, "count 78 does not match view [40, 64] with k=3 and 3 rows"),
    ({"rows": True}, None, "'rows' must be int"),
    ({}, _bitmap(range(1, 27)) + b"\0", "row set frame (bitmap) has 6 bytes, expected 5"),
    ({}, _bitmap(range(1, 28)), "names 27 rows, the metadata says 26"),
    ({}, _bitmap(range(1, 26)), "names 25 rows, the metadata says 26"),
    ({"rows": 2, "rowset": "list", "count": 6}, bytes([7, 7]), "must be increasing rows"),
    ({"rows": 2, "rowset": "list", "count": 6}, bytes([9, 3]), "must be increasing rows"),
    ({"rows": 2, "rowset": "list", "count": 6}, bytes([3, 40]), "within [0, 40)"),
    ({"rows": 2, "rowset": "list", "count": 6}, bytes([3]), "row set frame (list) has 1 bytes, expected 2"),
])
def test_bad_row_sets_are_named(changes, row_frame, words):
    _, p, frames = _dead_rows()
    frames = _with_meta(frames, **changes)
    if row_frame is not None:
        frames[3] = row_frame
        if changes.get("count") == 6:
            frames[1], frames[2] = frames[1][:24], frames[2][:6]
    with pytest.raises(wire.WireError) as err:
        _decode(frames)
    assert words in str(err.value)


def test_bits_past_the_rows_are_refused():
    _, p, frames = _dead_rows(shape=(37, 64), dead=range(0, 37, 3))  # 5 bytes for 37 rows
    assert frames[3] == _bitmap(p.rows.tolist(), 37)
    frames[3] = frames[3][:4] + bytes([frames[3][4] | 0x40])
    with pytest.raises(wire.WireError, match="row set bitmap sets bits past its 37 rows"):
        _decode(frames)


def test_a_row_set_on_another_codec_and_a_missing_row_frame_are_refused():
    _, frames = _frames("topk", ratio=0.1)
    with pytest.raises(wire.WireError, match="codec 'coo' carries no row set"):
        _decode(_with_meta(frames, rows=1, rowset="list"))
    _, _, frames = _dead_rows()
    with pytest.raises(wire.WireError, match="with a row set needs 3 buffer"):
        _decode(frames[:3])
    _, full = _frames("adtopk", shape=(40, 64), ratio=0.05)
    with pytest.raises(wire.WireError, match="needs 2 buffer"):
        _decode([*full, b"\xff" * 5])


@given(st.sampled_from(["none", "topk", "adtopk", "randomk", "dead-rows"]), st.data())
def test_mutated_frames_decode_correctly_or_raise_wire_error(name, data):
    if name == "dead-rows":
        _, p, frames = _dead_rows(shape=(20, 30), dead=range(0, 20, 2), ratio=0.1)
    else:
        p, frames = _frames(name, shape=(5, 30), ratio=0.1) if name != "none" else _frames(name, (5, 30))
    which = data.draw(st.integers(0, len(frames) - 1))
    raw = bytearray(frames[which])
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["flip", "cut", "grow"]))
        if op == "flip" and raw:
            at = data.draw(st.integers(0, len(raw) - 1))
            raw[at] = data.draw(st.integers(0, 255))
        elif op == "cut" and raw:
            del raw[data.draw(st.integers(0, len(raw) - 1)):]
        else:
            raw += data.draw(st.binary(max_size=8))
    frames[which] = bytes(raw)
    try:
        back = _decode(frames)
    except wire.WireError:
        return
    dense = back.decompress()  # a decode that succeeds yields a usable, in-range tensor
    assert tuple(dense.shape) == back.shape


@given(st.sampled_from(["none", "topk", "adtopk", "randomk"]), st.integers(1, 5))
def test_write_into_with_a_divisor_equals_dividing_afterwards(name, divisor):
    x = torch.randn(12, 20, generator=torch.Generator().manual_seed(divisor))
    payload = (create(name) if name == "none" else create(name, ratio=0.2)).compress(x, "t", 1)
    want = payload.decompress().div_(divisor)
    assert torch.equal(payload.write_into(torch.full_like(x, 7.0), divisor), want)
    if name != "none":  # the flat positions are exactly where the values land
        flat = payload.decompress().view(-1)
        assert torch.equal(flat[payload.flat_positions()], payload.values.reshape(-1))


def test_the_sparse_write_kernel_is_built_and_serves_answers():
    # the install compiles it; a missing compiler would silently cost the speed-up
    assert sparse_write._sparse_write is not None
    x = torch.randn(12, 20)
    for name in ("adtopk", "topk"):
        payload = create(name, ratio=0.2).compress(x, "t", 1)
        got = wire.decode(_encode(payload)).payload
        assert sparse_write.applies(torch.empty_like(x), *_parts(got))


_INDEX = [torch.uint8, torch.uint16, torch.int32, torch.int64]
_OUT_VALUES = [(torch.float32, torch.float32), (torch.float64, torch.float64),
               (torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16),
               (torch.float32, torch.float16), (torch.float32, torch.bfloat16)]


@st.composite
def sparse_payloads(draw, dtype):
    """A fibre (row set or not) or coo payload of ``dtype`` values whose positions may repeat and
    come in any order, or ascend; values of every sign, signed zeros, infinities and NaNs."""
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 65504.0, 1e-8])
    ascending = draw(st.booleans())

    def values_like(shape):
        vals = torch.randn(shape, generator=gen) * 10 ** draw(st.integers(-3, 3))
        picks = torch.rand(shape, generator=gen) < draw(st.sampled_from([0.0, 0.1]))
        vals[picks] = special[torch.randint(0, len(special), (int(picks.sum()),), generator=gen)]
        return vals.to(dtype)

    if draw(st.booleans()):
        shape = tuple(draw(st.lists(st.integers(1, 9), min_size=1, max_size=3)))
        numel = math.prod(shape)
        count = draw(st.integers(0, 2 * numel))
        idtype = draw(st.sampled_from([t for t in _INDEX if t != torch.uint8 or numel <= 256]))
        positions = torch.randint(0, numel, (count,), generator=gen)
        if ascending:
            positions = positions.sort().values
        return Payload("coo", shape, dtype, values_like(count), positions.to(idtype))
    view = (draw(st.integers(1, 6)), draw(st.integers(1, 12)), *draw(st.lists(st.integers(1, 3), max_size=2)))
    k = draw(st.integers(1, view[1]))
    lead = view[0]
    rows = None
    if draw(st.booleans()):
        rows = torch.randperm(view[0], generator=gen)[:draw(st.integers(0, view[0]))].sort().values
        lead = rows.numel()
    shape = (lead, k, *view[2:])
    if draw(st.booleans()):  # distinct positions in a fibre, as ADTopk's
        idx = torch.rand(lead, view[1], *view[2:], generator=gen).argsort(1)[:, :k]
    else:
        idx = torch.randint(0, view[1], shape, generator=gen)
    if ascending:
        idx = idx.sort(1).values
    idtype = draw(st.sampled_from(_INDEX))
    return Payload("fibre", view, dtype, values_like(shape), idx.to(idtype).contiguous(), view, rows=rows)


def _parts(p):
    return p.codec, p.values, p.indices, p.view, p.rows


def _same_bits(a, b):
    nan = a.isnan()
    as_int = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return (torch.equal(nan, b.isnan())
            and torch.equal(a.view(as_int)[~nan], b.view(as_int)[~nan]))


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(_OUT_VALUES), st.integers(1, 9), st.data())
def test_the_compiled_write_has_the_torch_paths_bits(types, divisor, data):
    """The compiled walk gives what torch's zero and scatter give, bit for bit (but a NaN's
    payload), whatever was in the target; ``write_into`` does too, whichever path it takes."""
    out_dtype, value_dtype = types
    payload = data.draw(sparse_payloads(value_dtype))
    payload = dataclasses.replace(payload, dtype=out_dtype)
    out = torch.full(payload.shape, 7.0, dtype=out_dtype)
    assert sparse_write.applies(out, *_parts(payload))
    want = payload.accumulate_into(torch.full_like(out, 7.0).zero_(), divisor=divisor)
    ascending = bool((payload.flat_positions().diff() >= 0).all())
    # positions that go back are left to torch
    wrote = sparse_write.write(out, *_parts(payload), divisor)
    assert wrote == ascending
    if wrote:
        assert _same_bits(out, want)
    assert _same_bits(payload.write_into(torch.full_like(out, 7.0), divisor), want)


@pytest.mark.parametrize("payload, shape", [
    (Payload("coo", (4,), torch.float32, torch.tensor([1.0, 2.0]), torch.tensor([1, 4])), (4,)),
    (Payload("coo", (2, 2), torch.float32, torch.tensor([1.0, 2.0]), torch.tensor([-1, 0])), (2, 2)),
    (Payload("fibre", (2, 3), torch.float32, torch.tensor([[1.0], [2.0]]), torch.tensor([[1], [3]]),
             (2, 3)), (2, 3)),
    (Payload("fibre", (2, 3), torch.float32, torch.tensor([[1.0]]), torch.tensor([[1]]), (2, 3),
             rows=torch.tensor([2])), (2, 3)),
])
def test_a_position_out_of_bounds_raises_torchs_error(payload, shape):
    """Payloads built in process (nothing checked them on the way): the compiled walk names the
    position as torch's scatter does."""
    assert sparse_write.applies(torch.empty(shape), *_parts(payload))
    with pytest.raises(RuntimeError) as torch_error:
        payload.accumulate_into(torch.zeros(shape))
    with pytest.raises(RuntimeError) as compiled_error:
        payload.write_into(torch.empty(shape))
    assert str(compiled_error.value) == str(torch_error.value)


def test_atheris_finds_nothing_but_named_errors(tmp_path):
    """Coverage-guided fuzzing of the server's whole input path (decode, then aggregate),
    from a corpus of valid messages of every codec, for a bounded number of runs."""
    import subprocess
    import sys
    from pathlib import Path
    pytest.importorskip("atheris")
    program = str(Path(__file__).resolve().parent / "programs" / "fuzz_wire.py")
    corpus = tmp_path / "corpus"
    subprocess.run([sys.executable, program, "--seeds", str(corpus)], check=True, timeout=120)
    result = subprocess.run([sys.executable, program, str(corpus), "-runs=300000",
                             "-max_total_time=60", "-rss_limit_mb=2048",
                             f"-artifact_prefix={tmp_path}/"],  # a crashing input, kept with the test
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Done" in result.stderr and "cov:" in result.stderr
