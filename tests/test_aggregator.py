"""Server-side aggregation, in process: exact sums, BSP rounds, smaller-encoding answers, limits."""
import pytest
import torch
from hypothesis import given, strategies as st

from adtopk_ps.compression import create
from adtopk_ps.core.payload import Payload
from adtopk_ps.wire import payload_nbytes
from server.aggregator import Aggregator, PushRejected, smaller_encoding


def _ints(shape, seed):
    return torch.randint(-8, 9, shape, generator=torch.Generator().manual_seed(seed)).float()


@given(st.sampled_from(["none", "topk", "adtopk", "randomk", "dgc", "threshold"]),
       st.integers(1, 4), st.integers(1, 3), st.sampled_from([(12, 40), (5, 3, 4, 4), (30,)]))
def test_rounds_sum_exactly_what_workers_sent(name, workers, rounds, shape):
    if name == "adtopk" and len(shape) < 2:
        name = "none"
    agg = Aggregator(workers)
    comps = [create(name) if name == "none" else create(name, ratio=0.2) for _ in range(workers)]
    for rnd in range(rounds):
        want = torch.zeros(shape)
        answer = None
        for w, comp in enumerate(comps):
            p = comp.compress(_ints(shape, 100 * rnd + w), "t", rnd)
            want += p.decompress()
            assert answer is None
            answer = agg.push(7, rnd, w, p)
        assert torch.equal(answer.decompress(), want)
        assert agg.keys[7].round == rnd + 1


def test_bad_pushes_are_rejected_without_touching_the_sum():
    agg = Aggregator(2)
    dense = create("none")
    good = dense.compress(torch.ones(4, 4), "t")
    assert agg.push(1, 0, 0, good) is None
    cases = [
        ((1, 0, 0, good), "already pushed round 0"),
        ((1, 1, 1, good), "push for round 1 of key 1, which is at round 0"),
        ((1, 0, 5, good), "sender 5 is not a worker rank"),
        ((1, 0, 1, dense.compress(torch.ones(4, 5), "t")), "holds torch.float32 (4, 4)"),
        ((1, 0, 1, dense.compress(torch.ones(4, 4, dtype=torch.float16), "t")), "float16"),
    ]
    for args, words in cases:
        with pytest.raises(PushRejected, match=words.replace("(", r"\(").replace(")", r"\)")):
            agg.push(*args)
    answer = agg.push(1, 0, 1, dense.compress(torch.full((4, 4), 2.0), "t"))
    assert torch.equal(answer.decompress(), torch.full((4, 4), 3.0))


def test_answer_survives_the_next_round_starting():
    agg = Aggregator(2)
    dense = create("none")
    agg.push(1, 0, 0, dense.compress(torch.ones(300), "t"))
    first = agg.push(1, 0, 1, dense.compress(torch.ones(300), "t"))
    assert first.codec == "dense"
    agg.push(1, 1, 0, dense.compress(torch.full((300,), 5.0), "t"))  # round 1 begins
    assert torch.equal(first.decompress(), torch.full((300,), 2.0))


def test_smaller_encoding_picks_the_smaller_one():
    sparse = torch.zeros(1000)
    sparse[[3, 500, 999]] = 1.0
    p = smaller_encoding(sparse)
    assert p.codec == "coo" and p.count == 3
    assert payload_nbytes(p) < payload_nbytes(Payload("dense", (1000,), torch.float32, sparse))
    full = torch.ones(1000)
    assert smaller_encoding(full).codec == "dense"
    # at the break-even point (value + uint16 index = 6 bytes vs 4 dense) dense wins
    half = torch.zeros(1000)
    half[:667] = 1.0
    assert smaller_encoding(half).codec == "dense"
    half[666] = 0.0
    assert smaller_encoding(half).codec == "coo"


def test_server_resparsification_keeps_a_residual():
    agg = Aggregator(2, resparsify=create("topk", ratio=0.1))
    comps = [create("adtopk", ratio=0.5) for _ in range(2)]
    grads = [_ints((10, 20), s) for s in range(2)]
    total = torch.zeros(10, 20)
    answer = None
    for w in range(2):
        p = comps[w].compress(grads[w], "t")
        total += p.decompress()
        answer = agg.push(3, 0, w, p)
    assert answer.codec == "coo" and answer.count == 20
    residual = agg.resparsify.memory.residuals["key3"]
    assert torch.equal(answer.decompress() + residual, total)


@given(st.integers(1, 4), st.lists(st.sampled_from([0.02, 0.1, 0.3, 1.0]), min_size=4, max_size=4),
       st.integers(1, 3), st.sampled_from([1.0, 1.5, 2.0]), st.booleans())
def test_answers_matched_to_the_pushes_are_as_wide_as_a_push_and_lose_nothing(workers, ratios,
                                                                              rounds, times, same):
    """Re-sparsified to ``times`` the pushes' width, an answer carries that many times the mean
    push's count of entries, whatever densities the workers chose (mixed here, dense among
    them), and never a zero: where fewer are nonzero (pushes that overlap, ``same`` data on
    every worker), it carries those. It goes dense where that is no larger. Pushes that
    together are no wider go out as their sum. What an answer leaves out waits in the
    server's residual: over the rounds, answers plus residual are the sums."""
    agg = Aggregator(workers, resparsify=create("topk"), pushes_wide=times)
    comps = [create("adtopk", ratio=r) if r < 1 else create("none") for r in ratios[:workers]]
    total, answered = torch.zeros(12, 30), torch.zeros(12, 30)
    for rnd in range(rounds):
        counts, answer, summed = [], None, torch.zeros(12, 30)
        before = agg.resparsify.memory.residuals.get("key3")
        for w in range(workers):
            p = comps[w].compress(_ints((12, 30), 10 * rnd + (0 if same else w)), "t")
            counts.append(p.count)
            summed += p.decompress()
            answer = agg.push(3, rnd, w, p)
        wide = max(1, int(times * sum(counts) / workers))
        if not agg.keys[3].sparse or (wide >= sum(counts) and before is None):
            assert torch.equal(answer.decompress(), summed)
        else:
            live = int(torch.count_nonzero(summed + (0 if before is None else before)))
            if answer.codec == "coo":
                assert answer.count == min(wide, live) and bool((answer.values != 0).all())
            else:  # dense only where as many (value, position) pairs would weigh as much
                assert answer.codec == "dense" and min(wide, live) * (4 + 2) >= 12 * 30 * 4
        total += summed
        answered += answer.decompress()
    residual = agg.resparsify.memory.residuals.get("key3", torch.zeros(12, 30))
    assert torch.equal(answered + residual, total)


@given(st.integers(1, 3), st.integers(1, 3), st.integers(1, 3), st.sampled_from([None, 1.0, 2.0]))
def test_a_residual_fetched_and_put_back_continues_the_rounds_exactly(workers, before, after, times):
    """A server's residual fetched as of a round and put back on a fresh server (a resumed
    checkpoint's) gives the answers the first server would have given from that round on,
    bit for bit; a fresh server without it gives others wherever anything was held back."""
    def server():
        return Aggregator(workers, resparsify=create("topk", ratio=0.05), pushes_wide=times)

    def round_on(agg, rnd, data):
        comps = [create("adtopk", ratio=0.3) for _ in range(workers)]
        answer = None
        for w in range(workers):
            answer = agg.push(3, rnd, w, comps[w].compress(_ints((12, 30), 100 * data + w), "t"))
        return answer.decompress()

    first = server()
    for rnd in range(before):
        round_on(first, rnd, rnd)
    held = first.residual(3, before)
    with pytest.raises(PushRejected, match=f"asked as of round {before - 1}; the key is at round {before}"):
        first.residual(3, before - 1)
    resumed, fresh = server(), server()
    if held is not None:
        resumed.restore(3, 0, create("none").compress(held, "r"))
    for rnd in range(after):
        want = round_on(first, before + rnd, before + rnd)
        assert torch.equal(round_on(resumed, rnd, before + rnd), want)
        if held is not None and bool(held.any()) and rnd == 0:
            assert not torch.equal(round_on(fresh, rnd, before + rnd), want)


def test_a_residual_that_cannot_be_held_is_refused_naming_why():
    p = create("adtopk", ratio=0.3).compress(_ints((12, 30), 0), "t")
    with pytest.raises(PushRejected, match="does not re-sparsify its answers .*BYTEPS_SERVER_COMPRESSOR"):
        Aggregator(2).restore(3, 0, create("none").compress(torch.ones(12, 30), "r"))
    agg = Aggregator(2, resparsify=create("topk", ratio=0.05))
    with pytest.raises(PushRejected, match="must come dense, got fibre"):
        agg.restore(3, 0, p)
    with pytest.raises(PushRejected, match="must come dense, got no tensor"):
        agg.restore(3, 0, None)
    agg.restore(3, 0, create("none").compress(torch.ones(12, 31), "r"))  # before the key's first push
    for _ in range(2):  # every push of the key is refused alike
        with pytest.raises(PushRejected, match=r"key 3 holds torch.float32 \(12, 30\); the residual put "
                                               r"back for it is torch.float32 \(12, 31\)"):
            agg.push(3, 0, 0, p)
    assert agg.push(4, 0, 0, p) is None  # other keys go on
    with pytest.raises(PushRejected, match="came for round 1; the key is at round 0"):
        agg.restore(4, 1, create("none").compress(torch.ones(12, 30), "r"))
    assert agg.residual(9, 0) is None  # a key never pushed holds nothing


def test_residuals_put_back_before_their_keys_count_against_the_limits():
    """Residuals held for keys no push has declared yet take memory as those keys will:
    past the limits they are refused, and a key that comes later is charged the rest."""
    agg = Aggregator(2, resparsify=create("topk", ratio=0.05), max_keys=2, max_bytes=5800)
    one = create("none").compress(torch.ones(10, 30), "r")  # 1,200 bytes
    agg.restore(1, 0, one)
    agg.restore(1, 0, one)  # put back again: charged once
    assert agg.bytes_held == 1200
    agg.restore(2, 0, one)
    with pytest.raises(PushRejected, match="a residual for key 3 would exceed the server's limit of 2 keys"):
        agg.restore(3, 0, one)
    with pytest.raises(PushRejected, match="key 4 would exceed the server's limit of 2 keys"):
        agg.push(4, 0, 0, create("none").compress(torch.ones(2), "t"))
    p = create("adtopk", ratio=0.3).compress(_ints((10, 30), 0), "t")
    assert agg.push(1, 0, 0, p) is None  # three copies of 1,200 bytes, one of them paid
    assert agg.bytes_held == 3 * 1200 + 1200
    with pytest.raises(PushRejected, match="key 2 needs 3600 bytes; the server holds 3600 of its 5800"):
        agg.push(2, 0, 0, p)
    agg = Aggregator(2, resparsify=create("topk", ratio=0.05), max_bytes=1000)
    with pytest.raises(PushRejected, match="the residual of key 1 needs 1200 bytes; the server holds 0 "
                                           "of its 1000 byte limit"):
        agg.restore(1, 0, one)


def test_a_residual_put_back_for_a_key_now_pushed_dense_goes_out_with_its_next_answer():
    """A resumed job whose cost model now sends a tensor dense: what the server held back of
    it is not lost, nor held forever; it is added to the next answer."""
    agg = Aggregator(2, resparsify=create("topk", ratio=0.05))
    held = _ints((12, 30), 7)
    agg.restore(3, 0, create("none").compress(held, "r"))
    dense = create("none")
    assert agg.push(3, 0, 0, dense.compress(torch.ones(12, 30), "t")) is None
    answer = agg.push(3, 0, 1, dense.compress(torch.ones(12, 30), "t"))
    assert torch.equal(answer.decompress(), held + 2)
    assert agg.residual(3, 1) is None
    answer = agg.push(3, 1, 0, dense.compress(torch.ones(12, 30), "t")) or \
        agg.push(3, 1, 1, dense.compress(torch.ones(12, 30), "t"))
    assert torch.equal(answer.decompress(), torch.full((12, 30), 2.0))


def test_a_resparsifying_server_takes_an_empty_key_in_its_stride():
    """A sparse key of no elements has nothing to select: its answer is empty, not an error
    that would end the server."""
    agg = Aggregator(2, resparsify=create("topk"), pushes_wide=2.0)
    empty = Payload("coo", (0,), torch.float32, torch.empty(0), torch.empty(0, dtype=torch.int16))
    assert agg.push(0, 0, 0, empty) is None
    assert agg.push(0, 0, 1, empty).count == 0


def test_limits_refuse_new_keys_instead_of_running_out_of_memory():
    dense = create("none")
    agg = Aggregator(1, max_keys=2)
    agg.push(1, 0, 0, dense.compress(torch.ones(3), "a"))
    agg.push(2, 0, 0, dense.compress(torch.ones(3), "b"))
    with pytest.raises(PushRejected, match="limit of 2 keys"):
        agg.push(3, 0, 0, dense.compress(torch.ones(3), "c"))
    small = Aggregator(1, max_bytes=1000)
    with pytest.raises(PushRejected, match="needs 8000 bytes"):
        small.push(1, 0, 0, dense.compress(torch.ones(1000), "a"))
    # a re-sparsifying server keeps a residual as large as a sparse key: it counts too
    sparse = create("topk", ratio=0.01).compress(torch.ones(100), "s")
    assert Aggregator(1, max_bytes=800).push(1, 0, 0, sparse) is not None
    with pytest.raises(PushRejected, match="needs 1200 bytes"):
        Aggregator(1, create("topk"), max_bytes=800, pushes_wide=1.0).push(1, 0, 0, sparse)


def test_server_compressor_comes_from_the_environment(monkeypatch):
    from server.service import resparsifier_from_env
    monkeypatch.setenv("BYTEPS_SERVER_COMPRESSOR", "topk:0.05")
    comp, wide = resparsifier_from_env()
    assert comp.name == "topk" and comp.ratio == 0.05 and wide is None
    for spec, times in ((" topk ", 1.0), ("topk:2x", 2.0), ("topk:1.5X", 1.5), ("randomk:3x", 3.0)):
        monkeypatch.setenv("BYTEPS_SERVER_COMPRESSOR", spec)  # a multiple of the pushes' width
        comp, wide = resparsifier_from_env()
        assert comp.name == spec.split(":")[0].strip() and wide == times
    for spec, complaint in (("zstd", "unknown compressor"), ("topk:lots", "density .* must be a number"),
                            ("topk:0", r"in \(0, 1\]"), ("topk:", "density .* must be a number"),
                            ("topk:2", r"in \(0, 1\], got '2' \(a multiple .* is written 2x\)"),
                            ("topk:inf", r"in \(0, 1\], got 'inf'$"),
                            ("topk:twox", "multiple .* must be a number"), ("topk:x", "must be a number"),
                            ("topk:0x", "positive finite"), ("topk:-1x", "positive finite"),
                            ("topk:nanx", "positive finite"), ("topk:infx", "positive finite"),
                            ("adtopk:2x", "keeps exactly the entries"), ("threshold", "keeps exactly")):
        monkeypatch.setenv("BYTEPS_SERVER_COMPRESSOR", spec)
        with pytest.raises(ValueError, match=f"BYTEPS_SERVER_COMPRESSOR='{spec}': .*{complaint}"):
            resparsifier_from_env()
    monkeypatch.delenv("BYTEPS_SERVER_COMPRESSOR")
    assert resparsifier_from_env() is None


@given(st.lists(st.lists(st.sampled_from(["none", "topk", "adtopk", "randomk", "dup"]),
                         min_size=2, max_size=2), min_size=1, max_size=6),
       st.sampled_from([0.05, 0.5, 1.0]))
def test_mixed_rounds_stay_exact_as_buffers_are_reused(rounds, ratio):
    """Sparse rounds re-zero only what they touched; dense or dense-sized rounds leave a
    buffer that the next sparse round must not trust. Every round's sum stays exact."""
    agg = Aggregator(2)
    shape = (6, 10)
    for rnd, kinds in enumerate(rounds):
        want = torch.zeros(shape)
        answer = None
        for w, kind in enumerate(kinds):
            grad = _ints(shape, 10 * rnd + w)
            if kind == "dup":  # a coo push naming one position twice sums both values
                p = Payload("coo", shape, torch.float32, torch.tensor([1.0, 2.0, 4.0]),
                            torch.tensor([7, 7, 59], dtype=torch.int16))
            else:
                p = create(kind) if kind == "none" else create(kind, ratio=ratio)
                p = p.compress(grad, "t", rnd)
            want += p.decompress()
            answer = agg.push(5, rnd, w, p)
        assert torch.equal(answer.decompress(), want)
        if answer.codec == "coo":  # a union: no position twice
            assert answer.indices.long().unique().numel() == answer.count
    state = agg.keys[5]
    for buf, clean in zip(state.buffers or (), state.clean):
        assert not clean or not bool(buf.any())


def test_sparse_rounds_answer_the_union_of_what_was_pushed():
    agg = Aggregator(2)
    g = torch.zeros(64, 100)
    g[:, 3] = 1.0
    a = create("adtopk", ratio=0.01).compress(g, "t")
    b = create("adtopk", ratio=0.01).compress(-g, "t")  # cancels a exactly
    agg.push(9, 0, 0, a)
    answer = agg.push(9, 0, 1, b)
    # sums that cancelled to zero are not sent back; the buffer is all zeros again
    assert answer.codec == "coo" and answer.count == 0
    assert torch.equal(answer.decompress(), torch.zeros(64, 100))
    assert not bool(agg.keys[9].buffers[0].any()) and agg.keys[9].clean[0]
    c = create("adtopk", ratio=0.01).compress(g, "t")
    agg.push(9, 1, 0, c)
    answer = agg.push(9, 1, 1, c)
    assert answer.count == 64 and torch.equal(answer.decompress(), 2 * g)
