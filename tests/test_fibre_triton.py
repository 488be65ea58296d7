"""The CUDA fibre kernel (Triton) selects, orders and updates exactly as documented and as the
CPU path does: under Triton's interpreter on CPU tensors here, on the GPU where there is one."""
from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

# the interpreter must be chosen before triton is imported; where a GPU exists, this process
# tests the compiled kernel and a subprocess the interpreted one
if importlib.util.find_spec("triton") is not None and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
try:
    import triton  # noqa: F401
except ImportError:
    triton = None

from adtopk_ps import wire  # noqa: E402
from adtopk_ps.compression import create, fibre_triton, select  # noqa: E402
from adtopk_ps.compression.select import live_rows  # noqa: E402
from adtopk_ps.compression.staging import Stage  # noqa: E402

NO_TRITON = "triton is not installed (pip install triton; the kernel is optional)"
INTERPRETED = triton is not None and fibre_triton.interpreted()
interpreter_only = pytest.mark.skipif(not INTERPRETED, reason=NO_TRITON if triton is None else
                                      "runs where TRITON_INTERPRET=1 (a subprocess on GPU machines)")
ROOT = Path(__file__).resolve().parents[1]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture
def cpu_kernel():
    """CPU tensors take the kernel (under the interpreter) instead of select.py."""
    fibre_triton.CPU_TENSORS = True
    yield
    fibre_triton.CPU_TENSORS = False


def reference(x: torch.Tensor, k: int) -> torch.Tensor:
    """Positions [A, k, R] by the documented rule, one fibre at a time in Python: the k
    largest |x| (a NaN as an infinity), lower positions first among equals, ascending."""
    x3 = x.reshape(x.shape[0], x.shape[1], -1).float()
    lead, n, rest = x3.shape
    out = torch.empty(lead, k, rest, dtype=torch.int64)
    for a in range(lead):
        for j in range(rest):
            mag = x3[a, :, j].abs().nan_to_num(nan=math.inf, posinf=math.inf).tolist()
            out[a, :, j] = torch.tensor(sorted(sorted(range(n), key=lambda p: (-mag[p], p))[:k]))
    return out.view(lead, k, *x.shape[2:])


def carried(want: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """``want`` with only the rows a payload carries (None: all)."""
    return want if rows is None else want.index_select(0, rows)


def _frames(payload) -> list:
    """A push of ``payload``, as it goes on the wire."""
    return wire.encode(wire.Op.PUSH, key=1, round=0, sender=0, payload=payload)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit, dtype and shape too; a NaN equals a NaN (the bits of a NaN that
    arithmetic made are the CPU's or the GPU's own, and nothing reads them)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point() and not torch.equal(a.isnan(), b.isnan()):
        return False
    if a.is_floating_point():
        a, b = a.nan_to_num(nan=0.0), b.nan_to_num(nan=0.0)
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def sample(shape, dtype, seed, ties=False, nonfinite=False):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen)
    if ties:  # few distinct magnitudes, signs mixed: the k-th largest is shared
        x = (x * 1.5).round()
    if nonfinite:
        flat = x.view(-1)
        picks = torch.randint(0, flat.numel(), (3,), generator=gen)
        flat[picks[0]], flat[picks[1]], flat[picks[2]] = math.nan, math.inf, -math.inf
    return x.to(dtype)


@interpreter_only
@settings(max_examples=25, deadline=None, phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(dtype=st.sampled_from(DTYPES), lead=st.integers(1, 3), n=st.integers(1, 330),
       rest=st.sampled_from([(), (3,), (2, 2)]), k_pick=st.sampled_from(["1", "2", "density", "any"]),
       density=st.sampled_from([0.01, 0.05, 0.2]), ties=st.booleans(), nonfinite=st.booleans(),
       feedback=st.booleans(), seed=st.integers(0, 2**16))
def test_kernel_follows_the_documented_rule(dtype, lead, n, rest, k_pick, density, ties, nonfinite,
                                            feedback, seed):
    shape = (lead, n, *rest)
    k = {"1": 1, "2": min(2, n), "density": max(1, math.floor(n * density)),
         "any": 1 + seed % n}[k_pick]
    x = sample(shape, dtype, seed, ties, nonfinite)
    grad = sample(shape, dtype, seed + 1, ties) if feedback else None
    target = x.clone()
    compensated = (x + grad) if feedback else x  # torch's own rounding in the dtype
    got = fibre_triton.select([fibre_triton.Item(target, grad, k)], Stage(torch.device("cpu")))[0]
    want = reference(compensated, k)
    chosen = compensated.gather(1, want)
    assert torch.equal(got.rows, live_rows(chosen)) if got.rows is not None else live_rows(chosen) is None
    assert torch.equal(got.indices.long(), carried(want, got.rows))
    assert got.indices.dtype == (torch.uint8 if n <= 256 else torch.uint16)
    assert same_bits(got.values, carried(chosen, got.rows))
    assert same_bits(got.host_values, got.values) and same_bits(got.host_indices, got.indices)
    assert got.nonfinite == (not bool(got.values.float().isfinite().all()))
    if feedback:  # what was sent left the residual exactly, the rest is r + g
        assert same_bits(target, compensated.scatter(1, want, 0.0))
    else:
        assert same_bits(target, x)


def cpu_and_kernel(spec, steps, shape, dtype, seed, ties=False, nonfinite=False):
    """Payloads (and residuals) of the same compressor on the CPU path and in the kernel."""
    plain, kernel = create(spec), create(spec)
    out = []
    for step in range(steps):
        g = sample(shape, dtype, seed + step, ties, nonfinite and step == steps - 1)
        a = plain.compress(g, "w", step)
        fibre_triton.CPU_TENSORS = True
        try:
            b = kernel.compress(g, "w", step)
        finally:
            fibre_triton.CPU_TENSORS = False
        assert a.host is None and b.host is not None  # which path each took
        # the kernel's buffers are reused by the next call: keep a copy
        out.append((a, dataclasses.replace(b, values=b.values.clone(), indices=b.indices.clone(),
                                           host=tuple(t.clone() for t in b.host))))
    residuals = [getattr(c, "memory", None) for c in (plain, kernel)]
    return out, residuals


@interpreter_only
@pytest.mark.parametrize("shape", [(6, 64), (4, 300), (3, 520), (2, 64, 3, 3), (5, 3, 2, 2),
                                   (3, 1000), (8, 17)])
@pytest.mark.parametrize("ties", [False, True])
def test_float32_payloads_equal_the_cpu_ones(shape, ties):
    # the CPU path is the compiled kernel (_fibre.c) here: same entries, same order, same bytes
    if select._fibre is None:
        pytest.skip("the compiled CPU kernel is not built")
    for ef in (None, "vanilla"):
        spec = {"compressor": "adtopk", "k": 0.01, **({"ef": ef} if ef else {})}
        pairs, memories = cpu_and_kernel(spec, 3 if ef else 1, shape, torch.float32, 7, ties,
                                         nonfinite=not ties)
        for a, b in pairs:
            assert (a.codec, a.shape, a.view, a.dtype) == (b.codec, b.shape, b.view, b.dtype)
            assert same_bits(a.values, b.values) and same_bits(a.indices, b.indices)
            assert a.nonfinite == b.nonfinite
            assert [bytes(f) for f in _frames(a)] == [bytes(f) for f in _frames(b)]
        if ef:
            for name in ("w",):
                assert same_bits(memories[0].residuals[name], memories[1].residuals[name])


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16_bit_payloads_hold_the_cpu_selection(dtype, cpu_kernel):
    # the CPU path is torch's selection, whose order (and choice among equal magnitudes) torch
    # does not fix: the same entries where magnitudes are distinct (1..200 in every fibre, exact
    # in both dtypes); the residual updates are checked against torch in the test above
    gen = torch.Generator().manual_seed(4)
    lead, n, rest = 4, 200, 3
    mags = torch.stack([torch.randperm(n, generator=gen) + 1 for _ in range(lead * rest)])
    signs = torch.randint(0, 2, mags.shape, generator=gen) * 2 - 1
    g = (mags * signs).view(lead, rest, n).transpose(1, 2).contiguous().to(dtype)
    for ratio in (0.01, 0.05):
        fibre_triton.CPU_TENSORS = False
        a = create("adtopk", ratio=ratio).compress(g, "w")
        fibre_triton.CPU_TENSORS = True
        b = create("adtopk", ratio=ratio).compress(g, "w")
        assert a.host is None and b.host is not None
        pa, pb = a.indices.long().sort(dim=1), b.indices.long().sort(dim=1)
        assert torch.equal(pa.values, pb.values)
        assert same_bits(a.values.gather(1, pa.indices), b.values.gather(1, pb.indices))
        assert same_bits(a.decompress(), b.decompress())


@interpreter_only
def test_one_call_over_many_tensors_equals_one_call_each():
    # a batch groups tensors by tile into a few launches; every result is what it is alone
    shapes = [((4, 64), 1), ((3, 512), 5), ((2, 70, 3), 2), ((2, 300, 2), 3), ((3, 5), 5)]
    xs = [sample(s, torch.float32, i, ties=i % 2 == 1) for i, (s, _) in enumerate(shapes)]
    grads = [sample(s, torch.float32, 50 + i) for i, (s, _) in enumerate(shapes)]
    batch_r = [x.clone() for x in xs]
    alone_r = [x.clone() for x in xs]
    stage = Stage(torch.device("cpu"))
    batch = fibre_triton.select([fibre_triton.Item(r, g, k) for r, g, (_, k)
                                 in zip(batch_r, grads, shapes)], stage)
    for i, (r, g, (_, k)) in enumerate(zip(alone_r, grads, shapes)):
        alone = fibre_triton.select([fibre_triton.Item(r, g, k)], Stage(torch.device("cpu")))[0]
        assert same_bits(batch[i].values, alone.values)
        assert same_bits(batch[i].indices, alone.indices)
        assert same_bits(batch_r[i], r)


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ties", [False, True])
def test_long_fibres_are_found_segment_by_segment(dtype, ties):
    # a fibre of 17,000 is 9 segments of 2,048 (slots carried from segment to segment);
    # in bfloat16 its 36 keys a thread have the compensated sums written before the keys
    n = 17000
    v = fibre_triton.variant(n, 90, dtype, True)
    assert v.seg == 9 and v.keeps_sums == (dtype == torch.float32)
    x = sample((2, n), dtype, 21, ties=ties)
    grad = sample((2, n), dtype, 22, ties=ties)
    target, compensated = x.clone(), x + grad
    got = fibre_triton.select([fibre_triton.Item(target, grad, 90)], Stage(torch.device("cpu")))[0]
    want = reference(compensated, 90)
    assert torch.equal(got.indices.long(), want) and same_bits(got.values, compensated.gather(1, want))
    assert same_bits(target, compensated.scatter(1, want, 0.0))


@interpreter_only
@pytest.mark.parametrize("n", [768, 3072, 25088, 1568, 520])
@pytest.mark.parametrize("rest", [(), (2,)])
def test_fibres_cut_into_segments_keep_the_rule(n, rest):
    # fibres whose length is not a power of two take segments with little padding (adjacent
    # fibres, and strided ones); the slots run on across segments, so positions ascend
    # over the whole fibre
    seg, bs = fibre_triton.segments(n)
    assert seg > 1 and seg * bs < 1.2 * n
    x = sample((2, n, *rest), torch.float32, n, ties=True)
    target = x.clone()
    k = max(1, n // 100)
    got = fibre_triton.select([fibre_triton.Item(target, None, k)], Stage(torch.device("cpu")))[0]
    want = reference(x, k)
    assert torch.equal(got.indices.long(), want) and same_bits(got.values, x.gather(1, want))


@interpreter_only
def test_one_select_uploads_one_table_for_all_its_launches(monkeypatch):
    # several variants in one call (so several launches) share one table upload: a second
    # upload would rewrite the pinned table while the first launch's copy may be queued
    uploads = []
    real = Stage.table
    monkeypatch.setattr(Stage, "table", lambda self, rows: uploads.append(len(rows)) or real(self, rows))
    items = [fibre_triton.Item(sample((4, 64), torch.float32, 1), None, 1),
             fibre_triton.Item(sample((3, 512), torch.float32, 2), None, 5),
             fibre_triton.Item(sample((2, 40, 3), torch.float32, 3), sample((2, 40, 3), torch.float32, 4), 2)]
    assert len({fibre_triton.variant(i.x.shape[1], i.k, i.x.dtype, i.grad is not None) for i in items}) == 3
    got = fibre_triton.select(items, Stage(torch.device("cpu")))
    assert len(uploads) == 1 and [g.indices.shape[1] for g in got] == [1, 5, 2]


def test_launches_go_to_the_tensors_own_device(monkeypatch):
    # a tensor on cuda:1 with cuda:0 current: the launch is made inside that device's context
    guard = fibre_triton.on_device(torch.device("cuda", 1))
    assert isinstance(guard, torch.cuda.device) and guard.idx == 1
    if not INTERPRETED:
        return
    seen = []
    real = fibre_triton.on_device
    monkeypatch.setattr(fibre_triton, "on_device", lambda device: seen.append(device) or real(device))
    fibre_triton.select([fibre_triton.Item(sample((3, 64), torch.float32, 5), None, 2)],
                        Stage(torch.device("cpu")))
    assert seen == [torch.device("cpu")]


@interpreter_only
def test_a_strided_gradient_is_read_in_place(cpu_kernel):
    # channels_last: the fibres run along the contiguous axis; payloads match the contiguous ones
    g = sample((8, 96, 3, 3), torch.float32, 3)
    a = create("adtopk", ratio=0.03).compress(g, "w")
    b = create("adtopk", ratio=0.03).compress(g.to(memory_format=torch.channels_last), "w")
    assert same_bits(a.values, b.values) and same_bits(a.indices, b.indices)


@interpreter_only
def test_wire_bytes_are_the_host_copy_and_decode_back(cpu_kernel):
    g = sample((16, 300), torch.float32, 5)
    comp = create("adtopk", ratio=0.01)
    p = comp.compress(g, "w")
    frames = _frames(p)
    assert bytes(frames[1]) == p.values.numpy().tobytes()
    assert bytes(frames[2]) == p.indices.numpy().tobytes()
    q = wire.decode(frames).payload
    assert same_bits(q.decompress(), p.decompress())
    # the buffers are reused: the next call on the same name writes the same memory
    p2 = comp.compress(g * 2, "w")
    assert p2.host[0].data_ptr() == p.host[0].data_ptr()


@interpreter_only
def test_dead_rows_are_left_out_as_on_the_cpu_path():
    # rows whose selection is all zeros (dead units) travel on neither path; a server round
    # of one payload of each sums exactly
    from server.aggregator import Aggregator
    g = sample((12, 300, 2), torch.float32, 9)
    g[[0, 5, 6]] = 0
    spec = {"compressor": "adtopk", "k": 0.01, "ef": "vanilla"}
    a = create(spec).compress(g, "w")
    fibre_triton.CPU_TENSORS = True
    try:
        b = create(spec).compress(g, "w")
    finally:
        fibre_triton.CPU_TENSORS = False
    assert b.host is not None and a.rows.tolist() == b.rows.tolist() == [1, 2, 3, 4, 7, 8, 9, 10, 11]
    assert b.host[0].shape == b.values.shape == (9, 3, 2)
    decoded = [wire.decode([bytes(f) for f in _frames(p)]).payload for p in (a, b)]
    assert same_bits(decoded[0].decompress(), decoded[1].decompress())
    agg = Aggregator(2)
    agg.push(1, 0, 0, decoded[1], owned=True)
    assert torch.equal(agg.push(1, 0, 1, decoded[0], owned=True).decompress(), a.decompress() * 2)


@interpreter_only
@pytest.mark.parametrize("ef", ["vanilla", "none"])
def test_refill_sizes_the_next_call_as_on_the_cpu_path(cpu_kernel, ef):
    # a third of the rows dead: the kernel's second call keeps 4 entries per row, not 3
    # (floor(300 x 0.01 x 12 / 8)), as the CPU path's does, and selects the same
    g = sample((12, 300, 2), torch.float32, 4)
    g[[0, 5, 6, 9]] = 0
    spec = {"compressor": "adtopk", "k": 0.01, "ef": ef, "refill": True}
    kernel = create(spec)
    payloads = [kernel.compress(g, "w") for _ in range(2)]
    fibre_triton.CPU_TENSORS = False
    cpu = create(spec)
    expected = [cpu.compress(g, "w") for _ in range(2)]
    assert payloads[0].host is not None and payloads[1].values.shape == (8, 4, 2)
    for got, want in zip(payloads, expected):
        assert got.values.shape == want.values.shape
        assert same_bits(got.decompress(), want.decompress())


@interpreter_only
def test_a_batch_reads_each_items_dead_rows_and_flags_as_its_own(cpu_kernel):
    # one reduction reads every item's live bytes, another every item's flags: dead rows and
    # a NaN in the first and last items stay theirs, the items between keep every row
    shapes = [(6, 40), (5, 300, 2), (4, 64, 3), (7, 33)]
    grads = [sample(shape, torch.float32, 20 + i) for i, shape in enumerate(shapes)]
    grads[0][[1, 4]] = 0
    grads[3][[0, 6]] = 0
    grads[3][2, 5] = math.nan
    got = fibre_triton.select([fibre_triton.Item(g.clone(), None, 2) for g in grads],
                              Stage(torch.device("cpu")))
    assert [s.rows.tolist() if s.rows is not None else None for s in got] == \
        [[0, 2, 3, 5], None, None, [1, 2, 3, 4, 5]]
    assert [s.nonfinite for s in got] == [False, False, False, True]
    for g, s in zip(grads, got):
        assert torch.equal(s.indices.long(), carried(reference(g, 2), s.rows))


@settings(max_examples=200, deadline=None)
@given(shape=st.lists(st.integers(1, 4), min_size=2, max_size=5), data=st.data())
def test_trailing_axes_merge_as_view_merges_them(shape, data):
    # the kernel's strides come from sizes and strides alone; a view is the judge
    order = data.draw(st.permutations(range(len(shape))))
    x = torch.empty([shape[i] for i in order]).permute([order.index(i) for i in range(len(shape))])
    if data.draw(st.booleans()):
        x = x[:, :, ::2] if x.dim() > 2 else x[:, ::2]
    try:
        view = x.view(x.shape[0], x.shape[1], math.prod(x.shape[2:]))
    except RuntimeError:
        view = None
    merged = fibre_triton._merged(x.shape, x.stride())
    assert (merged is None) == (view is None)
    if view is not None:  # an axis of size 1 is read at 0 alone: any stride will do
        assert all(size == 1 or mine == theirs
                   for size, mine, theirs in zip(view.shape, merged, view.stride()))


@interpreter_only
def test_what_the_kernel_does_not_take_goes_the_cpu_way(cpu_kernel):
    # fibres past MAX_N, trailing axes that do not merge without a copy: select.py's path,
    # with the same selection
    long = sample((2, fibre_triton.MAX_N + 1), torch.float32, 11)
    odd = sample((6, 40, 4, 3), torch.float32, 12).transpose(2, 3)  # (6, 40, 3, 4), not mergeable
    assert fibre_triton.refusal(long) == f"fibres of {fibre_triton.MAX_N + 1} entries are longer than {fibre_triton.MAX_N}"
    assert fibre_triton.refusal(odd) == "its trailing axes cannot be viewed as one without a copy"
    for g in (long, odd):
        p = create("adtopk", ratio=0.05).compress(g, "w")
        assert p.host is None  # the kernel's payloads carry their host copy
        assert torch.equal(p.indices.long(), carried(reference(g, p.indices.shape[1]), p.rows))
    assert fibre_triton.variant(fibre_triton.MAX_N + 1, 5, torch.float32, False) is None
    assert fibre_triton.variant(25088, 250, torch.float32, True).fb == 1


def test_bad_input_is_refused_by_name():
    if triton is None:
        pytest.skip(NO_TRITON)
    stage = Stage(torch.device("cpu"))
    with pytest.raises(ValueError, match="k=0 outside"):
        fibre_triton.select([fibre_triton.Item(torch.zeros(2, 4), None, 0)], stage)
    with pytest.raises(ValueError, match="grad"):
        fibre_triton.select([fibre_triton.Item(torch.zeros(2, 4), torch.zeros(2, 5), 1)], stage)
    with pytest.raises(ValueError, match="float64"):
        fibre_triton.select([fibre_triton.Item(torch.zeros(2, 4, dtype=torch.float64), None, 1)],
                            stage)
    # an item checked on its own is still held to the batch's dtype and device
    fibre_triton.CPU_TENSORS = True
    try:
        half = fibre_triton.item(torch.zeros(2, 4, dtype=torch.float16), None, 1)
        single = fibre_triton.item(torch.zeros(2, 4), None, 1)
        assert half is not None and single is not None
        with pytest.raises(ValueError, match="every tensor must be torch.float32"):
            fibre_triton.launch([single, half], stage)
    finally:
        fibre_triton.CPU_TENSORS = False


@interpreter_only
def test_item_is_none_where_the_kernel_does_not_take_it(cpu_kernel):
    x = torch.zeros(6, 40, 4, 3)
    assert fibre_triton.item(x, None, 3) is not None
    assert fibre_triton.item(x, torch.zeros(6, 40, 4, 3), 3).read.variant.feedback
    for refused in [(x.transpose(2, 3), None, 3), (x, None, 0), (x, None, 41),
                    (x, torch.zeros(6, 40, 12), 3), (x.double(), None, 3), (torch.zeros(0, 40), None, 3),
                    (torch.zeros(2, fibre_triton.MAX_N + 1), None, 3)]:
        assert fibre_triton.item(*refused) is None
    fibre_triton.CPU_TENSORS = False
    assert fibre_triton.item(x, None, 3) is None  # a CPU tensor: select.py's path


def test_cpu_tensors_keep_the_cpu_path(device):
    # the kernel is for CUDA tensors; CPU ones go through select.py as before
    g = sample((8, 512), torch.float32, 1).to(device)
    p = create("adtopk", ratio=0.01).compress(g, "w")
    assert (p.host is not None) == (device.type == "cuda" and triton is not None)
    assert not fibre_triton.applies(g.cpu())


@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETED or triton is None,
                    reason="needs a CUDA device and triton (compiled, not interpreted)")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(64, 3, 7, 7), (64, 64, 3, 3), (256, 512, 1, 1), (512, 2048),
                                   (300, 3072), (64, 25088), (1000, 2048), (17, 1)])
def test_cuda_payloads_equal_the_cpu_ones(shape, dtype):
    # float32: the CPU path is _fibre.c, matched bit for bit, ties included; 16-bit: torch's
    # selection on the CPU, whose choice among ties is its own, so the same magnitudes
    spec = {"compressor": "adtopk", "k": 0.01, "ef": "vanilla"}
    cpu, gpu = create(spec), create(spec)
    for step in range(3):
        g = sample(shape, dtype, 100 + step, ties=step == 1)
        before = gpu.memory.residuals["w"].clone() + g.cuda() if step else g.cuda()
        a, b = cpu.compress(g, "w", step), gpu.compress(g.cuda(), "w", step)
        assert b.host is not None and b.values.is_cuda and a.nonfinite == b.nonfinite
        assert same_bits(b.host[0], b.values.cpu()) and same_bits(b.host[1], b.indices.cpu())
        if dtype == torch.float32:
            assert same_bits(a.values, b.values.cpu()) and same_bits(a.indices, b.indices.cpu())
            assert [bytes(f) for f in _frames(a)] == [bytes(f) for f in _frames(b)]
            assert same_bits(cpu.memory.residuals["w"], gpu.memory.residuals["w"].cpu())
        else:
            assert torch.equal(a.values.abs().sort(dim=1).values,
                               b.values.abs().sort(dim=1).values.cpu())
        # what was sent plus what is kept is g + r, exactly
        assert same_bits(b.decompress() + gpu.memory.residuals["w"], before)


@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETED or triton is None,
                    reason="needs a CUDA device and triton (compiled, not interpreted)")
def test_cuda_batch_equals_the_cpu_calls():
    # the engine's path on a GPU: every tensor of a step in one start() (one launch a
    # variant, a stage of the pool), float32 payloads and residuals equal to the CPU's calls
    from adtopk_ps.compression import Request
    shapes = [(64, 3, 7, 7), (64, 64, 3, 3), (256, 512, 1, 1), (512, 2048), (300, 3072), (64, 25088)]
    spec = {"compressor": "adtopk", "k": 0.01, "ef": "vanilla"}
    cpu, gpu = create(spec), create(spec)
    for step in range(4):
        grads = [sample(s, torch.float32, 10 * step + i, ties=step == 2) for i, s in enumerate(shapes)]
        names = [f"t{i}" for i in range(len(shapes))]
        got = list(gpu.start([Request(g.cuda(), n, step) for g, n in zip(grads, names)]))
        for g, n, b in zip(grads, names, got):
            a = cpu.compress(g, n, step)
            assert b.host is not None
            assert same_bits(a.values, b.values.cpu()) and same_bits(a.indices, b.indices.cpu())
            assert same_bits(cpu.memory.residuals[n], gpu.memory.residuals[n].cpu())
            gpu.restore(None, n)


@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETED or triton is None,
                    reason="on GPU machines the interpreted tests run in a subprocess")
def test_interpreted_tests_pass_in_a_subprocess():
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", str(Path(__file__)),
                          "-p", "no:cacheprovider"], cwd=ROOT, capture_output=True, text=True,
                         timeout=600, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert out.returncode == 0, out.stdout[-3000:]


@interpreter_only
def test_empty_tensors_keep_the_cpu_path(cpu_kernel):
    p = create("adtopk", ratio=0.01).compress(torch.zeros(4, 0, 3), "w")
    assert p.host is None and p.values.shape == (4, 0, 3)


@interpreter_only
def test_a_batch_is_one_launch_and_equals_one_call_each(cpu_kernel, monkeypatch):
    # the engine hands every tensor ready at once to one start(): the kernel's tensors go in
    # one launch() (one kernel launch per variant), each payload as one call's, residuals too
    from adtopk_ps.compression import Request
    shapes = [(16, 300), (8, 64, 3, 3), (4, 512), (6, 40, 4, 3)]
    dtypes = [torch.float32, torch.bfloat16, torch.float32, torch.float16]  # a launch a dtype
    steps = [[sample(s, d, 10 * t + i) for i, (s, d) in enumerate(zip(shapes, dtypes))] for t in range(3)]
    batched, alone = create("adtopk", ratio=0.05, ef="vanilla"), create("adtopk", ratio=0.05, ef="vanilla")
    launches, counting = [], []
    real = fibre_triton.launch
    monkeypatch.setattr(fibre_triton, "launch", lambda items, stage: (
        counting and launches.append(len(items))) or real(items, stage))
    for t, grads in enumerate(steps):
        names = [f"t{i}" for i in range(len(grads))]
        counting.append(True)
        got = list(batched.start([Request(g, n, t) for g, n in zip(grads, names)]))
        counting.clear()
        want = [alone.compress(g, n, t) for g, n in zip(grads, names)]
        for p, q in zip(got, want):
            assert same_bits(p.values, q.values) and torch.equal(p.indices, q.indices)
            assert (p.rows is None) == (q.rows is None)
        for n in names:
            assert same_bits(batched.memory.residuals[n], alone.memory.residuals[n])
            batched.restore(None, n)
    # a launch a step for each dtype, step 0 too (its residuals start at zero)
    assert launches == [2, 1, 1] * 3, launches
    # a stage for each dtype's batch, reused step after step
    assert len(batched.base._stages) == 3


@interpreter_only
@pytest.mark.parametrize("ef", ["none", "vanilla"])
def test_a_batch_is_refused_before_anything_runs(cpu_kernel, ef):
    # a tensor named twice (the second call would overwrite the first's staging) or one
    # without fibres: refused at start(), every residual as it was
    from adtopk_ps.compression import Request
    comp = create("adtopk", ratio=0.1, ef=ef)
    a = sample((8, 64), torch.float32, 1)
    comp.compress(a, "a")
    kept = {n: r.clone() for n, r in comp.memory.residuals.items()} if ef == "vanilla" else {}
    with pytest.raises(ValueError, match=r"names \['a'\] more than once"):
        comp.start([Request(a, "a", 1), Request(a * 2, "a", 1)])
    with pytest.raises(ValueError, match="dim\\(\\) >= 2.*'z'"):
        comp.start([Request(a, "a", 1), Request(torch.ones(5), "z", 1)])
    assert kept.keys() == (comp.memory.residuals.keys() if ef == "vanilla" else set())
    for n, r in kept.items():
        assert same_bits(comp.memory.residuals[n], r)
