"""The dense part all-reduced among the workers: in one order on every worker, exact, and
refused or failed loudly where it cannot be trusted."""
import datetime
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import adtopk_ps.torch as bps
from adtopk_ps.compression import CostModel
from adtopk_ps.torch.dense_lane import DenseLane, backend_for, gpu_key
from procs import FAST, bpslaunch

PROGRAM = Path(__file__).resolve().parent / "programs" / "hybrid_check.py"


def _gloo_pair() -> list[dist.ProcessGroupGloo]:
    """Two ranks of a real gloo group in this process, one per thread (they connect together)."""
    store = dist.HashStore()
    groups = [None, None]

    def make(rank):
        options = dist.ProcessGroupGloo._Options()
        options._timeout = datetime.timedelta(seconds=20)
        options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        groups[rank] = dist.ProcessGroupGloo(store, rank, 2, options)
    threads = [threading.Thread(target=make, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(groups)
    return groups


def test_every_worker_starts_in_the_lane_order_whatever_order_tensors_are_ready_in():
    """gloo pairs collectives by the order they start in: rank 1 has its tensors ready in
    another order than rank 0 (and of other sizes, so a mismatch could not pass), yet
    every average is exact, round after round."""
    groups = _gloo_pair()
    order = ["a", "b", "c"]
    sizes = {"a": 3, "b": 1000, "c": 70}
    ready_in = [["a", "b", "c"], ["c", "a", "b"]]
    answers, reductions = [{}, {}], [{}, {}]

    def worker(rank):
        lane = DenseLane(groups[rank], order, timeout=20)
        for step in range(3):
            started = reductions[rank][step] = {
                n: lane.start(n, torch.full((sizes[n],), float(10 * step + rank + ord(n))))
                for n in ready_in[rank]}
            answers[rank][step] = {n: r.wait().clone() for n, r in started.items()}
    threads = [threading.Thread(target=worker, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for step in range(3):
        for n in order:
            want = torch.full((sizes[n],), 10 * step + ord(n) + 0.5)  # the mean of rank 0's and 1's
            assert torch.equal(answers[0][step][n], want) and torch.equal(answers[1][step][n], want)
            assert torch.equal(reductions[0][step][n].wait(), want)  # waiting again: the same


def test_a_tensor_waited_for_before_its_predecessors_start_is_named_and_twice_is_refused():
    groups = _gloo_pair()
    lane = DenseLane(groups[0], ["a", "b"], timeout=5)
    early = lane.start("b", torch.ones(2))
    with pytest.raises(RuntimeError, match="all-reduce of 'b' has not started: a tensor before it"):
        early.wait()
    with pytest.raises(RuntimeError, match="'b' all-reduced twice in one round"):
        lane.start("b", torch.ones(2))


def test_an_unknown_dense_transport_is_named():
    with pytest.raises(ValueError, match="dense_transport must be one of .*'nccl'"):
        bps.GradientCompression("adtopk", dense_transport="nccl")


def test_the_cost_model_prices_dense_by_the_route_dense_tensors_take():
    """A layer that pays to sparsify against dense push + pull through the servers does not
    against an all-reduce ten times as fast (dense: 21 ms against 2.1 ms; sparse: 4.2 ms to
    compress and 0.6 ms through the servers)."""
    through_servers = CostModel(bytes_per_s=400e6, compress_s_per_element=4e-9, workers=2)
    assert through_servers.sparse_pays(1 << 20, 4, 0.01)
    by_allreduce = CostModel(bytes_per_s=400e6, compress_s_per_element=4e-9, workers=2,
                             dense_bytes_per_s=4000e6)
    assert not by_allreduce.sparse_pays(1 << 20, 4, 0.01)


_UNDER_CURVE = """
import pytest, torch
import adtopk_ps.torch as bps
bps.init()
assert bps.client().encrypted
model = torch.nn.Linear(64, 300)
with pytest.raises(ValueError) as refused:
    bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                             bps.GradientCompression("adtopk", dense_transport="allreduce"))
print("refused:", refused.value)
compression = bps.GradientCompression("adtopk", dense_transport="auto")
opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                               compression)
model(torch.randn(2, 64)).sum().backward()
opt.step()
print("auto:", compression.allreduce, compression.allreduce_bytes_per_s, opt.allreduce_bytes,
      bps.client().bytes_pushed > 0)
bps.shutdown()
"""


def test_under_curve_keys_allreduce_is_refused_and_auto_keeps_to_the_servers(tmp_path):
    """gloo would carry the gradients in the clear beside an encrypted parameter server.
    (A process of its own: CURVE, once set up on a zmq context, stays on it.)"""
    from adtopk_ps.cluster.security import keygen
    from procs import roles
    keygen(tmp_path / "keys")
    keys = {"PS_CURVE_KEYS": str(tmp_path / "keys")}
    with roles(1, 1, **keys) as (config, _):
        env = {**os.environ, **FAST, **keys, "DMLC_ROLE": "worker", "DMLC_WORKER_ID": "0",
               "DMLC_PS_ROOT_URI": config.root_uri, "DMLC_PS_ROOT_PORT": str(config.root_port),
               "DMLC_NUM_WORKER": "1", "DMLC_NUM_SERVER": "1", "DMLC_NODE_HOST": "127.0.0.1"}
        result = subprocess.run([sys.executable, "-c", _UNDER_CURVE], env=env, capture_output=True,
                                text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert ("refused: dense_transport='allreduce' would send gradients over gloo or NCCL, neither "
            "of which authenticates or encrypts; with PS_CURVE_KEYS set use dense_transport='ps'") \
        in result.stdout
    assert "auto: False 0.0 0 True" in result.stdout  # no group made, nothing timed, the servers used


def _digests(out: str) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for rank, digest in re.findall(r"worker (\d): step \d+ (\w+)", out):
        found.setdefault(rank, []).append(digest)
    return found


@pytest.mark.parametrize("overlap, compressor", [("0", "adtopk"), ("1", "adtopk"), ("1", "none")])
def test_training_is_bit_identical_whichever_route_dense_tensors_take(overlap, compressor):
    """Two workers' sum is exact through a server and in a ring alike, so the parameters after
    every step agree bit for bit; with overlap the tensors start as backward produces them,
    without it in the model's order, the reverse of the lane's."""
    runs = {}
    for transport in ("ps", "allreduce"):
        result = bpslaunch("--local", "--num-workers", "2", "--num-servers", "2", "--", sys.executable,
                           str(PROGRAM), transport, overlap, compressor, timeout=120)
        assert result.returncode == 0, result.stdout[-3000:]
        lane = "allreduce" if transport == "allreduce" else "servers"
        assert f"worker 0: dense via {lane}" in result.stdout, result.stdout[-3000:]
        runs[transport] = _digests(result.stdout)
    assert len(runs["ps"]["0"]) == 6
    assert runs["ps"]["0"] == runs["ps"]["1"] == runs["allreduce"]["0"] == runs["allreduce"]["1"]


def test_auto_measures_both_routes_and_every_worker_chooses_alike():
    result = bpslaunch("--local", "--num-workers", "2", "--num-servers", "2", "--", sys.executable,
                       str(PROGRAM), "auto", "1", "adtopk", timeout=120)
    assert result.returncode == 0, result.stdout[-3000:]
    chosen = re.findall(r"worker \d: dense via (\w+)", result.stdout)
    assert len(chosen) == 2 and chosen[0] == chosen[1], result.stdout[-3000:]
    measured = re.findall(r"worker \d: measured ([\d.]+) MB/s through the servers, ([\d.]+) MB/s "
                          r"by all-reduce", result.stdout)
    assert len(measured) == 2 and measured[0] == measured[1], result.stdout[-3000:]
    servers, ring = map(float, measured[0])
    assert servers > 0 and ring > 0 and chosen[0] == ("allreduce" if ring > servers else "servers")
    digests = _digests(result.stdout)
    assert len(digests["0"]) == 6 and digests["0"] == digests["1"]


def _until_worker_1(event: str, *extra: str) -> tuple[int, float, str]:
    """A 2x2 hybrid_check job whose worker 1 ``event`` ("dying" or "hanging") mid-step: the
    launcher's status, the seconds from then to the job's end, and the output."""
    launcher = subprocess.Popen(
        [sys.executable, "-m", "adtopk_ps.launcher", "--local", "--num-workers", "2", "--num-servers", "2",
         "--timeout", "100", "--", sys.executable, str(PROGRAM), "allreduce", "1", "none", *extra],
        env={**os.environ, **FAST}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)
    try:
        lines = []
        for line in launcher.stdout:
            lines.append(line)
            if f"worker 1: {event}" in line:
                break
        began = time.monotonic()
        rest, _ = launcher.communicate(timeout=60)
        elapsed = time.monotonic() - began
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
    return launcher.returncode, elapsed, "".join(lines) + rest


def test_a_worker_dying_mid_all_reduce_ends_the_other_with_a_named_error_in_seconds():
    status, elapsed, out = _until_worker_1("dying", "--die-at", "3")
    assert status != 0 and elapsed < 12, (elapsed, out[-3000:])
    # the all-reduce sees the closed connection at once; the heartbeat names the worker too
    assert re.search(r"\[worker 0\] .*(dense all-reduce of '[\w.]+' failed: .*Connection (?:closed|reset) by peer"
                     r"|worker 1 \(127\.0\.0\.1\) lost)", out), out[-3000:]


def test_a_hung_worker_ends_the_others_all_reduce_wait_within_the_heartbeat_timeout():
    """A stopped process keeps its connections open, so gloo alone would wait out its whole
    timeout (600 s); the heartbeats name the worker within seconds (2 s here)."""
    status, elapsed, out = _until_worker_1("hanging", "--hang-at", "3")
    assert status != 0 and elapsed < 12, (elapsed, out[-3000:])
    assert re.search(r"\[worker 0\] .*worker 1 \(127\.0\.0\.1\) lost: no heartbeat", out), out[-3000:]


def test_nccl_only_where_every_worker_reduces_on_a_gpu_of_its_own():
    """Decided from what every worker gathered, so all choose alike; NCCL refuses two ranks on
    one GPU, and reduces no CPU tensor."""
    assert backend_for(["gpu-a", "gpu-b"], nccl=True) == "nccl"
    assert backend_for(["gpu-a", "gpu-a"], nccl=True) == "gloo"  # two workers share a GPU
    assert backend_for(["gpu-a", None], nccl=True) == "gloo"  # one worker on the CPU
    assert backend_for([None, None], nccl=True) == "gloo"
    assert backend_for(["gpu-a", "gpu-b"], nccl=False) == "gloo"  # a torch without NCCL
    assert gpu_key([torch.device("cpu")]) is None and gpu_key([]) is None
    if torch.cuda.is_available():
        gpu = torch.device("cuda", 0)
        assert gpu_key([gpu, gpu]) == gpu_key([gpu]) is not None
        assert gpu_key([gpu, torch.device("cpu")]) is None
