"""The compiled checks on a received payload's positions (wire/_positions.c) agree with
torch's and numpy's, which serve where the extension is not built: the same span, the same
rows from a bitmap, the same refusals."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from adtopk_ps.core.dtypes import INDEX_DTYPES
from adtopk_ps.core.payload import PayloadError
from adtopk_ps.wire import checks

RANGES = {torch.uint8: (0, 255), torch.uint16: (0, 65535), torch.int32: (-2**31, 2**31 - 1),
          torch.int64: (-2**63, 2**63 - 1)}


def test_extension_is_built():
    assert checks._positions is not None


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(list(INDEX_DTYPES.values())), st.data())
def test_span_matches_torch(dtype, data):
    low, high = RANGES[dtype]
    values = data.draw(st.lists(st.integers(low, high), min_size=1, max_size=200))
    if data.draw(st.booleans()):  # increasing runs are the row sets' case
        values = sorted(set(values))
    t = torch.tensor(values, dtype=torch.int64).to(dtype)
    got = checks._span(t)
    expected = (min(values), max(values), all(b > a for a, b in zip(values, values[1:])))
    assert got == expected
    assert checks._positions.span(t.data_ptr(), t.element_size(), t.numel()) == expected


def test_span_of_a_strided_tensor_takes_torch_and_agrees():
    t = torch.arange(20, dtype=torch.int32).view(4, 5).t()  # not contiguous
    assert checks._span(t) == (0, 19, False)


def test_span_refuses_an_unknown_index_size():
    with pytest.raises(ValueError, match="index size 3"):
        checks._positions.span(torch.zeros(4).data_ptr(), 3, 4)


def bitmap_of(rows: list[int], lead: int) -> bytes:
    bits = np.zeros((lead + 7) // 8 * 8, dtype=np.uint8)
    bits[rows] = 1
    return np.packbits(bits, bitorder="little").tobytes()


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 300), st.data())
def test_bitmap_rows_match_numpy(lead, data):
    rows = sorted(data.draw(st.sets(st.integers(0, lead - 1), max_size=lead)))
    live = data.draw(st.sampled_from([len(rows), len(rows) + 1, max(0, len(rows) - 1)]))
    frame = bitmap_of(rows, lead)
    if data.draw(st.booleans()) and lead % 8:  # a bit past the last row
        frame = frame[:-1] + bytes([frame[-1] | 1 << (lead % 8 + data.draw(st.integers(0, 7 - lead % 8)))])
        past = True
    else:
        past = False
    compiled = _rows_or_error(frame, live, lead)
    numpy_path = _rows_or_error_uncompiled(frame, live, lead)
    assert compiled == numpy_path
    if past:
        assert "past its" in compiled
    elif live != len(rows):
        assert f"names {len(rows)} rows, the metadata says {live}" in compiled
    else:
        assert compiled == rows


def _rows_or_error(frame: bytes, live: int, lead: int):
    try:
        return checks._rows_from_buffer(frame, "bitmap", live, lead).tolist()
    except PayloadError as exc:
        return str(exc)


def _rows_or_error_uncompiled(frame: bytes, live: int, lead: int):
    saved, checks._positions = checks._positions, None
    try:
        return _rows_or_error(frame, live, lead)
    finally:
        checks._positions = saved


def test_bitmap_rows_refuse_a_frame_of_the_wrong_length():
    with pytest.raises(ValueError, match="3 bytes for 9 rows"):
        checks._positions.bitmap_rows(b"\x01\x00\x00", 9, torch.empty(1, dtype=torch.int64).data_ptr(), 1)


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("rows", [[3, 2], [0, 9], [-1, 2], [4, 4]])
def test_a_bad_row_list_is_refused_by_both_paths(rows, compiled, monkeypatch):
    if not compiled:
        monkeypatch.setattr(checks, "_positions", None)
    with pytest.raises(PayloadError, match="must be increasing rows within"):
        checks._check_rows(torch.tensor(rows), 9, len(rows))


def test_a_row_set_for_a_view_of_no_elements_is_refused_before_any_memory():
    """A fibre view with a zero dimension carries no values, so nothing bounds its row set
    by the message: it is refused by name, whatever rows it names."""
    from adtopk_ps.wire.checks import payload_from_fields
    lead = 8000
    meta = {"codec": "fibre", "shape": [lead, 5, 0], "dtype": "float32", "vdtype": "float32",
            "count": 0, "idtype": "uint8", "view": [lead, 5, 0], "k": 1, "rows": 7999,
            "rowset": "bitmap"}
    with pytest.raises(PayloadError, match=r"a row set for a view of no elements"):
        payload_from_fields(meta, [b"", b"", b"\xff" * (lead // 8)])
