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


def test_all_zero_fibres_give_distinct_positions():
    got = select.fibre_topk(torch.zeros(3, 1024), 16)
    assert all(len(set(row)) == 16 for row in got.tolist())


@pytest.mark.parametrize("shape", [(250, 4096), (64, 128, 3, 3)])
def test_adtopk_uses_the_kernel_on_layer_shapes(shape):
    x = torch.randn(shape)
    k = max(1, math.floor(shape[1] * 0.01))
    assert select._kernel_applies(x, k)
    assert torch.equal(magnitudes(x, select.fibre_topk(x, k)),
                       magnitudes(x, torch_positions(x, k)))
