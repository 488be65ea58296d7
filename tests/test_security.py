"""CURVE on every socket: keyed peers work, anyone else is refused before the application."""
import subprocess
import sys

import pytest
import torch
import zmq

from adtopk_ps import wire
from adtopk_ps.client.ps_client import PSClient
from adtopk_ps.compression import create
from adtopk_ps.core.env import EnvError
from adtopk_ps.cluster.security import keygen, keys_from_env

from procs import roles


def _attempt(address, keys=None):
    """A push to a server; returns the reply, or None when nothing came back."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        public, secret = keys
        sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = public, secret, public
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


def test_the_same_server_without_keys_does_answer_a_plaintext_push():
    """The control for the test above: without CURVE the attempt gets a reply."""
    with roles(1, 1) as (config, _):
        client = PSClient(config)
        reply = _attempt(client.servers[0])
        assert reply is not None and reply.op == wire.Op.RESULT
        client.shutdown()


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
