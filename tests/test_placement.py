"""The balanced placement: row ranges that cover every tensor, servers that share the bytes,
the same answer on every worker, keys that never move while their rounds run, and a cluster
whose servers carry even shares of a real training job's pushes and answers."""
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adtopk_ps.client.slicer import Slicer
from adtopk_ps.cluster.membership import ClusterConfig, make_key, server_of
from adtopk_ps.cluster.placement import (ELASTIC_PIECES, Item, assign, imbalance, loads, pack,
                                         plan, push_bytes, spread)
from adtopk_ps.core.env import EnvError

from procs import bpslaunch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import placement as placement_benchmark  # noqa: E402

shapes = st.lists(st.integers(1, 300), min_size=1, max_size=3).map(tuple)
items = st.lists(st.tuples(shapes, st.sampled_from([None, 0.01, 0.1])), min_size=1, max_size=12)


def _items(drawn) -> list[Item]:
    return [Item(i * 7 + 1, s, 4, push_bytes(s, 4, r), r is not None) for i, (s, r) in enumerate(drawn)]


@settings(max_examples=150, deadline=None)
@given(items, st.integers(1, 40), st.sampled_from([64, 4096, 4096000]))
def test_a_plan_cuts_each_tensor_into_whole_rows_that_cover_it_once(drawn, servers, partition):
    entries = _items(drawn)
    p = plan(entries, servers, partition)
    for item in entries:
        unit, count = item.rows
        blocks = p.blocks[item.tensor_id]
        assert blocks[0][0] == 0 and sum(n for _, n in blocks) == count
        assert all(a + n == b for (a, n), (b, _) in zip(blocks, blocks[1:]))
        # no range over the partition size unless one row is (rows stay whole)
        assert all(n * unit * 4 <= partition or n == 1 for _, n in blocks)
    assert set(p.weights) == {make_key(i.tensor_id, k) for i in entries
                              for k in range(len(p.blocks[i.tensor_id]))}
    assert sum(p.weights.values()) <= sum(i.weight for i in entries)


@settings(max_examples=150, deadline=None)
@given(items, st.integers(1, 40), st.sampled_from([1, 3]))
def test_each_server_gets_its_share_to_within_a_row_at_each_end(drawn, servers, pieces):
    entries = _items(drawn)
    p = plan(entries, servers, 4096000, pieces)
    placed = p.assign(servers)
    row = max(i.weight / i.rows[1] for i in entries if i.rows[1])
    for kind in (False, True):  # the sparse and the dense are shared out apart
        keys = {make_key(i.tensor_id, k): p.weights[make_key(i.tensor_id, k)] for i in entries
                if i.sparse == kind for k in range(len(p.blocks[i.tensor_id]))}
        held = loads(keys, {k: placed[k] for k in keys}, servers)
        mean = sum(held) / servers
        assert all(abs(h - mean) <= 2 * pieces * row + len(keys) for h in held), (held, row)


@settings(max_examples=100, deadline=None)
@given(items, st.integers(1, 40))
def test_every_worker_gets_the_same_plan_whatever_order_it_lists_the_tensors_in(drawn, servers):
    entries = _items(drawn)
    a, b = plan(entries, servers, 4096), plan(entries[::-1], servers, 4096)
    assert a == b and a.assign(servers) == b.assign(servers)


def test_packing_puts_each_key_on_the_server_that_holds_least():
    assert assign({1: 300, 2: 200, 3: 100}, 2) == {1: 0, 2: 1, 3: 1}
    held = [50, 0, 0]
    assert pack({9: 40, 8: 40}, held) == {8: 1, 9: 2} and held == [50, 40, 40]
    with pytest.raises(ValueError, match="0 servers"):
        assign({1: 1}, 0)


@pytest.mark.parametrize("servers", [4, 8, 64, 256])
@pytest.mark.parametrize("model", placement_benchmark.MODELS)
def test_the_busiest_server_carries_at_most_1_10x_the_mean(model, servers):
    """The issue's goal, from the placement code itself; byteps' hash is far off at scale."""
    entries = placement_benchmark.items(placement_benchmark.parameters(model), 0.01, servers)
    _, ratio = placement_benchmark.balanced(entries, servers)
    assert ratio <= 1.10
    if servers >= 64:
        assert placement_benchmark.byteps(entries, servers)[1] > 2.0


@pytest.mark.parametrize("model", placement_benchmark.MODELS)
def test_a_lost_server_leaves_the_rest_balanced(model):
    """An elastic job keeps its keys and packs them onto the servers left."""
    entries = placement_benchmark.items(placement_benchmark.parameters(model), 0.01, 8)
    p = plan(entries, 8, 4096000, ELASTIC_PIECES)  # an elastic job's plan
    for left in (8, 7, 6):
        assert imbalance(loads(p.weights, p.assign(left), left)) <= 1.10


def test_the_benchmark_prints_a_line_per_model_and_server_count_and_the_worst_last(capsys):
    worst = placement_benchmark.main(["--servers", "4", "64"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 + 2 * len(placement_benchmark.MODELS)
    assert lines[-1] == f"worst balanced busiest/mean: {worst:.3f}x" and worst <= 1.10


def test_a_slicer_never_moves_a_key_once_placed_and_repacks_only_for_other_server_counts():
    slicer = Slicer(4, 4096000)
    first = [Item(1, (4000, 1024), 4, push_bytes((4000, 1024), 4, 0.01))]
    slicer.plan(first)
    keys = [make_key(1, i) for i in range(len(slicer.blocks(1, (4000, 1024), 4)))]
    assert len(keys) == 4 and sorted(slicer.server_of(k, 4) for k in keys) == [0, 1, 2, 3]
    before = {k: slicer.server_of(k, 4) for k in keys}
    slicer.plan([Item(2, (8192, 1024), 4, push_bytes((8192, 1024), 4, 0.01)), *first])
    assert {k: slicer.server_of(k, 4) for k in keys} == before  # the second group packs after
    again = Slicer(4, 4096000)
    again.plan(first)
    again.plan([Item(2, (8192, 1024), 4, push_bytes((8192, 1024), 4, 0.01))])
    assert all(again.server_of(k, 3) == slicer.server_of(k, 3) for k in keys)


def test_unplanned_tensors_keep_byteps_partitions_and_go_round_the_servers():
    slicer = Slicer(4, 4096)
    blocks = slicer.blocks(5, (64, 64), 4)  # 16 KiB in 4 KiB partitions
    assert blocks == [(0, 16), (16, 16), (32, 16), (48, 16)] and not slicer.planned(5)
    first = server_of(make_key(5, 0), 4)
    assert [slicer.server_of(make_key(5, i), 4) for i in range(4)] == \
        [(first + i) % 4 for i in range(4)] == [spread(make_key(5, 0), i, 4) for i in range(4)]


def test_hash_placement_is_byteps_own():
    slicer = Slicer(4, 4096, "hash")
    slicer.plan([Item(5, (64, 64), 4, 16384)])
    assert not slicer.planned(5)
    assert [slicer.server_of(make_key(5, i), 4) for i in range(4)] == \
        [server_of(make_key(5, i), 4) for i in range(4)]


def test_a_placement_that_is_not_known_is_refused_naming_the_variable():
    env = {"DMLC_ROLE": "worker", "DMLC_NUM_WORKER": "1", "DMLC_NUM_SERVER": "1",
           "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": "9000"}
    assert ClusterConfig.from_env(env).placement == "balanced"
    assert ClusterConfig.from_env({**env, "PS_PLACEMENT": "HASH"}).placement == "hash"
    with pytest.raises(EnvError, match="PS_PLACEMENT='rr'"):
        ClusterConfig.from_env({**env, "PS_PLACEMENT": "rr"})


def test_a_training_jobs_servers_carry_even_shares_of_its_pushes_and_answers():
    """Four workers and four servers train a small CNN with ADTopk: from every worker's ledger,
    the busiest server's pushes and answers are within 1.15x the mean, and the replicas end
    equal."""
    out = bpslaunch("--local", "--num-workers", "4", "--num-servers", "4", "--", sys.executable,
                    str(ROOT / "tests" / "programs" / "placement_check.py"), "10", timeout=240)
    assert out.returncode == 0, out.stdout
    pushed, pulled, servers = placement_benchmark.shares(out.stdout)
    assert servers == 4 and pushed <= 1.15 and pulled <= 1.15, (pushed, pulled)
    digests = {line.split("digest ", 1)[1] for line in out.stdout.splitlines() if "digest " in line}
    assert len(digests) == 1
