"""Waiting is never silent, a refused node fails at once with the reason, a dead peer is
noticed by its closed connections (under CURVE too), and a clean finish is never a loss."""
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
import zmq

from adtopk_ps.client.ps_client import PSClient
from adtopk_ps.launcher import free_port
from adtopk_ps.cluster.liveness import RECONNECT_GRACE, Monitor
from adtopk_ps.cluster.security import keygen
from adtopk_ps.cluster.transport import ClusterError

from procs import clients as start_clients, cluster_env, roles

DEFAULTS = {"PS_HEARTBEAT_INTERVAL_MS": "500", "PS_HEARTBEAT_TIMEOUT_MS": "10000"}
COMMANDS = {"worker": [sys.executable, "-m", "worker.selfcheck", "--rounds", "3"],
            "server": [sys.executable, "-m", "server"]}


class Lines:
    """A process whose output lines are read as they come, each with its arrival time."""

    def __init__(self, argv, env):
        self.proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
        self.lines: list[tuple[float, str]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip()))

    def wait_for(self, text: str, timeout: float) -> float:
        """When a line holding ``text`` arrived; fails after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for at, line in list(self.lines):
                if text in line:
                    return at
            time.sleep(0.05)
        raise AssertionError(f"no line with {text!r} within {timeout} s:\n{self.text()}")

    def finish(self, timeout: float) -> int:
        code = self.proc.wait(timeout)
        self._reader.join(5)
        return code

    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def kill(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)


@pytest.mark.parametrize("role", ["worker", "server"])
def test_with_no_scheduler_a_node_says_so_every_few_seconds_then_gives_up(role):
    port = free_port()  # nothing listens there
    env = {**cluster_env(1, 1, port, **DEFAULTS), "DMLC_ROLE": role, "PS_REGISTER_TIMEOUT_S": "8"}
    node = Lines(COMMANDS[role], env)
    try:
        assert node.finish(60) != 0, node.text()
        address = f"tcp://127.0.0.1:{port}"
        waiting = [at for at, line in node.lines if "waiting up to" in line and address in line]
        gave_up = node.wait_for("gave up after 8 s (PS_REGISTER_TIMEOUT_S)", 1)
        assert address in node.text().split("gave up after", 1)[1], node.text()
        # the first notice 2 s into the wait, then every 5 s: at 2 and 7 s of the 8
        assert len(waiting) == 2, node.text()
        assert 5.0 <= gave_up - waiting[0] < 7.5, node.text()
        assert "is it running, and are DMLC_PS_ROOT_URI and DMLC_PS_ROOT_PORT right?" in node.text()
    finally:
        node.kill()


def test_a_duplicate_worker_id_is_refused_at_once_and_the_waiting_worker_says_why_it_waits():
    with roles(2, 1, **DEFAULTS) as (config, _):
        env = {**cluster_env(2, 1, config.root_port, **DEFAULTS), "DMLC_ROLE": "worker",
               "DMLC_WORKER_ID": "0"}
        first = Lines(COMMANDS["worker"], env)
        second = None
        try:
            first.wait_for("waiting for the other nodes: 1 of 2 worker(s) and 1 of 1 server(s)", 60)
            second = Lines(COMMANDS["worker"], env)
            assert second.finish(60) != 0
            assert "the scheduler refused this node: DMLC_WORKER_ID=0 is taken by another worker" \
                in second.text(), second.text()
            assert first.proc.poll() is None  # the first one still waits for worker 1
        finally:
            first.kill()
            if second is not None:
                second.kill()


def test_a_server_too_many_is_refused_at_once_with_the_reason():
    env = {**cluster_env(1, 1, free_port(), **DEFAULTS)}
    started = [Lines([sys.executable, "-m", "adtopk_ps.cluster.scheduler"], {**env, "DMLC_ROLE": "scheduler"})]
    try:
        started.append(Lines(COMMANDS["server"], {**env, "DMLC_ROLE": "server"}))
        started[1].wait_for("waiting for the other nodes: 0 of 1 worker(s) and 1 of 1 server(s)", 60)
        started.append(Lines(COMMANDS["server"], {**env, "DMLC_ROLE": "server"}))
        assert started[2].finish(60) != 0
        assert "the scheduler refused this node: all servers have already registered" \
            in started[2].text(), started[2].text()
    finally:
        for p in started:
            p.kill()


def test_a_worker_killed_before_the_start_can_be_replaced():
    """A node whose connection closed before the job started is dropped, so the same
    DMLC_WORKER_ID can register again; the job then runs to the end."""
    with roles(2, 1, **DEFAULTS) as (config, procs):
        env = {**cluster_env(2, 1, config.root_port, **DEFAULTS), "DMLC_ROLE": "worker"}
        first = Lines(COMMANDS["worker"], {**env, "DMLC_WORKER_ID": "0"})
        others = []
        try:
            first.wait_for("waiting for the other nodes: 1 of 2 worker(s)", 60)
            os.killpg(first.proc.pid, signal.SIGKILL)
            time.sleep(1.5)  # past the reconnect grace
            others = [Lines(COMMANDS["worker"], {**env, "DMLC_WORKER_ID": str(i)}) for i in (0, 1)]
            for w in others:
                assert w.finish(60) == 0, w.text()
                assert "selfcheck passed" in w.text()
            assert procs[0].wait(20) == 0 and procs[1].wait(20) == 0
        finally:
            for w in [first, *others]:
                w.kill()


def test_under_curve_a_killed_server_is_named_within_the_grace(tmp_path, monkeypatch):
    keygen(tmp_path / "keys")
    monkeypatch.setenv("PS_CURVE_KEYS", str(tmp_path / "keys"))
    with roles(1, 1, PS_CURVE_KEYS=str(tmp_path / "keys"), **DEFAULTS) as (config, procs):
        client = PSClient(config, ctx=zmq.Context())  # CURVE stays on a context once set up
        x = torch.arange(8.0)
        assert torch.equal(client.push_pull(x, "x").wait(20), x)
        address = client.servers[0]
        procs[1].kill()
        killed = time.monotonic()
        with pytest.raises(ClusterError) as failed:
            while time.monotonic() - killed < 15:
                client.push_pull(x, "x").wait(15)
                time.sleep(0.05)
        assert time.monotonic() - killed < 3.0
        # by the worker's own connection or by the scheduler's notice, whichever comes first
        assert f"worker 0 cannot reach server 0 ({address}): their connection" in \
            str(failed.value) or f"server 0 ({address}) lost: its connection" in \
            str(failed.value), failed.value
        assert procs[0].wait(5) == 1  # the scheduler noticed it too, under CURVE
        client.shutdown()


def test_a_clean_finish_is_never_a_lost_peer():
    """Workers finish in random order at random moments and the scheduler exits over
    its last shutdown notices: every role exits 0, and no server reports a loss."""
    rng = random.Random(17)
    for attempt in range(5):
        with roles(2, 2, **DEFAULTS) as (config, procs):
            clients = []
            try:
                clients = start_clients(config, 2)
                handles = [c.push_pull(torch.full((1000,), float(i)), "g") for i, c in enumerate(clients)]
                for h in handles:
                    assert torch.equal(h.wait(20), torch.full((1000,), 0.5))
                rng.shuffle(clients)
                for c in clients:
                    time.sleep(rng.random() * 0.3)
                    c.shutdown()
                codes = [p.wait(20) for p in procs]
                errors = "".join(p.stderr.read() for p in procs[1:])
                assert codes == [0, 0, 0], (attempt, codes, errors)
                assert "lost" not in errors, (attempt, errors)
            finally:
                for c in clients:
                    c.shutdown()


def test_a_connection_that_drops_and_comes_back_within_the_grace_is_not_a_loss():
    """``ss -K`` closes every TCP connection to the scheduler under the running job; zmq
    reconnects at once and the job goes on. A probe socket of the test's own shows that
    the connections really did close."""
    if shutil.which("ss") is None:
        pytest.skip("needs ss (iproute2) to close a live connection")
    with roles(1, 1, **DEFAULTS) as (config, procs):
        client = PSClient(config)
        x = torch.arange(8.0)
        assert torch.equal(client.push_pull(x, "x").wait(20), x)
        ctx = zmq.Context()
        probe = ctx.socket(zmq.DEALER)
        probe.setsockopt(zmq.LINGER, 0)
        monitor = Monitor(probe)
        probe.connect(config.scheduler_address)
        time.sleep(0.5)
        killed = subprocess.run(["ss", "-K", "dst", "127.0.0.1", "dport", "=", str(config.root_port)],
                                capture_output=True, text=True)
        time.sleep(0.5)
        events = [event for event, _ in monitor.events()]
        if zmq.EVENT_DISCONNECTED not in events:
            pytest.skip(f"ss -K closed nothing here: {killed.stderr.strip()}")
        time.sleep(RECONNECT_GRACE + 1)  # past the reconnect grace
        for step in range(3):
            assert torch.equal(client.push_pull(x * step, "x").wait(20), x * step)
        client.check()
        assert [p.poll() for p in procs] == [None, None]
        client.shutdown()
        assert [p.wait(20) for p in procs] == [0, 0]
        monitor.close()
        probe.close()
        ctx.term()


def test_a_node_without_the_clusters_keys_says_the_handshake_failed(tmp_path):
    keygen(tmp_path / "keys")
    env = cluster_env(1, 1, free_port(), **DEFAULTS)
    started = [Lines([sys.executable, "-m", "adtopk_ps.cluster.scheduler"],
                     {**env, "DMLC_ROLE": "scheduler", "PS_CURVE_KEYS": str(tmp_path / "keys")})]
    try:
        started.append(Lines(COMMANDS["server"], {**env, "DMLC_ROLE": "server",
                                                  "PS_REGISTER_TIMEOUT_S": "4"}))
        assert started[1].finish(60) != 0
        assert (f"gave up after 4 s (PS_REGISTER_TIMEOUT_S): server: the scheduler at "
                f"tcp://127.0.0.1:{env['DMLC_PS_ROOT_PORT']} answers, but the handshake with it "
                f"failed") in started[1].text(), started[1].text()
        assert "every role needs the same PS_CURVE_KEYS, or none" in started[1].text()
    finally:
        for p in started:
            p.kill()


def test_clients_one_after_another_in_one_process_never_stall_its_connections():
    """A closed client stops its socket monitors before their sockets close: a monitor left
    running blocks the context's I/O thread on events nobody reads, and every later
    connection of the process (the next test's clients, a resumed job) never starts."""
    for _ in range(20):  # the stall came within a dozen clusters
        with roles(2, 1) as (config, _):
            workers = start_clients(config, 2)
            handles = [w.push_pull(torch.ones(4), "x", average=False) for w in workers]
            assert [h.wait(20).tolist() for h in handles] == [[2.0] * 4] * 2
            for w in workers:
                w.shutdown()
