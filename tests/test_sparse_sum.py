"""The compiled sparse sum (server/_sparse_sum.c) answers exactly what the torch path answers."""
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from adtopk_ps.compression import create
from adtopk_ps.core.payload import Payload
from server import sparse_sum
from server.aggregator import Aggregator, PushRejected


def test_kernel_is_built():
    # the install compiles it; a missing compiler would silently cost the speed-up
    assert sparse_sum._sparse_sum is not None


@st.composite
def pushes(draw, shape):
    """One worker's sparse push: ADTopk of small integers (sums often cancel to zero), or a
    COO push whose positions may repeat and whose values may be zero."""
    seed = draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)
    if draw(st.booleans()):
        grad = torch.randint(-2, 3, shape, generator=gen).float()
        grad[torch.rand(shape[0], generator=gen) < 0.4] = 0  # dead units: rows left out
        return create("adtopk", ratio=draw(st.sampled_from([0.1, 0.3]))).compress(grad, "t")
    numel = torch.Size(shape).numel()
    count = draw(st.integers(0, numel))
    dtype = draw(st.sampled_from([torch.uint8, torch.uint16, torch.int32, torch.int64]))
    bound = min(numel, 256) if dtype == torch.uint8 else numel
    positions = torch.randint(0, bound, (count,), generator=gen).to(dtype)
    values = torch.randint(-2, 3, (count,), generator=gen).float()
    return Payload("coo", tuple(shape), torch.float32, values, positions)


@settings(max_examples=120, deadline=None)
@given(st.data(), st.integers(1, 4), st.integers(1, 4), st.sampled_from([(8, 30), (4, 12, 3), (3, 5, 2, 2)]))
def test_compiled_rounds_equal_the_torch_path_and_leave_clean_buffers(data, workers, rounds, shape):
    compiled = Aggregator(workers)
    plain = Aggregator(workers)
    kernel = sparse_sum._sparse_sum
    for rnd in range(rounds):
        want = torch.zeros(shape)
        for w in range(workers):
            p = data.draw(pushes(shape))
            want += p.decompress()
            a = compiled.push(3, rnd, w, p)
            sparse_sum._sparse_sum = None
            try:
                b = plain.push(3, rnd, w, p)
            finally:
                sparse_sum._sparse_sum = kernel
        assert torch.equal(a.decompress(), want) and torch.equal(b.decompress(), want)
        assert a.codec == b.codec and a.count == b.count
        if a.codec == "coo":  # a union in ascending order: no position twice, no zero sums
            assert torch.equal(a.indices, b.indices) and torch.equal(a.values, b.values)
            assert bool((a.indices.long().diff() > 0).all()) and bool(a.values.ne(0).all())
    state = compiled.keys[3]
    for buf, clean in zip(state.buffers or (), state.clean):
        assert not clean or not bool(buf.any())


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 5000), st.integers(0, 2**16), st.integers(0, 300), st.floats(0, 1))
@example(100_000, 1, 40, 0.2)  # sorted: the bitmap's words would outnumber the list 4 to 1
@example(64, 2, 300, 0.2)  # the bitmap
def test_sums_are_taken_in_ascending_order_once_each(numel, seed, count, zeros):
    """Whatever the order of the list (repeats included), the nonzero sums come back by
    ascending position, each once, with their bits, and the buffer is left zeros; short
    lists beside a long key (sorted) and long ones (the bitmap) alike."""
    gen = torch.Generator().manual_seed(seed)
    listed = torch.randint(0, numel, (count,), generator=gen)
    buf = torch.zeros(numel)
    buf[listed] = torch.randn(count, generator=gen)
    buf[listed[torch.rand(count, generator=gen) < zeros]] = 0  # sums that cancelled
    buf[listed[torch.rand(count, generator=gen) < 0.05]] = float("nan")
    want = torch.unique(listed)
    want = want[buf[want] != 0]
    expected = buf[want].clone()
    positions, values = sparse_sum.take_nonzero(buf, listed)
    assert torch.equal(positions, want)
    assert torch.equal(values.view(torch.int32), expected.view(torch.int32))
    assert not bool(buf.any())


def test_nan_and_inf_sums_come_back():
    agg = Aggregator(2)
    nan = Payload("coo", (4, 4), torch.float32, torch.tensor([float("nan"), 1.0]), torch.tensor([2, 5]))
    inf = Payload("coo", (4, 4), torch.float32, torch.tensor([float("inf"), -1.0]), torch.tensor([9, 5]))
    agg.push(1, 0, 0, nan)
    answer = agg.push(1, 0, 1, inf).decompress().view(-1)
    assert answer[2].isnan() and answer[9].isinf() and answer[5] == 0
    assert not bool(agg.keys[1].buffers[0].any())


def test_an_out_of_range_push_is_refused_and_lands_nowhere():
    agg = Aggregator(2)
    good = Payload("coo", (4, 4), torch.float32, torch.tensor([1.0, 2.0]), torch.tensor([0, 15]))
    agg.push(1, 0, 0, good)
    # built in process, so nothing checked it on the way (decoding would have)
    bad = Payload("coo", (4, 4), torch.float32, torch.tensor([5.0, 7.0]), torch.tensor([3, 16]))
    with pytest.raises(PushRejected, match=r"not within \[0, 16\)"):
        agg.push(1, 0, 1, bad)
    answer = agg.push(1, 0, 1, good)
    assert torch.equal(answer.decompress().view(-1)[[0, 3, 15]], torch.tensor([2.0, 0.0, 4.0]))


def _dead_rows_grad(seed):
    gen = torch.Generator().manual_seed(seed)
    grad = torch.randn(12, 40, 3, generator=gen)
    grad[[0, 3, 4, 11]] = 0
    return grad


@pytest.mark.parametrize("compiled", [True, False])
def test_pushes_with_and_without_a_row_set_sum_alike(compiled):
    """A worker on the CPU path leaves dead rows out; one on the CUDA kernel sends them as
    zeros. One round of both, in either order, sums to the same tensor."""
    first, second = _dead_rows_grad(1), _dead_rows_grad(2)
    pruned = create("adtopk", ratio=0.1).compress(first, "t")
    full = create("adtopk", ratio=0.1).compress(second, "t")
    assert pruned.rows.tolist() == [1, 2, 5, 6, 7, 8, 9, 10] and pruned.values.shape[0] == 8
    full = Payload("fibre", full.shape, full.dtype, *_with_all_rows(full), full.view)
    want = pruned.decompress() + full.decompress()
    kernel = sparse_sum._sparse_sum
    for order in ((pruned, full), (full, pruned)):
        agg = Aggregator(2)
        if not compiled:
            sparse_sum._sparse_sum = None
        try:
            agg.push(5, 0, 0, order[0])
            answer = agg.push(5, 0, 1, order[1])
        finally:
            sparse_sum._sparse_sum = kernel
        assert torch.equal(answer.decompress(), want)
        assert not bool(agg.keys[5].buffers[0].any())


def _with_all_rows(p):
    """The values and indices of ``p`` with the rows it leaves out put back (zeros at the first
    k positions), as the CUDA kernel sends them."""
    values = torch.zeros(p.view[0], *p.values.shape[1:], dtype=p.values.dtype)
    indices = torch.arange(p.values.shape[1]).view(1, -1, *[1] * (p.values.dim() - 2))
    indices = indices.expand(values.shape).to(p.indices.dtype).clone()
    values[p.rows], indices[p.rows] = p.values, p.indices
    return values, indices


@pytest.mark.parametrize("rows, words", [([1, 1, 2], "not increasing"), ([0, 2, 12], "not increasing"),
                                         ([-1, 2, 3], "not increasing")])
def test_a_bad_row_set_built_in_process_is_refused_and_lands_nowhere(rows, words):
    p = create("adtopk", ratio=0.1).compress(_dead_rows_grad(3)[[1, 2, 5]], "t")
    agg = Aggregator(2)
    good = create("adtopk", ratio=0.1).compress(_dead_rows_grad(3), "t")
    agg.push(1, 0, 0, good)
    bad = Payload("fibre", good.shape, good.dtype, p.values, p.indices, good.view,
                  rows=torch.tensor(rows))
    with pytest.raises(PushRejected, match=words):
        agg.push(1, 0, 1, bad)
    assert torch.equal(agg.push(1, 0, 1, good).decompress(), good.decompress() * 2)
