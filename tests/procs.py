"""Running real role processes from tests: bounded in time, cleaned up afterwards."""
import dataclasses
import os
import re
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from adtopk_ps.cluster.membership import ClusterConfig
from adtopk_ps.launcher import free_port

FAST = {"PS_HEARTBEAT_INTERVAL_MS": "200", "PS_HEARTBEAT_TIMEOUT_MS": "2000",
        "PS_REGISTER_TIMEOUT_S": "60"}


def bpslaunch(*args, env=None, timeout=120):
    """Run ``bpslaunch`` to completion; returns the CompletedProcess (output merged)."""
    full = {**os.environ, **FAST, **(env or {})}
    return subprocess.run([sys.executable, "-m", "adtopk_ps.launcher", *args], env=full,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout)


DIGITS_CNN = str(Path(__file__).resolve().parents[1] / "configs" / "digits-cnn.yaml")


def bpslaunch_timed(*args, env=None, timeout=120):
    """As :func:`bpslaunch`, noting when each line of output arrived: ``.arrivals`` holds
    (seconds since the start, line) pairs and ``.ended`` the seconds to the launcher's exit."""
    argv = [sys.executable, "-m", "adtopk_ps.launcher", *args]
    began = time.monotonic()
    proc = subprocess.Popen(argv, env={**os.environ, **FAST, **(env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    try:
        arrivals = [(time.monotonic() - began, line.rstrip("\n")) for line in proc.stdout]
        proc.wait()
    finally:
        timer.cancel()
        proc.kill()
    ended = time.monotonic() - began
    if ended >= timeout:
        raise subprocess.TimeoutExpired(argv, timeout)
    result = subprocess.CompletedProcess(argv, proc.returncode, "".join(f"{line}\n" for _, line in arrivals))
    result.arrivals, result.ended = arrivals, ended
    return result


def train_job(workers, servers, *args, config=DIGITS_CNN, timeout=240, timed=False, env=None):
    """The training job (``python -m worker``) on a local cluster, run to completion
    (``timed``: with the arrival time of each line, see :func:`bpslaunch_timed`)."""
    return (bpslaunch_timed if timed else bpslaunch)(
        "--local", "--num-workers", str(workers), "--num-servers", str(servers),
        "--timeout", str(timeout - 20), "--", sys.executable, "-m", "worker",
        "--config", config, *args, timeout=timeout, env=env)


def checksums(out):
    """``{step: {worker: digest}}`` from a ``--checksums`` run's output."""
    by_step = {}
    for worker, step, digest in re.findall(r"\[worker (\d+)\] checksum step (\d+): (\w+)", out):
        by_step.setdefault(int(step), {})[int(worker)] = digest
    return by_step


def selfcheck(workers, servers, *args, env=None, timeout=180):
    return bpslaunch("--local", "--num-workers", str(workers), "--num-servers", str(servers),
                     "--timeout", str(timeout - 20), "--", sys.executable, "-m", "worker.selfcheck",
                     *args, env=env, timeout=timeout)


def cluster_env(workers, servers, port, **extra):
    return {**os.environ, **FAST, "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": str(port),
            "DMLC_NUM_WORKER": str(workers), "DMLC_NUM_SERVER": str(servers),
            "DMLC_NODE_HOST": "127.0.0.1", **extra}


@contextmanager
def roles(workers, servers, **extra):
    """A scheduler and ``servers`` server processes; yields the workers' ClusterConfig."""
    port = free_port()
    env = cluster_env(workers, servers, port, **extra)
    procs = [subprocess.Popen([sys.executable, "-m", "adtopk_ps.cluster.scheduler"],
                              env={**env, "DMLC_ROLE": "scheduler"}, start_new_session=True,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    procs += [subprocess.Popen([sys.executable, "-m", "server"], env={**env, "DMLC_ROLE": "server"},
                               start_new_session=True, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)
              for _ in range(servers)]
    try:
        yield ClusterConfig.from_env({**env, "DMLC_ROLE": "worker"}), procs
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)


def insider(address):
    """A DEALER on this process's shared context connected to the server at ``address``,
    holding the job's secret as every registered node does (its clients got it with the
    address book): messages from inside the job, not from a stranger."""
    import zmq
    from adtopk_ps.cluster.security import JOB_USER
    from adtopk_ps.cluster.transport import security
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.plain_username, sock.plain_password = JOB_USER, security(ctx).job_secret
    sock.connect(address)
    return sock


def clients(config, n):
    """``n`` worker clients of one cluster, registered concurrently (the address book
    arrives only when every worker has registered)."""
    from adtopk_ps.client.ps_client import PSClient
    out = [None] * n

    def start(i):
        out[i] = PSClient(dataclasses.replace(config, worker_id=i))
    threads = [threading.Thread(target=start, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(out), "a worker client did not start"
    return out
