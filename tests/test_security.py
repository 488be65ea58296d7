"""CURVE on every socket: keyed peers work, anyone else is refused before the application."""
import subprocess
import sys
import threading
import time

import pytest
import torch
import zmq

from adtopk_ps import wire
from adtopk_ps.client.ps_client import PSClient
from adtopk_ps.compression import create
from adtopk_ps.core.env import EnvError
from adtopk_ps.cluster.security import JOB_USER, keygen, keys_from_env
from adtopk_ps.cluster.transport import security

from procs import roles


def _attempt(address, keys=None, job_secret=None):
    """A push to a server; returns the reply, or None when nothing came back."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        public, secret = keys
        sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = public, secret, public
    if job_secret is not None:
        sock.plain_username, sock.plain_password = JOB_USER, job_secret
    sock.connect(address)
    p = create("none").compress(torch.ones(4), "x")
    sock.send_multipart(wire.encode(wire.Op.PUSH, key=12345, round=0, sender=0, payload=p))
    reply = wire.decode(sock.recv_multipart()) if sock.poll(2000) else None
    sock.close()
    ctx.term()
    return reply


def test_keyed_cluster_works_and_refuses_peers_without_the_key(tmp_path, monkeypatch):
    keygen(tmp_path / "keys")
    other = keygen(tmp_path / "other")
    monkeypatch.setenv("PS_CURVE_KEYS", str(tmp_path / "keys"))
    with roles(1, 1, PS_CURVE_KEYS=str(tmp_path / "keys")) as (config, procs):
        client = PSClient(config, ctx=zmq.Context())
        x = torch.arange(8.0)
        assert torch.equal(client.push_pull(x, "x").wait(20), x)
        address = client.servers[0]
        assert _attempt(address) is None  # plaintext: the handshake never completes
        public, secret = zmq.auth.load_certificate(str(other))
        assert _attempt(address, (public, secret)) is None  # a key the cluster does not know
        # the refused peers never reached the application: the server rejected nothing
        assert torch.equal(client.push_pull(x * 3, "x").wait(20), x * 3)
        client.shutdown()
        assert procs[1].wait(20) == 0
        assert "0 message(s) rejected" in procs[1].stderr.read()


def test_without_keys_a_server_answers_only_connections_that_prove_the_jobs_secret():
    """Without CURVE a plain socket, or another job's secret, never reaches the server; the
    job's own secret (the address book's) does: the control for the test above."""
    with roles(1, 1) as (config, procs):
        ctx = zmq.Context()
        client = PSClient(config, ctx=ctx)
        secret = security(ctx).job_secret
        assert secret and len(secret) >= 32
        assert _attempt(client.servers[0]) is None
        assert _attempt(client.servers[0], job_secret=b"another job's secret") is None
        reply = _attempt(client.servers[0], job_secret=secret)
        assert reply is not None and reply.op == wire.Op.RESULT
        client.shutdown()
        assert procs[1].wait(20) == 0
        log = procs[1].stderr.read()
        assert "refused a connection from 127.0.0.1: it does not prove this job's secret" in log


def test_bad_key_directory_is_named(tmp_path):
    with pytest.raises(EnvError, match="PS_CURVE_KEYS=.*no cluster.key_secret"):
        keys_from_env({"PS_CURVE_KEYS": str(tmp_path)})
    env = {"PATH": "/usr/bin:/bin", "DMLC_ROLE": "scheduler", "DMLC_PS_ROOT_URI": "127.0.0.1",
           "DMLC_PS_ROOT_PORT": "9", "DMLC_NUM_WORKER": "1", "DMLC_NUM_SERVER": "1",
           "PS_CURVE_KEYS": str(tmp_path)}
    scheduler = subprocess.run([sys.executable, "-m", "adtopk_ps.launcher"], env=env,
                               capture_output=True, text=True, timeout=60)
    assert scheduler.returncode == 2 and "PS_CURVE_KEYS" in scheduler.stderr
    result = subprocess.run([sys.executable, "-m", "adtopk_ps.launcher", "keygen"], capture_output=True,
                            text=True, timeout=30)
    assert result.returncode == 2 and "directory" in result.stderr


def _rss_mb(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def _drained(stream) -> list[str]:
    """The lines of ``stream``, read by a thread as they come (a server that logs a
    refusal a message must never block on a full pipe)."""
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(stream), daemon=True).start()
    return lines


def test_a_stranger_squatting_every_rank_before_the_first_push_has_no_effect():
    """A plain socket, or one with another job's secret, that pushes for every rank before
    the workers do binds no rank: the workers' rounds are exact and nothing was rejected."""
    from procs import clients
    with roles(2, 1) as (config, procs):
        log = _drained(procs[1].stderr)
        workers = clients(config, 2)
        strangers = []
        for password in (None, b"a guess at the secret, 32 bytes!"):
            for rank in range(2):
                ctx = zmq.Context.instance()
                sock = ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                if password is not None:
                    sock.plain_username, sock.plain_password = JOB_USER, password
                sock.connect(workers[0].servers[0])
                p = create("none").compress(torch.ones(4), "x")
                sock.send_multipart(wire.encode(wire.Op.PUSH, key=0, round=0, sender=rank, payload=p))
                strangers.append(sock)
        time.sleep(1.0)  # time for them to arrive, were they let in
        x = [torch.arange(8.0), torch.arange(8.0) * 10]
        handles = [w.push_pull(t, "x") for w, t in zip(workers, x)]
        for h in handles:
            assert torch.equal(h.wait(20), (x[0] + x[1]) / 2)  # push_pull averages
        assert all(s.poll(0) == 0 for s in strangers)  # nothing came back to them
        for w in workers:
            w.shutdown()
        assert procs[1].wait(20) == 0
        text = "".join(log)
        assert "0 message(s) rejected" in text
        assert "refused a connection from 127.0.0.1: it does not prove this job's secret" in text
        for s in strangers:
            s.close(0)


def test_an_insider_flooding_a_future_epoch_or_a_foreign_rank_is_refused_and_stores_nothing():
    """Pushes for an epoch never announced, or from a rank no worker of the job can have,
    get an error naming why and are not kept: the server's memory stays within 50 MB of
    what it was, and the job's own rounds are exact."""
    from procs import clients, insider
    with roles(1, 1) as (config, procs):
        log = _drained(procs[1].stderr)
        client, = clients(config, 1)
        x = torch.arange(8.0)
        assert torch.equal(client.push_pull(x, "x").wait(20), x)
        before = _rss_mb(procs[1].pid)
        sock = insider(client.servers[0])
        big = create("none").compress(torch.ones(1 << 18), "x")  # 1 MiB a push
        cases = {"epoch": dict(sender=0, epoch=10 ** 6), "rank": dict(sender=9999, epoch=1)}
        for name, header in cases.items():
            for key in range(96):
                sock.send_multipart(wire.encode(wire.Op.PUSH, key=key, round=0, payload=big, **header))
            replies = []
            while len(replies) < 96 and sock.poll(20000):
                replies.append(wire.decode(sock.recv_multipart()))
            assert len(replies) == 96 and {r.op for r in replies} == {wire.Op.ERROR}
            words = "was never announced" if name == "epoch" else "not a worker rank of this job"
            assert all(words in r.extra["message"] for r in replies), replies[0].extra
        grown = _rss_mb(procs[1].pid) - before
        assert grown < 50, f"the server grew by {grown:.0f} MB"
        assert torch.equal(client.push_pull(x * 3, "x").wait(20), x * 3)
        sock.close(0)
        client.shutdown()
        assert procs[1].wait(20) == 0
        assert "192 message(s) rejected" in "".join(log)


def test_roles_of_a_local_cluster_listen_on_loopback_only():
    """bpslaunch --local gives every role PS_LISTEN_HOST=127.0.0.1: a port of the
    scheduler's or a server's is not reachable from another interface."""
    out = subprocess.run([sys.executable, "-m", "adtopk_ps.launcher", "--local", "--num-workers",
                          "1", "--num-servers", "1", "--", sys.executable, "-c",
                          "import os; print('listen', os.environ['PS_LISTEN_HOST'])"],
                         capture_output=True, text=True, timeout=120)
    assert "listen 127.0.0.1" in out.stdout, out.stdout + out.stderr
    with roles(1, 1, PS_LISTEN_HOST="127.0.0.1") as (config, procs):
        client = PSClient(config, ctx=zmq.Context())
        ports = {int(client.servers[0].rsplit(":", 1)[1]), config.root_port}
        listening = subprocess.run(["ss", "-ltnH"], capture_output=True, text=True, check=True).stdout
        local = {line.split()[3] for line in listening.splitlines()}
        for port in ports:
            assert f"127.0.0.1:{port}" in local, (port, sorted(local))
            assert f"0.0.0.0:{port}" not in local and f"*:{port}" not in local
        client.shutdown()


def test_a_listen_host_that_is_not_an_address_is_named():
    from adtopk_ps.cluster.membership import ClusterConfig
    env = {"DMLC_ROLE": "server", "DMLC_NUM_WORKER": "1", "DMLC_NUM_SERVER": "1",
           "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": "9", "PS_LISTEN_HOST": "lo"}
    with pytest.raises(EnvError, match="PS_LISTEN_HOST='lo' must be an IPv4 address"):
        ClusterConfig.from_env(env)
