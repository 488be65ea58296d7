"""Random-k's shared draw: the same positions on every device, from exact integer arithmetic
that a pure-Python reference reproduces; distinct, in range, and evenly spread."""
import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from adtopk_ps.compression import create
from adtopk_ps.core.seeded import seed_for, seed_keys, seeded_indices, seeded_values

M32, M64 = (1 << 32) - 1, (1 << 64) - 1
PROGRAMS = Path(__file__).parent / "programs"


def reference(seed: int, numel: int, k: int) -> list[int]:
    """The documented draw, one Python integer at a time."""
    z = (seed + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    z ^= z >> 31
    key0, key1 = z & M32, z >> 32

    def lowbias32(x):
        x ^= x >> 16
        x = (x * 0x7FEB352D) & M32
        x ^= x >> 15
        x = (x * 0x846CA68B) & M32
        return x ^ (x >> 16)

    out = []
    for i in range(k):
        start, end = i * numel // k, (i + 1) * numel // k
        h = lowbias32(lowbias32(i ^ key0) ^ key1)
        out.append(start + h * (end - start) // 2**32)
    return out


@st.composite
def draws(draw):
    numel = draw(st.one_of(st.integers(1, 3000), st.integers(3000, 10**9)))
    k = draw(st.integers(1, min(numel, 400)))
    return draw(st.integers(0, M64)), numel, k


@settings(max_examples=200, deadline=None)
@given(draws())
def test_matches_the_reference(case):
    seed, numel, k = case
    got = seeded_indices(seed, numel, k, "cpu")
    assert got.dtype == torch.int64 and got.tolist() == reference(seed, numel, k)


@pytest.mark.parametrize("numel,k", [(2**40 + 3, 3), (2**46 + 12345, 2), (2**33, 1)])
def test_strata_wider_than_2_to_31_match_the_reference(numel, k):
    # the torch path switches to split arithmetic there; the kernel always uses it
    for seed in (0, 1, M64):
        assert seeded_indices(seed, numel, k, "cpu").tolist() == reference(seed, numel, k)


@settings(max_examples=200, deadline=None)
@given(draws())
def test_distinct_increasing_and_in_range(case):
    seed, numel, k = case
    got = seeded_indices(seed, numel, k, "cpu")
    assert got.numel() == k
    assert int(got[0]) >= 0 and int(got[-1]) < numel
    assert bool((got[1:] > got[:-1]).all())


def test_edges():
    assert seeded_indices(1, 0, 0, "cpu").numel() == 0
    assert seeded_indices(1, 10, 0, "cpu").numel() == 0
    assert seeded_indices(1, 10, 10, "cpu").tolist() == list(range(10))
    for seed, numel, k, words in [(-1, 10, 1, "seed must be"), (2**64, 10, 1, "seed must be"),
                                  (True, 10, 1, "seed must be"), (1, 10, 11, "k 11 outside"),
                                  (1, 10, -1, "k -1 outside"), (1, 2**47, 1, "numel")]:
        with pytest.raises(ValueError, match=words):
            seeded_indices(seed, numel, k, "cpu")


def test_keys_depend_on_every_seed_bit():
    keys = {seed_keys(1 << b) for b in range(64)} | {seed_keys(0)}
    assert len(keys) == 65


@pytest.mark.parametrize("numel,k", [(1000, 10), (1003, 10), (997, 31)])
def test_each_position_is_drawn_as_often_as_its_stratum_says(numel, k):
    # over the seeds random-k uses for one tensor across steps, a position's count follows
    # 1/len(its stratum); a chi-square over all positions stays near its degrees of freedom
    steps = 3000
    counts = torch.zeros(numel, dtype=torch.float64)
    for step in range(steps):
        counts[seeded_indices(seed_for("layer", step), numel, k, "cpu")] += 1
    bounds = [i * numel // k for i in range(k + 1)]
    expected = torch.cat([torch.full((b - a,), steps / (b - a), dtype=torch.float64)
                          for a, b in itertools.pairwise(bounds)])
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    dof = numel - k  # each stratum's counts sum to `steps`
    assert abs(chi2 - dof) < 6 * (2 * dof) ** 0.5, (chi2, dof)


def test_consecutive_steps_draw_independently():
    # two steps' positions coincide about as often as independent draws would: k/stride
    numel, k, steps = 10_000, 100, 500
    draws = [seeded_indices(seed_for("w", s), numel, k, "cpu") for s in range(steps)]
    same = sum(int((a == b).sum()) for a, b in itertools.pairwise(draws))
    expected = (steps - 1) * k / (numel // k)
    assert abs(same - expected) < 6 * expected ** 0.5, (same, expected)


@pytest.mark.parametrize("numel,k", [(1, 1), (4097, 41), (250_000, 2_500), (2**40 + 3, 3)])
def test_same_positions_on_every_device(device, numel, k):
    for seed in (0, 77, M64):
        got = seeded_indices(seed, numel, k, device)
        assert got.device.type == device.type
        assert torch.equal(got.cpu(), seeded_indices(seed, numel, k, "cpu"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_values_gathered_on_the_device_are_the_cpu_ones(device, dtype):
    flat = torch.randn(100_003, generator=torch.Generator().manual_seed(3)).to(dtype)
    for seed, k in ((5, 1000), (6, 1), (7, 100_003)):
        got = seeded_values(seed, flat.to(device), k)
        assert got.device.type == device.type and got.dtype == dtype
        assert torch.equal(got.cpu(), flat[seeded_indices(seed, flat.numel(), k, "cpu")])
    strided = flat.to(device)[::3]  # a non-contiguous 1-D view
    want = flat[::3][seeded_indices(9, strided.numel(), 50, "cpu")]
    assert torch.equal(seeded_values(9, strided, 50).cpu(), want)


def test_randomk_payload_decodes_to_the_drawn_entries(device):
    x = torch.randn(64, 3, 3, 3, generator=torch.Generator().manual_seed(1)).to(device)
    comp = create("randomk", ratio=0.05, seed=4)
    p = comp.compress(x, "conv", step=9)
    pos = seeded_indices(seed_for("conv", 9, 4), x.numel(), p.count, "cpu")
    assert torch.equal(p.values.cpu(), x.cpu().reshape(-1)[pos])
    back = p.decompress().cpu().reshape(-1)
    assert torch.equal(back[pos], x.cpu().reshape(-1)[pos]) and int((back != 0).sum()) == p.count


def test_kernel_matches_torch_under_the_triton_interpreter():
    pytest.importorskip("triton")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)}
    out = subprocess.run([sys.executable, str(PROGRAMS / "seeded_interpret.py")], env=env,
                         capture_output=True, text=True, timeout=240, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count(" same") == 8, out.stdout
