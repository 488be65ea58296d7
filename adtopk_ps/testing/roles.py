"""Starting the roles of a benchmark run, each on its own host (a network namespace) or all
on this machine's loopback, and ending them.

A run's ``net`` maps each role's name (``scheduler``, ``server0``, ``worker1``) to
(its namespace or None, its address), as :mod:`.netns` makes it.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from adtopk_ps.allocator import keep_freed_memory
from adtopk_ps.launcher import free_port
from adtopk_ps.testing import netns

ROOT = Path(__file__).resolve().parents[2]  # the tree whose packages the roles run


def role_names(kind: str, servers: int, workers: int) -> list[str]:
    """The hosts a run's roles take: a PS system's scheduler and servers, then the workers."""
    return (["scheduler"] + [f"server{i}" for i in range(servers)] if kind == "ps" else []) + \
        [f"worker{i}" for i in range(workers)]


def shares_one_host(net: dict) -> bool:
    """Whether every role runs on this machine's loopback (netns.loopback), so no fixed ports."""
    return net["scheduler"][0] is None


def role_env(net: dict, servers: int, workers: int) -> dict[str, str]:
    """The environment every role of a run starts with: this one less any DMLC_/BYTEPS_
    settings, the cluster's, and this tree's packages first on the path."""
    shared = shares_one_host(net)
    # DDP's workers get the allocator settings bpslaunch gives ours, so compute costs the same
    env = keep_freed_memory({k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "BYTEPS_"))})
    env.update(DMLC_PS_ROOT_URI=net["scheduler"][1], DMLC_PS_ROOT_PORT=str(free_port() if shared else 9000),
               DMLC_NUM_SERVER=str(servers), DMLC_NUM_WORKER=str(workers),
               BYTEPS_LOCAL_SIZE="1", OMP_NUM_THREADS="1",
               # gloo's own address lookup would leave the namespace; likewise NCCL's (the dense
               # lane, GPU workers)
               GLOO_SOCKET_IFNAME="lo" if shared else "eth0",
               NCCL_SOCKET_IFNAME="lo" if shared else "eth0",
               PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    return env


def master_address(net: dict) -> str:
    """host:port of worker 0's gloo rendezvous (DDP systems, and --paired)."""
    return f"{net['worker0'][1]}:{free_port() if shares_one_host(net) else 29500}"


def spawn_role(net: dict, role: str, kind: str, env: dict, job: list[str], stdout) -> subprocess.Popen:
    """``role`` on its host, its output (stderr too) to ``stdout``: a PS system's roles under
    bpslaunch's role mode (a worker's with ``job`` as its command), a DDP worker ``job`` alone."""
    role_env = {**env, "DMLC_ROLE": role.rstrip("0123456789")}
    if role.startswith("worker"):
        role_env["DMLC_WORKER_ID"] = role[len("worker"):]
    argv = ([sys.executable, "-m", "adtopk_ps.launcher"] if kind == "ps" else []) + \
        (job if role.startswith("worker") else [])
    return netns.run_in(net[role][0], argv, role_env, stdout=stdout, stderr=subprocess.STDOUT,
                        text=True, cwd=ROOT)


def kill_all(procs: list[subprocess.Popen]) -> None:
    """End every process of a run still going."""
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def require_gpu(device: str, who: str) -> None:
    """Exit, naming ``who``, where --device cuda was asked for and torch sees no GPU."""
    if device == "cuda":
        import torch
        if not torch.cuda.is_available():
            sys.exit(f"{who}: --device cuda, but torch sees no GPU here")


def role_pids(root: int, role: str, started_as: int | None = None) -> list[int]:
    """The processes of ``role`` below process ``root`` (a ``bpslaunch --local``), or only the
    one started as ``started_as`` (its PS_SERVER_ID or DMLC_WORKER_ID), from /proc: their
    environment names them."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parent = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry))
    below, todo = [], [root]
    while todo:
        for pid in children.get(todo.pop(), []):
            below.append(pid)
            todo.append(pid)
    ident = {"server": "PS_SERVER_ID", "worker": "DMLC_WORKER_ID"}.get(role, "")
    found = []
    for pid in below:
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"DMLC_ROLE={role}".encode() in environ and \
                (started_as is None or f"{ident}={started_as}".encode() in environ):
            found.append(pid)
    return found


def run_and_kill(cmd: list[str], env: dict, pattern: str, role: str,
                 started_as: int | list[int] | None, timeout: float = 300
                 ) -> tuple[subprocess.CompletedProcess, list[float]]:
    """Run ``bpslaunch --local`` ``cmd`` to its end, sending SIGKILL to its ``role`` processes
    (or those started as ``started_as``, one id or several) when a line of its output first
    matches ``pattern``; its result, and the wall-clock time of each kill."""
    launcher = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
    lines, killed = [], []
    deadline = time.monotonic() + timeout
    try:
        for line in launcher.stdout:
            lines.append(line)
            if not killed and re.search(pattern, line):
                ids = started_as if isinstance(started_as, list) else [started_as]
                for pid in [p for i in ids for p in role_pids(launcher.pid, role, i)]:
                    os.kill(pid, signal.SIGKILL)
                    killed.append(time.time())
            if time.monotonic() > deadline:
                break
        launcher.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    return subprocess.CompletedProcess(cmd, launcher.returncode, "".join(lines)), killed

