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


def _fault_mid_training(fault, steps: int = 100000, timeout: float = 60,
                        **env: str) -> tuple[dict, dict, dict, float]:
    """A scheduler, one server and two workers each on its own host, training; 5 s after the
    job starts, ``fault(net)`` (iptables rules, say). Returns the hosts, every role's exit
    status and output, and the seconds from the fault to the last role's exit."""
    names = ["scheduler", "server0", "worker0", "worker1"]
    with netns.hosts(names, rate="1gbit", delay="0.2ms") as net:
        base = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "BYTEPS_"))}
        base.update(FAST, DMLC_PS_ROOT_URI=net["scheduler"][1], DMLC_PS_ROOT_PORT="9000",
                    DMLC_NUM_SERVER="1", DMLC_NUM_WORKER="2", BYTEPS_LOCAL_SIZE="1", **env)
        launch = [sys.executable, "-m", "adtopk_ps.launcher"]
        job = [sys.executable, "-m", "worker", "--config", str(ROOT / "configs" / "digits-cnn.yaml"),
               "--steps", str(steps), "--checksums", "--set", "progress=false"]
        procs = {}
        try:
            _start(net, names, base, launch, job, procs)
            first = procs["scheduler"].stdout.readline  # the scheduler says when the job starts
            while "job started" not in first():
                assert procs["scheduler"].poll() is None
            time.sleep(5)  # training is under way
            fault(net)
            fault_at = time.monotonic()
            outputs = {name: p.communicate(timeout=timeout)[0] for name, p in procs.items()}
            took = time.monotonic() - fault_at
        finally:
            for p in procs.values():
                if p.poll() is None:
                    p.kill()
                    p.wait()
    return net, {name: p.returncode for name, p in procs.items()}, outputs, took


@pytest.mark.skipif(LOSS_SKIP is not None, reason=LOSS_SKIP or "")
def test_a_link_that_drops_every_packet_is_named_within_seconds():
    """Mid-training, every packet between worker 1 and server 0 is dropped (no reset, no
    close). Within the heartbeat timeout and a few seconds, the job ends on every role,
    worker 1 naming the server it cannot reach."""
    _, status, outputs, took = _fault_mid_training(
        lambda net: netns.cut(net["worker1"][0], net["server0"][1]))
    assert all(status.values()), {n: o[-800:] for n, o in outputs.items()}
    assert "worker 1 cannot reach server 0" in outputs["worker1"], outputs["worker1"][-2000:]
    assert took < 20, took


def _drop_connection(net: dict) -> None:
    """Drop every packet of worker 1's open connection to server 0, both ways, and nothing
    else: a NAT or conntrack entry that expired. zmq's next connection takes another port."""
    ns, server = net["worker1"][0], net["server0"][1]
    listed = subprocess.run(["ip", "netns", "exec", ns, "ss", "-tnH", "state", "established",
                             "dst", server], capture_output=True, text=True, check=True).stdout
    ports = {line.split()[2].rsplit(":", 1)[1] for line in listed.splitlines()}
    assert len(ports) == 1, listed  # the worker's one data connection to the server
    port = ports.pop()
    for chain, side, own in (("OUTPUT", "-d", "--sport"), ("INPUT", "-s", "--dport")):
        subprocess.run(["ip", "netns", "exec", ns, "iptables", "-A", chain, "-p", "tcp", side,
                        server, own, port, "-j", "DROP"], check=True, timeout=30)


@pytest.mark.skipif(LOSS_SKIP is not None, reason=LOSS_SKIP or "")
def test_a_connection_that_silently_dies_costs_seconds_and_loses_nothing():
    """Mid-training, every packet of worker 1's connection to server 0 is dropped. The
    heartbeats close it, zmq opens another, worker 1 sends again what had no answer, and the
    server drops what it already held: the job ends as a clean one does, the replicas equal,
    with no stall blamed on a worker."""
    _, status, outputs, took = _fault_mid_training(_drop_connection, steps=200, timeout=120)
    assert not any(status.values()), {n: o[-1500:] for n, o in outputs.items()}
    assert re.search(r"worker 1: the connection to server 0 \(tcp://[\d.:]+\) closed and came "
                     r"back; \d+ message\(s\) without an answer sent again", outputs["worker1"]), \
        outputs["worker1"][-2000:]
    sums = [_checksums(outputs[w]) for w in ("worker0", "worker1")]
    assert len(sums[0]) == 200 and sums[0] == sums[1]
    assert "pushed nothing" not in outputs["server0"] + outputs["scheduler"]


@pytest.mark.skipif(LOSS_SKIP is not None, reason=LOSS_SKIP or "")
def test_a_link_that_drops_large_packets_is_named_as_the_link_within_30_s():
    """Mid-training, worker 1's packets of 1,200 bytes or more to server 0 are dropped; small
    ones (the heartbeats) pass. The connection closes again and again; worker 1 names the
    link, not a hung loop, and the job ends on every role."""
    def black_hole(net: dict) -> None:
        subprocess.run(["ip", "netns", "exec", net["worker1"][0], "iptables", "-A", "OUTPUT",
                        "-d", net["server0"][1], "-m", "length", "--length", "1200:65535",
                        "-j", "DROP"], check=True, timeout=30)
    _, status, outputs, took = _fault_mid_training(black_hole)
    assert all(status.values()), {n: o[-800:] for n, o in outputs.items()}
    assert re.search(r"worker 1 -> server 0 \(tcp://[\d.:]+\): messages are not delivered",
                     outputs["worker1"]), outputs["worker1"][-2000:]
    assert "pushed nothing" not in outputs["server0"] + outputs["scheduler"]
    assert took < 30, took
