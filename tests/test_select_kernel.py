"""The fibre selections follow select.py's rule: the compiled kernel (_fibre.c) exactly, ties
included, and torch's selections wherever the keys at the k-th are distinct; every path writes
its positions in ascending order."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from adtopk_ps.compression import select
from strategies import rule_positions

INF, NAN = float("inf"), float("nan")


def test_kernel_is_built():
    # the install compiles it; a missing compiler would silently cost the speed-up
    assert select._fibre is not None


def torch_positions(x: torch.Tensor, k: int) -> torch.Tensor:
    kernel, select._fibre = select._fibre, None
    try:
        return select.fibre_topk(x, k)
    finally:
        select._fibre = kernel


def keys(x: torch.Tensor) -> torch.Tensor:
    return x.abs().nan_to_num(nan=INF, posinf=INF)


@st.composite
def fibres(draw, max_n: int = 700) -> torch.Tensor:
    """[lead, n, *rest] float32 gradients: random, or with many ties, zeros (dead rows too),
    NaN and infinities, and signed zeros."""
    lead = draw(st.integers(1, 5))
    n = draw(st.one_of(st.integers(1, 40), st.integers(41, max_n)))
    rest = draw(st.sampled_from([(), (1,), (3,), (2, 3), (5,)]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    x = torch.randn((lead, n, *rest), generator=gen)
    kind = draw(st.sampled_from(["random", "rounded", "few", "sparse", "nonfinite"]))
    if kind == "rounded":  # the k-th largest is shared by many entries
        x = (x * draw(st.sampled_from([1, 2, 8]))).round()
    elif kind == "few":  # a handful of magnitudes, and -0.0 ties with 0.0
        x = torch.tensor([-1.0, -0.5, -0.0, 0.0, 0.5, 1.0])[torch.randint(0, 6, x.shape, generator=gen)]
    elif kind == "sparse":
        x = x * (torch.rand(x.shape, generator=gen) < 0.02)
    elif kind == "nonfinite":  # NaN ties with an infinity of either sign
        u = torch.rand(x.shape, generator=gen)
        x[u < 0.01] = NAN
        x[(u >= 0.01) & (u < 0.02)] = INF
        x[(u >= 0.02) & (u < 0.03)] = -INF
    if draw(st.booleans()):  # dead units: whole rows of zeros
        x[torch.rand(lead, generator=gen) < 0.4] = 0
    return x


def pick_k(draw, n: int) -> int:
    return draw(st.one_of(st.sampled_from([1, 2, 3]), st.integers(1, max(1, n // 16)),
                          st.integers(1, n + 2)))


@settings(max_examples=300)
@given(data=st.data())
def test_kernel_follows_the_rule(data):
    x = data.draw(fibres())
    k = pick_k(data.draw, x.shape[1])
    got = select.fibre_topk(x, k)
    assert got.dtype == torch.int64
    assert torch.equal(got, rule_positions(x, k))


@settings(max_examples=200)
@given(residual=fibres().filter(lambda x: x.shape[1] > 1), data=st.data(),
       live_only=st.booleans(), zero_grad=st.booleans())
def test_fused_feedback_follows_the_rule(residual, data, live_only, zero_grad):
    k = data.draw(st.integers(1, residual.shape[1] - 1))
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    grad = torch.zeros_like(residual) if zero_grad else \
        (torch.randn(residual.shape, generator=gen) * 2).round()
    total = residual + grad  # what error feedback selects in
    positions, values, rows = select.fibre_topk_feedback(residual, grad, k, live_only=live_only)
    want = rule_positions(total, k)
    sent = total.gather(1, want)
    kept = total.scatter(1, want, 0.0)  # what was sent leaves the residual exactly
    assert torch.equal(residual.view(torch.int32), kept.view(torch.int32))  # NaN, -0.0 too
    live = sent.flatten(1).ne(0).any(1)  # a NaN counts as nonzero
    if live_only and not bool(live.all()):  # rows that send only zeros are left out
        assert rows is not None and rows.tolist() == live.nonzero().view(-1).tolist()
        want, sent = want[rows], sent[rows]
    else:
        assert rows is None
    assert torch.equal(positions, want)
    assert torch.equal(values.view(torch.int32), sent.view(torch.int32))


def test_a_nan_past_the_groups_ties_with_the_infinities():
    # n = 109, k = 3: groups of 8 cover positions 0..103 and the rest are read one by one.
    # The k-th largest group maximum is inf, so a NaN at 107 ties with the infinities and
    # loses to the lower ones, as it does inside the groups.
    x = torch.randn(1, 109)
    x[0, [8, 69, 94, 99]] = INF
    x[0, 107] = NAN
    assert select.fibre_topk(x, 3)[0].tolist() == [8, 69, 94]
    assert torch.equal(select.fibre_topk(x, 5), rule_positions(x, 5))
    positions, _, _ = select.fibre_topk_feedback(x.clone(), torch.zeros_like(x), 3)
    assert positions[0].tolist() == [8, 69, 94]


def test_ties_go_to_the_lower_position_not_the_search_order():
    # n = 1024 and k = 16: the kernel reads strided groups (position r*64 + j in group j).
    # Fifteen entries of 10 fill 8 groups, so the 16th largest entry (5, at 66 in group 2 and
    # at 3 in group 3) is above the 16th largest group maximum: the tie is decided among the
    # candidates, which a group-by-group scan meets 66 first. The rule takes 3.
    x = torch.rand(1, 1024) * 0.5
    ten = [r * 64 + j for j in range(10, 17) for r in (0, 1)] + [17]
    x[0, ten] = 10.0
    x[0, [66, 3]] = 5.0
    got = select.fibre_topk(x, 16)
    assert got[0].tolist() == sorted(ten + [3])
    positions, _, _ = select.fibre_topk_feedback(x.clone(), torch.zeros_like(x), 16)
    assert positions[0].tolist() == sorted(ten + [3])


def test_positions_are_ascending_on_layer_shapes():
    # the search meets candidates group by group; what it writes is in position order
    for shape, k in [((64, 4096), 40), ((32, 512, 3, 3), 5), ((8, 100), 2), ((2, 1 << 16), 600)]:
        x = torch.randn(shape)
        got = select.fibre_topk(x, k)
        assert bool((got.diff(dim=1) > 0).all())
        assert torch.equal(got, rule_positions(x, k))
        assert torch.equal(keys(x).gather(1, got).sort(dim=1).values,
                           keys(x).topk(k, dim=1).values.sort(dim=1).values)


@pytest.mark.parametrize("shape,k", [((19, 100), 1), ((19, 256), 2), ((64, 64, 3, 3), 1),
                                     ((5, 200, 7), 2), ((5, 200, 2), 2)])
def test_streamed_fibres_follow_the_rule(shape, k):
    # k <= 2 streams fibres side by side: a slab's fibres, or a row as its 4 residue classes
    x = (torch.randn(shape) * 2).round()
    assert torch.equal(select.fibre_topk(x, k), rule_positions(x, k))
    x.select(1, 7).fill_(-INF)
    x.select(1, 3).fill_(NAN)  # ties with the infinity at 7, and comes first
    assert torch.equal(select.fibre_topk(x, k), rule_positions(x, k))
    assert bool(select.fibre_topk(x, k).eq(3).sum(dim=1).eq(1).all())
    ties = select.fibre_topk(torch.full(shape, -2.0), k)
    assert torch.equal(ties, torch.arange(k).view(1, k, *[1] * (len(shape) - 2)).expand(ties.shape))


def test_ties_at_the_threshold_fill_in_by_position():
    # fewer than k entries above the k-th largest group maximum: the rest are its ties, the
    # first by position, wherever they lie (groups or the tail past the last whole group),
    # merged in order; zero rows (a dead unit's gradient) are all ties
    x = torch.zeros(4, 1030)
    x[1, [3, 600, 1027]] = torch.tensor([-5.0, 4.0, 6.0])
    x[2, 1024:] = 3.0  # 6 ties in the tail, and 2 in the groups
    x[2, [10, 700]] = -3.0
    x[3] = torch.randn(1030)
    got = select.fibre_topk(x, 8)
    assert got[0].tolist() == list(range(8))
    assert got[1].tolist() == [0, 1, 2, 3, 4, 5, 600, 1027]
    assert got[2].tolist() == [10, 700, *range(1024, 1030)]
    assert torch.equal(got, rule_positions(x, 8))


def test_every_share_of_a_float32_fibre_takes_the_kernel():
    # so that every float32 selection is exact, ties included, as the CUDA kernel's is
    x = torch.randn(3, 64, 2).round()
    assert select._kernel_applies(x)
    for k in (1, 2, 4, 5, 17, 40, 63):
        assert torch.equal(select.fibre_topk(x, k), rule_positions(x, k))
    assert not select._kernel_applies(x.transpose(0, 2))
    assert not select._kernel_applies(x.double())


@st.composite
def distinct_fibres(draw) -> torch.Tensor:
    """Fibres whose magnitudes are distinct (small integers, exact in every float dtype), where
    torch's selections must select what the rule selects."""
    lead, n = draw(st.integers(1, 4)), draw(st.integers(2, 1500))
    rest = draw(st.sampled_from([(), (3,), (2, 2)]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    fibre_count = lead * math.prod(rest)
    mags = torch.stack([torch.randperm(n, generator=gen) for _ in range(fibre_count)]) + 1
    signs = torch.randint(0, 2, mags.shape, generator=gen) * 2 - 1
    return (mags * signs).view(lead, *rest, n).movedim(-1, 1).contiguous()


@settings(max_examples=150)
@given(x=distinct_fibres(), path=st.sampled_from(["float64", "float16", "bfloat16", "strided",
                                                  "no compiler"]),
       share=st.sampled_from([1, 2, "1%", "5%", "30%", "any"]), seed=st.integers(0, 2**16))
def test_torch_selections_follow_the_rule_where_magnitudes_are_distinct(x, path, share, seed):
    n = x.shape[1]
    if path == "bfloat16" and n > 256:
        x = x.clamp(-256, 256)  # keep magnitudes exact: ties at 256 (and only those) are allowed
    k = {1: 1, 2: 2, "1%": max(1, n // 100), "5%": max(1, n // 20), "30%": max(1, n * 3 // 10),
         "any": 1 + seed % n}[share]
    if path in ("float64", "float16", "bfloat16"):
        got = select.fibre_topk(x.to(getattr(torch, path)), k)
    elif path == "strided":
        strided = torch.stack([x, x], dim=-1)[..., 0]
        assert not select._kernel_applies(strided)
        got = select.fibre_topk(strided, k)
    else:
        got = torch_positions(x, k)
    want = rule_positions(x, k)
    assert bool((got.diff(dim=1) > 0).all())  # ascending, distinct
    if path == "bfloat16" and n > 256:  # the same magnitudes, whichever tie at 256 was taken
        assert torch.equal(keys(x).gather(1, got).sort(dim=1).values,
                           keys(x).gather(1, want).sort(dim=1).values)
    else:
        assert torch.equal(got, want)


@settings(max_examples=80)
@given(x=fibres(max_n=300), dtype=st.sampled_from([torch.float64, torch.float16, torch.bfloat16]),
       k=st.integers(1, 40))
def test_torch_selections_with_ties_keep_the_largest_in_order(x, dtype, k):
    # among equal keys torch's choice is its own: the same keys, and positions in order
    x = x.to(dtype)
    got = select.fibre_topk(x, k)
    want = rule_positions(x, k)
    assert got.shape == want.shape and bool((got.diff(dim=1) > 0).all())
    assert torch.equal(keys(x.double()).gather(1, got).sort(dim=1).values,
                       keys(x.double()).gather(1, want).sort(dim=1).values)


def test_one_per_fibre_takes_the_lower_of_a_max_and_min_tie():
    x = torch.tensor([[1.0, -3.0, 3.0, 2.0], [1.0, 3.0, -3.0, 2.0], [0.0, -0.0, 0.0, 0.0]])
    for dtype in (torch.float32, torch.float64, torch.float16):
        assert select.fibre_topk(x.to(dtype), 1).view(-1).tolist() == [1, 1, 0]
    assert torch_positions(x, 1).view(-1).tolist() == [1, 1, 0]


def unfused(ef):
    """The same error-feedback compressor with the fused kernel switched off."""
    ef.base.compress_with_feedback = lambda *args: None
    return ef


@settings(max_examples=80)
@given(lead=st.integers(1, 5), n=st.sampled_from([64, 200, 1024, 4096]),
       rest=st.sampled_from([(), (3,), (2, 3)]), ratio=st.sampled_from([0.01, 0.03, 0.06, 0.2]),
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
    assert bool((payload.indices.long().diff(dim=1) > 0).all())
    assert torch.equal(payload.decompress() + residual, before)


def test_global_topk_uses_the_kernel_on_a_layer():
    flat = torch.randn(1 << 18).round()  # many ties at the k-th
    k = 1 << 11
    assert select._kernel_applies(flat.view(1, -1))
    got = select.global_topk(flat, k)
    key = keys(flat)
    want = sorted(sorted(range(flat.numel()), key=lambda p: (-float(key[p]), p))[:k])
    assert got.tolist() == want


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
