"""Selection properties of ADTopk and global top-k over random shapes and dtypes."""
import pytest
import torch
from hypothesis import given, strategies as st

from adtopk_ps.compression import ADTopk, TopK, fibre_k
from adtopk_ps.core.dtypes import index_dtype
from adtopk_ps.compression.base import global_k

from strategies import gradients, ratios, rule_positions


def _selected_mask(view, positions):
    mask = torch.zeros(view, dtype=torch.bool)
    return mask.scatter_(1, positions, True)


@given(gradients(), ratios, st.sampled_from(["axis", "rows"]))
def test_every_fibre_keeps_exactly_its_largest(x, ratio, layout):
    comp = ADTopk(ratio, layout=layout)
    p = comp.compress(x, "w")
    view = comp.view_of(tuple(x.shape))
    k = fibre_k(view[1], ratio)
    assert p.codec == "fibre" and p.view == view
    assert p.indices.dtype == index_dtype(view[1])
    # rows that selected only zeros are left out, and only those
    rows = torch.arange(view[0]) if p.rows is None else p.rows
    left_out = torch.ones(view[0], dtype=torch.bool)
    left_out[rows] = False
    assert not bool(x.reshape(view)[left_out].any())
    assert p.rows is None or bool(p.values.flatten(1).ne(0).any(1).all())
    kept = x.reshape(view)[rows]
    view = tuple(kept.shape)
    assert p.values.shape == (view[0], k, *view[2:])
    positions = p.indices.long()
    # k distinct positions in every fibre, in ascending order (select.py's rule)
    assert bool((positions.diff(dim=1) > 0).all())
    if x.dtype == torch.float32:  # the compiled kernel: exactly the rule's, ties included
        assert torch.equal(positions, rule_positions(kept, k))
    mags = kept.float().abs()
    mask = _selected_mask(view, positions)
    if mask.numel():
        assert int(mask.sum(dim=1).min()) == k == int(mask.sum(dim=1).max())
    low_kept = mags.masked_fill(~mask, float("inf")).amin(dim=1)
    high_dropped = mags.masked_fill(mask, -1.0).amax(dim=1)
    assert bool((low_kept >= high_dropped).all())
    assert torch.equal(p.values, kept.gather(1, positions))


@given(gradients(), ratios)
def test_global_topk_keeps_the_k_largest(x, ratio):
    p = TopK(ratio).compress(x, "w")
    flat = x.reshape(-1).float().abs()
    k = global_k(flat.numel(), ratio)
    positions = p.indices.long()
    assert positions.numel() == k == positions.unique().numel()
    mask = torch.zeros(flat.numel(), dtype=torch.bool)
    mask[positions] = True
    dropped = flat[~mask]
    if dropped.numel():
        assert float(flat[mask].min()) >= float(dropped.max())


def test_fibre_k_never_drops_a_fibre():
    assert fibre_k(3, 0.01) == 1
    assert fibre_k(4096, 0.01) == 40
    assert fibre_k(100, 1.0) == 100


def test_dim_below_two_is_refused():
    try:
        ADTopk(0.01).compress(torch.randn(10), "bias")
    except ValueError as e:
        assert "dim() >= 2" in str(e) and "bias" in str(e)
    else:
        raise AssertionError("1-D tensor accepted")


def test_non_contiguous_input_matches_contiguous(device):
    x = torch.randn(64, 512, device=device).t()  # [512, 64], non-contiguous
    assert not x.is_contiguous()
    a = ADTopk(0.05).compress(x, "w")
    b = ADTopk(0.05).compress(x.contiguous(), "w")
    assert torch.equal(a.decompress(), b.decompress())
    assert a.values.device == x.device


@pytest.mark.parametrize("shape, ratio", [((8, 20000, 3), 0.01), ((4, 5003, 2), 0.002),
                                          ((3, 1024), 0.01), ((2, 7919, 1, 2), 0.05)])
def test_two_stage_search_on_long_fibres_matches_a_full_sort(shape, ratio):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(shape, generator=gen)
    x[0, -5:] = 50.0  # the largest values sit in the tail that fills no group
    p = ADTopk(ratio).compress(x, "w")
    k = fibre_k(shape[1], ratio)
    ref = x.abs().topk(k, dim=1).values.sort(dim=1).values
    assert torch.equal(p.values.abs().sort(dim=1).values, ref)


def test_axis_longer_than_uint16_widens_indices():
    for shape in [(2, 70000), (1, 65537, 1, 2)]:
        x = torch.randn(shape)
        p = ADTopk(0.001).compress(x, "w")
        assert p.indices.dtype == torch.int32
        assert int(p.indices.max()) > 0 and p.values.shape[1] == fibre_k(shape[1], 0.001)
    assert ADTopk(0.5).compress(torch.randn(3, 65536), "w").indices.dtype == torch.uint16
    assert ADTopk(0.5).compress(torch.randn(3, 256), "w").indices.dtype == torch.uint8


@given(st.integers(2, 40), st.integers(2, 300), st.floats(0.005, 0.5), st.data())
def test_refill_gives_the_live_rows_what_the_dead_rows_left(rows, length, ratio, data):
    """Refill: each call keeps fibre_k(length, ratio / live) per live row, live being the
    share of rows carried by the tensor's previous call, and so comes back to about the
    density's entries; the selection is still each fibre's largest."""
    comp, plain = ADTopk(ratio, refill=True), ADTopk(ratio)
    live_before = 1.0
    for _ in range(3):
        dead = data.draw(st.lists(st.booleans(), min_size=rows, max_size=rows))
        x = torch.randn(rows, length)
        x[torch.tensor(dead)] = 0
        p = comp.compress(x, "w")
        k = min(length, fibre_k(length, min(1.0, ratio / live_before)))
        carried = rows if p.rows is None else p.rows.numel()
        assert p.values.shape[1] == k
        kept = x[torch.arange(rows) if p.rows is None else p.rows]
        assert torch.equal(p.indices.long(), rule_positions(kept, k))
        # never fewer entries than without refill
        assert p.values.numel() >= plain.compress(x, "w").values.numel()
        live_before = max(1, carried) / rows
    saved = ADTopk(ratio, refill=True)
    saved.load_state_dict(comp.state_dict())  # a checkpoint keeps the shares
    assert saved._fibres(x, "w", None) == comp._fibres(x, "w", None)


def test_refill_must_be_a_boolean():
    with pytest.raises(ValueError, match="refill must be true or false, got 'yes'"):
        ADTopk(0.01, refill="yes")
