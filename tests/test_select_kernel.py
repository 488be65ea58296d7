"""The compiled per-fibre selection (_fibre.c) picks exactly what the torch kernels pick."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from adtopk_ps.compression import select


def test_kernel_is_built():
    # the install compiles it; a missing compiler would silently cost the speed-up
    assert select._fibre is not None


def torch_positions(x: torch.Tensor, k: int) -> torch.Tensor:
    kernel, select._fibre = select._fibre, None
    try:
        return select.fibre_topk(x, k)
    finally:
        select._fibre = kernel


def magnitudes(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    return x.abs().gather(1, positions).sort(dim=1).values


@settings(max_examples=150, deadline=None)
@given(lead=st.integers(1, 6), n=st.integers(1, 700), rest=st.sampled_from([(), (1,), (3,), (2, 3)]),
       density=st.floats(0.0005, 1 / 16), ties=st.booleans(), seed=st.integers(0, 2**16))
def test_kernel_matches_torch(lead, n, rest, density, ties, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((lead, n, *rest), generator=gen)
    if ties:  # few distinct magnitudes: the k-th largest is shared by many entries
        x = (x * 2).round()
    k = max(1, math.floor(n * density))
    if not select._kernel_applies(x, k) or k >= n:
        return
    got = select.fibre_topk(x, k)
    assert got.shape == (lead, k, *rest) and got.dtype == torch.int64
    assert int(got.min()) >= 0 and int(got.max()) < n
    # distinct positions within each fibre
    assert torch.equal(got.sort(dim=1).values.diff(dim=1).ne(0).all(dim=1),
                       torch.ones((lead, *rest), dtype=torch.bool)) or k == 1
    assert torch.equal(magnitudes(x, got), magnitudes(x, torch_positions(x, k)))


def test_nan_is_kept_like_torch():
    x = torch.randn(4, 512)
    x[1, 77] = float("nan")
    got = select.fibre_topk(x, 8)
    assert 77 in got[1].tolist()
    assert torch.equal(magnitudes(x[[0, 2, 3]], got[[0, 2, 3]]),
                       x[[0, 2, 3]].abs().topk(8, dim=1).values.sort(dim=1).values)


@pytest.mark.parametrize("shape,k", [((19, 100), 1), ((19, 256), 2), ((64, 64, 3, 3), 1),
                                     ((5, 200, 7), 2)])
def test_streamed_fibres_keep_the_largest_and_break_ties_by_position(shape, k):
    # k <= 2 streams fibres side by side: a slab's fibres, or a row as its 4 residue classes
    x = torch.randn(shape)
    got = select.fibre_topk(x, k)
    assert torch.equal(magnitudes(x, got), magnitudes(x, torch_positions(x, k)))
    x.select(1, 3).fill_(float("nan"))  # NaN counts as the largest, as in torch.topk
    assert select.fibre_topk(x, k).eq(3).sum(dim=1).eq(1).all()
    ties = select.fibre_topk(torch.full(shape, -2.0), k)
    assert torch.equal(ties.sort(dim=1).values,
                       torch.arange(k).view(1, k, *[1] * (len(shape) - 2)).expand(ties.shape))


def test_all_zero_fibres_give_distinct_positions():
    got = select.fibre_topk(torch.zeros(3, 1024), 16)
    assert all(len(set(row)) == 16 for row in got.tolist())


def test_ties_at_the_threshold_fill_in_by_position():
    # fewer than k entries above the k-th largest group maximum: the rest are its ties, the
    # first by position, wherever they lie (groups or the tail past the last whole group);
    # zero rows (a dead unit's gradient) are all ties
    x = torch.zeros(4, 1030)
    x[1, [3, 600, 1027]] = torch.tensor([-5.0, 4.0, 6.0])
    x[2, 1024:] = 3.0  # 6 ties in the tail, and 2 in the groups
    x[2, [10, 700]] = -3.0
    x[3] = torch.randn(1030)
    got = select.fibre_topk(x, 8)
    assert got[0].tolist() == list(range(8))
    assert set(got[1].tolist()) >= {3, 600, 1027} and set(got[1].tolist()) - {3, 600, 1027} == \
        set(range(6)) - {3}
    assert set(got[2].tolist()) == {10, 700, *range(1024, 1030)}
    assert torch.equal(magnitudes(x, got), magnitudes(x, torch_positions(x, 8)))


@pytest.mark.parametrize("shape", [(250, 4096), (64, 128, 3, 3)])
def test_adtopk_uses_the_kernel_on_layer_shapes(shape):
    x = torch.randn(shape)
    k = max(1, math.floor(shape[1] * 0.01))
    assert select._kernel_applies(x, k)
    assert torch.equal(magnitudes(x, select.fibre_topk(x, k)),
                       magnitudes(x, torch_positions(x, k)))


def unfused(ef):
    """The same error-feedback compressor with the fused kernel switched off."""
    ef.base.compress_with_feedback = lambda *args: None
    return ef


@settings(max_examples=80, deadline=None)
@given(lead=st.integers(1, 5), n=st.sampled_from([64, 200, 1024, 4096]),
       rest=st.sampled_from([(), (3,), (2, 3)]), ratio=st.sampled_from([0.01, 0.03, 0.06]),
       name=st.sampled_from(["adtopk", "adtopk-i", "topk"]), layout=st.sampled_from(["axis", "rows"]),
       ties=st.booleans(), dead=st.sampled_from([None, 0.5, 1.0]), seed=st.integers(0, 2**16))
def test_fused_error_feedback_equals_the_three_passes(lead, n, rest, ratio, name, layout, ties, dead,
                                                     seed):
    # compensate + select + residual update in one kernel: same payloads, same residuals, bit for bit
    from adtopk_ps.compression import create
    gen = torch.Generator().manual_seed(seed)
    spec = {"compressor": name, "k": ratio, "ef": "vanilla",
            **({} if name == "topk" else {"layout": layout})}
    fused, plain = create(spec), unfused(create(spec))
    # dead units: the same rows zero at every step (the kernel leaves them out as it writes)
    zero = torch.rand(lead, generator=gen) < (dead or 0)
    for step in range(4):
        g = torch.randn((lead, n, *rest), generator=gen)
        if ties:  # the fused kernel selects like the unfused one, ties included
            g = (g * 2).round()
        g[zero] = 0
        kept = fused.memory.residuals.get("w", torch.zeros_like(g)) + g
        a, b = fused.compress(g, "w", step), plain.compress(g, "w", step)
        assert (a.codec, a.shape, a.view) == (b.codec, b.shape, b.view)
        assert torch.equal(a.values, b.values) and torch.equal(a.indices, b.indices)
        assert (a.rows is None) == (b.rows is None) and (a.rows is None or torch.equal(a.rows, b.rows))
        assert a.rows is None or a.rows.tolist() == torch.nonzero(~zero).view(-1).tolist()
        assert torch.equal(fused.memory.residuals["w"], plain.memory.residuals["w"])
        # what error feedback rests on: what was sent plus what is kept is g + r
        assert torch.equal(a.decompress() + fused.memory.residuals["w"], kept)


def test_fused_path_is_taken_on_layer_shapes():
    from adtopk_ps.compression import create
    ef = create({"compressor": "adtopk", "k": 0.01, "ef": "vanilla"})
    g = torch.randn(250, 4096)
    ef.compress(g, "w")  # the first call creates the residual
    residual = ef.memory.residuals["w"]
    before = residual.clone() + g
    payload = ef.base.compress_with_feedback(g, residual, "w")
    assert payload is not None and payload.values.shape == (250, 40)
    assert torch.equal(payload.decompress() + residual, before)


def test_global_topk_uses_the_kernel_on_a_layer():
    flat = torch.randn(1 << 18)
    k = 1 << 11
    assert select._kernel_applies(flat.view(1, -1), k)
    got, want = select.global_topk(flat, k), flat.abs().topk(k).indices
    assert got.unique().numel() == k
    assert torch.equal(flat[got].abs().sort().values, flat[want].abs().sort().values)


@pytest.mark.parametrize("name", ["topk", "adtopk-i"])
def test_fused_global_turn_is_taken(name):
    # topk on every call, adtopk-i on its odd (global) turns: the whole tensor as one fibre
    from adtopk_ps.compression import create
    ef = create({"compressor": name, "k": 0.01, "ef": "vanilla"})
    g = torch.randn(250, 4096)
    ef.compress(g, "w")  # the first call creates the residual (and is adtopk-i's fibre turn)
    residual = ef.memory.residuals["w"]
    before = residual.clone() + g
    payload = ef.base.compress_with_feedback(g, residual, "w")
    assert payload is not None and payload.codec == "coo" and payload.values.numel() == 10240
    assert torch.equal(payload.decompress() + residual, before)


def test_fused_path_declines_what_it_cannot_do():
    from adtopk_ps.compression import create
    half = create({"compressor": "adtopk", "k": 0.01, "ef": "vanilla", "value_dtype": "fp16"})
    g = torch.randn(64, 1024)
    assert half.base.compress_with_feedback(g, torch.zeros_like(g), "w") is None
    plain = create({"compressor": "adtopk", "k": 0.01})
    r = torch.zeros(64, 1024, dtype=torch.float64)
    assert plain.compress_with_feedback(g.double(), r, "w") is None and not r.any()
