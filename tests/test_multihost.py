"""Every role on its own host (a network namespace with a real address and a shaped link),
started with bpslaunch and the DMLC variables as a user would on separate machines."""
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from adtopk_ps.testing import netns
from procs import FAST

ROOT = Path(__file__).resolve().parents[1]
SKIP = netns.unavailable()


def _start(net: dict, names: list[str], base: dict, launch: list[str], job: list[str],
           procs: dict) -> None:
    """Every role of ``names`` on its own host, into ``procs`` as it starts (the caller's
    ``finally`` stops whatever started)."""
    for name in names:
        role = re.sub(r"\d", "", name)
        env = {**base, "DMLC_ROLE": role}
        if role == "worker":
            env["DMLC_WORKER_ID"] = name[-1]
        procs[name] = netns.run_in(net[name][0], launch + (job if role == "worker" else []),
                                   env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True, cwd=ROOT)


def _train_on_hosts(loss: float = 0.0) -> tuple[dict, dict]:
    """30 training steps with every role on its own host; ``loss``: the share of packets
    each worker's link drops both ways. Returns the hosts and every role's output."""
    names = ["scheduler", "server0", "server1", "worker0", "worker1"]
    with netns.hosts(names, rate="1gbit", delay="0.2ms") as net:
        qdisc = subprocess.run(["ip", "netns", "exec", net["worker0"][0], "tc", "qdisc", "show",
                                "dev", "eth0"], capture_output=True, text=True, check=True).stdout
        # the link is really shaped (netem adds the delay where the kernel has it)
        assert "rate 1Gbit" in qdisc and ("netem" not in qdisc or "delay 200us" in qdisc)
        if loss:
            for worker in ("worker0", "worker1"):
                netns.drop(net[worker][0], loss)
        base = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "BYTEPS_"))}
        base.update(FAST, DMLC_PS_ROOT_URI=net["scheduler"][1], DMLC_PS_ROOT_PORT="9000",
                    DMLC_NUM_SERVER="2", DMLC_NUM_WORKER="2", BYTEPS_LOCAL_SIZE="1")
        launch = [sys.executable, "-m", "adtopk_ps.launcher"]
        job = [sys.executable, "-m", "worker", "--config", str(ROOT / "configs" / "digits-cnn.yaml"),
               "--steps", "30", "--checksums", "--set", "progress=false"]
        procs = {}
        try:
            _start(net, names, base, launch, job, procs)
            outputs = {name: p.communicate(timeout=240)[0] for name, p in procs.items()}
        finally:
            for p in procs.values():
                if p.poll() is None:
                    p.kill()
                    p.wait()
        for name, p in procs.items():
            assert p.returncode == 0, (name, outputs[name][-2000:])
    return net, outputs


def _checksums(output: str) -> list[tuple[str, str]]:
    return re.findall(r"checksum step (\d+): (\w+)", output)


@pytest.mark.skipif(SKIP is not None, reason=SKIP or "")
def test_training_across_namespaced_hosts_on_shaped_links():
    net, outputs = _train_on_hosts()
    # servers registered from their own hosts' addresses, found by routing to the scheduler
    for server in ("server0", "server1"):
        assert f"registered server at tcp://{net[server][1]}:" in outputs["scheduler"]
    sums = [_checksums(outputs[w]) for w in ("worker0", "worker1")]
    assert len(sums[0]) == 30 and sums[0] == sums[1]
    assert re.search(r"summary: accuracy=0\.[5-9]", outputs["worker0"])


LOSS_SKIP = SKIP or netns.loss_unavailable()


@pytest.mark.skipif(LOSS_SKIP is not None, reason=LOSS_SKIP or "")
def test_lossy_links_give_the_clean_run_exactly():
    """3% of the packets on each worker's link are dropped, both ways: TCP resends them, and
    every step's parameters equal the clean run's."""
    _, clean = _train_on_hosts()
    _, lossy = _train_on_hosts(loss=0.03)
    for worker in ("worker0", "worker1"):
        assert len(_checksums(lossy[worker])) == 30
        assert _checksums(lossy[worker]) == _checksums(clean[worker])


@pytest.mark.skipif(LOSS_SKIP is not None, reason=LOSS_SKIP or "")
def test_a_link_that_drops_every_packet_is_named_within_seconds():
    """Mid-training, every packet between worker 1 and server 0 is dropped (no reset, no
    close). Within the heartbeat timeout and a few seconds, the job ends on every role,
    worker 1 naming the server it cannot reach."""
    names = ["scheduler", "server0", "worker0", "worker1"]
    with netns.hosts(names, rate="1gbit", delay="0.2ms") as net:
        base = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "BYTEPS_"))}
        base.update(FAST, DMLC_PS_ROOT_URI=net["scheduler"][1], DMLC_PS_ROOT_PORT="9000",
                    DMLC_NUM_SERVER="1", DMLC_NUM_WORKER="2", BYTEPS_LOCAL_SIZE="1")
        launch = [sys.executable, "-m", "adtopk_ps.launcher"]
        job = [sys.executable, "-m", "worker", "--config", str(ROOT / "configs" / "digits-cnn.yaml"),
               "--steps", "100000", "--set", "progress=false"]
        procs = {}
        try:
            _start(net, names, base, launch, job, procs)
            first = procs["scheduler"].stdout.readline  # the scheduler says when the job starts
            while "job started" not in first():
                assert procs["scheduler"].poll() is None
            time.sleep(5)  # training is under way
            netns.cut(net["worker1"][0], net["server0"][1])
            cut_at = time.monotonic()
            outputs = {name: p.communicate(timeout=60)[0] for name, p in procs.items()}
            took = time.monotonic() - cut_at
        finally:
            for p in procs.values():
                if p.poll() is None:
                    p.kill()
                    p.wait()
    assert all(p.returncode != 0 for p in procs.values()), {n: o[-800:] for n, o in outputs.items()}
    assert "worker 1 cannot reach server 0" in outputs["worker1"], outputs["worker1"][-2000:]
    assert took < 20, took
