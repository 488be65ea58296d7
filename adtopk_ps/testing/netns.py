"""Test hosts in network namespaces, joined by veth pairs to a bridge in a switch namespace.

Nothing touches the machine's own network namespace: every link, address and
qdisc lives in namespaces made here, and deleting them removes it all.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from contextlib import contextmanager
from typing import Iterator, Mapping, Sequence

from adtopk_ps.deathsig import guarded


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=check)


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    if not shutil.which("ip") or not shutil.which("tc"):
        return "needs iproute2 (ip and tc)"
    probe = f"adtk-probe-{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


@contextmanager
def hosts(names: Sequence[str], subnet: str = "10.213.0", rate: str = "1gbit",
          delay: str = "0.2ms") -> Iterator[dict[str, tuple[str, str]]]:
    """Yields {name: (namespace, address)}; every link is shaped in both directions.

    The host's own end limits what it sends and the switch's end what it
    receives, as a switch port of that rate would: a server that several
    workers push to at once shares one link's rate among them.
    """
    tag = f"adtk{os.getpid() % 100000}"
    switch = f"{tag}-sw"
    made = []
    try:
        _ip("netns", "add", switch)
        made.append(switch)
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        out = {}
        for i, name in enumerate(names):
            ns, address = f"{tag}-{name}", f"{subnet}.{i + 1}"
            _ip("netns", "add", ns)
            made.append(ns)
            _ip("link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", f"p{i}",
                "netns", switch)
            _ip("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
            for dev in ("lo", "eth0"):
                _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", switch, "link", "set", f"p{i}", "master", "br0", "up")
            shape(ns, "eth0", rate, delay)
            shape(switch, f"p{i}", rate, delay)
            out[name] = (ns, address)
        yield out
    finally:
        for ns in reversed(made):
            _ip("netns", "del", ns, check=False)


@contextmanager
def loopback(names: Sequence[str]) -> Iterator[dict[str, tuple[None, str]]]:
    """The same hosts all on this machine's loopback, unshaped: for machines that cannot make
    namespaces (a container without the privilege). :func:`run_in` runs their commands here."""
    yield {name: (None, "127.0.0.1") for name in names}


# tbf's bucket: what a link idle long enough sends at once, before the rate holds it
TBF_BURST_BYTES = 256 << 10


def shape(ns: str, dev: str, rate: str, delay: str) -> None:
    """netem (rate and delay) on what ``dev`` sends where the kernel has it, else tbf (rate only,
    with a bucket of TBF_BURST_BYTES)."""
    tc = ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root"]
    netem = subprocess.run(tc + ["netem", "delay", delay, "rate", rate], capture_output=True,
                           text=True, timeout=30)
    if netem.returncode != 0:
        if "unknown" not in netem.stderr:
            raise RuntimeError(f"tc netem failed: {netem.stderr.strip()}")
        subprocess.run(tc + ["tbf", "rate", rate, "burst", f"{TBF_BURST_BYTES}b", "latency", "50ms"],
                       check=True, timeout=30)


def shaper(ns: str, dev: str = "eth0") -> str:
    """Which shaping :func:`shape` put on ``dev`` of host ``ns``: "netem" or "tbf"."""
    shown = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "show", "dev", dev],
                           capture_output=True, text=True, timeout=30, check=True).stdout
    for kind in ("netem", "tbf"):
        if f"qdisc {kind} " in shown:
            return kind
    raise RuntimeError(f"{ns} {dev}: no netem or tbf qdisc ({shown.strip()!r})")


def run_in(ns: str | None, argv: Sequence[str], env: Mapping[str, str], **popen) -> subprocess.Popen:
    """``argv`` on host ``ns`` (None: this machine, see :func:`loopback`); it ends with this
    process (a harness killed by a timeout leaves no role processes behind)."""
    where = [] if ns is None else ["ip", "netns", "exec", ns]
    return subprocess.Popen(guarded([*where, *argv]), env=env, **popen)


def loss_unavailable() -> str | None:
    """Why random packet loss cannot be added here, or None."""
    if shutil.which("iptables") is None:
        return "needs iptables (Debian package iptables) for random packet loss"
    return None


def drop(ns: str, share: float) -> None:
    """Drop a random ``share`` of the packets a host sends and of those it receives.

    An iptables ``statistic`` rule, which works where the kernel lacks netem
    (as this machine's does); TCP retransmits what is lost, so a job must
    come out exactly as on a clean link, only later.
    """
    for chain in ("OUTPUT", "INPUT"):
        subprocess.run(["ip", "netns", "exec", ns, "iptables", "-A", chain, "-m", "statistic",
                        "--mode", "random", "--probability", str(share), "-j", "DROP"],
                       check=True, capture_output=True, text=True, timeout=30)


def cut(ns: str, peer: str) -> None:
    """Drop every packet between host ``ns`` and the address ``peer``, both ways, with no
    reset or close: a broken switch or a firewall, as the two ends see it."""
    for chain, side in (("OUTPUT", "-d"), ("INPUT", "-s")):
        subprocess.run(["ip", "netns", "exec", ns, "iptables", "-A", chain, side, peer, "-j",
                        "DROP"], check=True, capture_output=True, text=True, timeout=30)
