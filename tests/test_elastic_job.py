"""The training job (``python -m worker``) as an elastic job: config key ``elastic``.

A real 3-worker job loses a worker and takes in its restart, and every worker ends with the
same parameters; the elastic config is refused on a cluster that does not match it; and
every epoch's samples are dealt out once, however the workers change within it."""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from adtopk_ps.testing.roles import run_and_kill
from procs import FAST, bpslaunch
from worker.data import Dataset
from worker.elastic import round_batch

ROOT = Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "configs" / "digits-mlp-elastic.yaml")


@settings(max_examples=60, deadline=None)
@given(total=st.integers(4, 200), batch=st.integers(1, 16), seed=st.integers(0, 5),
       sizes=st.lists(st.integers(1, 6), min_size=1, max_size=40))
def test_an_epoch_deals_every_sample_once_as_the_workers_change(total, batch, seed, sizes):
    # the training set's values are their own indices; the workers change size step by step
    data = Dataset(torch.arange(total), torch.arange(total), torch.zeros(1), torch.zeros(1), "classify")
    processed, dealt, steps = 0, [], iter(sizes * 1000)
    while processed < total:
        size = next(steps)
        parts = [round_batch(data, 0, processed, rank, size, batch, seed) for rank in range(size)]
        taken = {t for _, _, t in parts}
        assert len(taken) == 1  # every rank counts the step alike
        got = [int(v) for x, _, _ in parts for v in x]
        # a rank left without samples pads from the start; the rest are the step's, in order
        real = got[:taken.pop()]
        dealt += real
        processed += len(real)
        assert all(len(x) <= batch for x, _, _ in parts)
    assert sorted(dealt) == list(range(total))


def test_the_elastic_job_goes_on_without_lost_workers_and_takes_in_a_restart():
    # workers 1 and 2 die at step 40 (at least 1): one restart joins a job of one worker, so
    # the joiner's size differs from the job's at the start, and its schedule must not;
    # --epochs (not --steps) makes the step count the job's own
    cmd = [sys.executable, "-m", "adtopk_ps.launcher", "--local", "--num-workers", "3",
           "--num-servers", "2", "--min-workers", "1", "--restarts", "1", "--timeout", "150",
           "--", sys.executable, "-m", "worker", "--config", CONFIG, "--epochs", "60",
           "--checksums", "--set", "progress=false", "--set", "elastic.min_workers=1"]
    result, killed = run_and_kill(cmd, {**os.environ, **FAST, "PS_HEARTBEAT_TIMEOUT_MS": "6000"},
                                  r"checksum step 40:", "worker", [1, 2], timeout=200)
    out = result.stdout
    assert result.returncode == 0 and len(killed) == 2, out
    summary = re.search(r"summary: accuracy=([\d.]+) .* steps=(\d+) .* workers=2 rank=0", out)
    assert summary and float(summary[1]) > 0.9, out
    steps = int(summary[2])  # 60 epochs of the training split, 3 x 32 samples a step
    assert steps > 200
    final = set(re.findall(rf"\[worker \d\] checksum step {steps}: (\w+)", out))
    assert len(final) == 1 and out.count(f"checksum step {steps}:") == 2, out  # one model
    assert re.search(r"worker \d \(127.0.0.1\) joined; going on with 2 worker\(s\)", out), out


def test_an_elastic_config_needs_a_cluster_that_matches_it(tmp_path):
    # not elastic at all; elastic with other bounds: each refused, named
    plain = bpslaunch("--local", "--num-workers", "2", "--num-servers", "1", "--timeout", "60",
                      "--", sys.executable, "-m", "worker", "--config", CONFIG, "--steps", "5",
                      timeout=90)
    assert plain.returncode == 2 and "the cluster is not elastic" in plain.stdout, plain.stdout
    other = bpslaunch("--local", "--num-workers", "2", "--num-servers", "1", "--min-workers", "1",
                      "--timeout", "60", "--", sys.executable, "-m", "worker", "--config", CONFIG,
                      "--steps", "5", timeout=90)
    assert other.returncode == 2 and "elastic.min_workers=2, the cluster PS_MIN_WORKERS=1" \
        in other.stdout, other.stdout


def test_a_joiner_with_another_config_is_refused_as_it_registers_and_the_job_goes_on(tmp_path):
    """Worker 2 is killed; its restart comes with another learning rate. The scheduler
    refuses it as it registers, naming the difference, it exits 2, and the two others train
    to the end without a word of it: no disagreement, one model."""
    worker = [sys.executable, "-m", "worker", "--config", CONFIG, "--epochs", "40", "--checksums",
              "--set", "progress=false"]
    mark = tmp_path / "started"
    # the first start of each worker runs the job's config, a restart another learning rate
    script = (f'mkdir "{mark}.$DMLC_WORKER_ID" 2>/dev/null && exec "$@"; '
              'exec "$@" --set optimizer.lr=0.2')
    cmd = [sys.executable, "-m", "adtopk_ps.launcher", "--local", "--num-workers", "3",
           "--num-servers", "1", "--min-workers", "2", "--restarts", "1", "--timeout", "150",
           "--", "sh", "-c", script, "sh", *worker]
    result, killed = run_and_kill(cmd, {**os.environ, **FAST, "PS_HEARTBEAT_TIMEOUT_MS": "6000"},
                                  r"checksum step 5:", "worker", [2], timeout=200)
    out = result.stdout
    assert len(killed) == 1, out
    assert re.search(r"the scheduler refused this node: the worker at 127.0.0.1 would run another "
                     r"job than the running one: optimizer.lr: the job has 0.05, this worker 0.2", out), out
    assert "Disagreement" not in out and "disagree" not in out, out
    summary = re.search(r"summary: accuracy=([\d.]+) .* steps=(\d+) .* workers=2 rank=0", out)
    assert summary, out
    steps = int(summary[2])
    final = set(re.findall(rf"\[worker \d\] checksum step {steps}: (\w+)", out))
    assert len(final) == 1 and out.count(f"checksum step {steps}:") == 2, out
    assert "[bpslaunch] worker 2 exited with status 2" in out, out
    assert result.returncode == 0, out  # the job did its work; the refused joiner was no part of it
