"""Compressor state kept whole in checkpoints and cut again by the partitions of the job that
loads it: any cut round-trips to the same rows, whatever the cut it was saved from."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from adtopk_ps.torch.part_state import parted, whole


def _blocks(count: int, per: int) -> list[tuple[int, int]]:
    return [(s, min(per, count - s)) for s in range(0, count, per)]


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 40), st.integers(1, 6), st.integers(1, 40), st.integers(1, 40), st.booleans())
def test_state_saved_under_one_cut_loads_under_another(rows, width, per_saved, per_loaded, flat):
    shape = (rows * width,) if flat else (rows, width)
    unit, count = (1, rows * width) if flat else (width, rows)
    full = torch.randn(shape)
    saved = {"residuals": {f"w#{i}": full.reshape(-1)[s * unit:(s + n) * unit].reshape(n, *shape[1:])
                           for i, (s, n) in enumerate(_blocks(count, per_saved))},
             "calls": {f"w#{i}": 7 for i in range(len(_blocks(count, per_saved)))}}
    kept = whole(saved)
    assert set(kept["residuals"]) == {"w#*"} and kept["calls"] == {"w#*": 7}
    loaded_blocks = _blocks(count, per_loaded)
    back = parted(kept, lambda name: (shape, loaded_blocks) if name == "w" else None)
    assert back["calls"] == {f"w#{i}": 7 for i in range(len(loaded_blocks))}
    joined = torch.cat([back["residuals"][f"w#{i}"].reshape(-1) for i in range(len(loaded_blocks))])
    assert torch.equal(joined, full.reshape(-1))
    for i, (_, n) in enumerate(loaded_blocks):
        assert back["residuals"][f"w#{i}"].shape == (n, *shape[1:])


def test_what_cannot_be_joined_or_placed_is_kept_as_it_was():
    state = {"a#0": torch.ones(2), "a#2": torch.ones(2),   # a gap: not a whole set
             "b#0": 1, "b#1": 2,                              # counts that differ
             "live": {"c": 0.5}, "d#*": torch.ones(3)}        # a tensor this job does not push
    assert whole(state).keys() == state.keys()
    assert parted(state, lambda name: None).keys() == state.keys()


def test_a_tensor_of_another_size_is_refused_naming_it():
    with pytest.raises(ValueError, match="'w'.*holds 6 values.*shape \\(4, 2\\)"):
        parted({"w#*": torch.zeros(6)}, lambda name: ((4, 2), [(0, 4)]))
