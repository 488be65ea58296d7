"""Real local clusters (scheduler, servers, workers as processes) checking every aggregate."""
import re

import pytest

from adtopk_ps.compression import COMPRESSORS

from procs import selfcheck


def _passed(result, workers):
    assert result.returncode == 0, result.stdout[-3000:]
    lines = re.findall(r"selfcheck passed: (\d+) rounds", result.stdout)
    assert len(lines) == workers, result.stdout[-3000:]
    assert "shutting down" in result.stdout  # servers were told to stop, and did
    return lines


@pytest.mark.parametrize("name", sorted(COMPRESSORS))
def test_2x2_every_compressor_with_partitioned_tensors(name):
    # 64 KiB partitions split the larger tensors into many keys over both servers
    args = ["--compressor", name, "--rounds", "5"] + ([] if name == "none" else ["--ef"])
    result = selfcheck(2, 2, *args, env={"BYTEPS_PARTITION_BYTES": "65536"})
    _passed(result, 2)


def test_1x1_default_partitions():
    _passed(selfcheck(1, 1, "--compressor", "adtopk", "--rounds", "4"), 1)


def test_4x3_adtopk_with_error_feedback():
    _passed(selfcheck(4, 3, "--compressor", "adtopk", "--ef", "--rounds", "4",
                      env={"BYTEPS_PARTITION_BYTES": "100000"}), 4)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_gradients(dtype):
    _passed(selfcheck(2, 1, "--compressor", "adtopk-i", "--dtype", dtype, "--rounds", "4"), 2)


def test_workers_pushing_in_different_orders_do_not_deadlock():
    shapes = [f"{8 + i}x{100 + 13 * i}" for i in range(40)]
    _passed(selfcheck(3, 2, "--compressor", "topk", "--ef", "--rounds", "6", "--shuffle",
                      "--shapes", *shapes), 3)
