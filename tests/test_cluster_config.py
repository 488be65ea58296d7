"""The DMLC environment contract, key layout, placement and partitioning."""
import math

import pytest
from hypothesis import given, strategies as st

from adtopk_ps.cluster.membership import ClusterConfig, djb2, make_key, partition_rows, server_of
from adtopk_ps.core.env import EnvError

BASE = {"DMLC_ROLE": "worker", "DMLC_NUM_WORKER": "2", "DMLC_NUM_SERVER": "1",
        "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": "9000"}


def _env(**changes):
    env = {**BASE, **changes}
    return {k: v for k, v in env.items() if v is not None}


def test_a_full_environment_parses():
    cfg = ClusterConfig.from_env(_env(DMLC_WORKER_ID="1"))
    assert (cfg.role, cfg.num_workers, cfg.num_servers, cfg.worker_id) == ("worker", 2, 1, 1)
    assert cfg.scheduler_address == "tcp://127.0.0.1:9000" and cfg.node_host == "127.0.0.1"
    assert cfg.partition_bytes == 4096000 and cfg.verbose is None
    assert ClusterConfig.from_env(_env(PS_VERBOSE="2")).verbose == 2


def test_local_size_multiplies_workers_and_offsets_ids():
    cfg = ClusterConfig.from_env(_env(DMLC_WORKER_ID="1", BYTEPS_LOCAL_SIZE="4", BYTEPS_LOCAL_RANK="2"))
    assert cfg.num_workers == 8 and cfg.worker_id == 6


@pytest.mark.parametrize("changes, name", [
    ({"DMLC_ROLE": None}, "DMLC_ROLE"),
    ({"DMLC_ROLE": "boss"}, "DMLC_ROLE"),
    ({"DMLC_PS_ROOT_URI": None}, "DMLC_PS_ROOT_URI"),
    ({"DMLC_PS_ROOT_PORT": None}, "DMLC_PS_ROOT_PORT"),
    ({"DMLC_PS_ROOT_PORT": "http"}, "DMLC_PS_ROOT_PORT"),
    ({"DMLC_NUM_WORKER": "0"}, "DMLC_NUM_WORKER"),
    ({"DMLC_NUM_SERVER": None}, "DMLC_NUM_SERVER"),
    ({"DMLC_WORKER_ID": "2"}, "DMLC_WORKER_ID"),
    ({"DMLC_WORKER_ID": "x"}, "DMLC_WORKER_ID"),
    ({"DMLC_WORKER_ID": "0", "BYTEPS_LOCAL_RANK": "1"}, "BYTEPS_LOCAL_RANK"),
    ({"BYTEPS_PARTITION_BYTES": "-5"}, "BYTEPS_PARTITION_BYTES"),
    ({"DMLC_INTERFACE": "nosuchif0"}, "DMLC_INTERFACE"),
    ({"PS_VERBOSE": "-1"}, "PS_VERBOSE"),
    ({"PS_VERBOSE": "loud"}, "PS_VERBOSE"),
])
def test_missing_or_bad_variables_are_named(changes, name):
    with pytest.raises(EnvError, match=name):
        ClusterConfig.from_env(_env(**changes))


def test_keys_and_placement_follow_byteps():
    assert make_key(3, 2) == (3 << 16) + 2
    assert djb2("0") == 5381 * 33 + ord("0")
    assert server_of(make_key(0, 0), 4) == djb2("0") % 4
    counts = [0] * 3
    for tid in range(300):
        counts[server_of(make_key(tid, 0), 3)] += 1
    assert min(counts) >= 50  # every server gets a share (djb2 is not perfectly even)
    with pytest.raises(ValueError):
        make_key(1, 1 << 16)


@given(st.lists(st.integers(1, 300), min_size=1, max_size=4), st.integers(1, 10**6))
def test_partitions_cover_the_tensor_keep_fibres_whole_and_respect_the_size(shape, limit):
    shape = tuple(shape)
    blocks = partition_rows(shape, 4, limit)
    count = shape[0] if len(shape) >= 2 else math.prod(shape)
    unit = math.prod(shape) // count
    assert blocks[0][0] == 0 and sum(n for _, n in blocks) == count
    assert all(a + n == b for (a, n), (b, _) in zip(blocks, blocks[1:]))
    for _, n in blocks:  # a block exceeds the limit only when one row alone does
        assert n * unit * 4 <= limit or n == 1


def test_a_jobs_description_keeps_differences_past_its_cut_and_is_bounded():
    from adtopk_ps.cluster.membership import JOB_CHARS, describe_job, job_differences
    a = describe_job({"data.path": "x" * 500 + "a", "optimizer.lr": 0.1})
    b = describe_job({"data.path": "x" * 500 + "b", "optimizer.lr": 0.1})
    assert all(len(v) <= 200 for _, v in a)
    lines = job_differences(a, b)
    assert len(lines) == 1 and lines[0].startswith("data.path: the job has 'xxx")
    assert job_differences(a, a) == []
    with pytest.raises(ValueError, match=f"exceeds the limit of {JOB_CHARS}"):
        describe_job({f"k{i}": "v" * 190 for i in range(200)})
    with pytest.raises(ValueError, match="must map names"):
        describe_job({1: 2})
