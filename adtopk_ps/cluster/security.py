"""Who may talk to a server: the job's secret on every data connection, and optional
CurveZMQ on every socket (authenticated and encrypted, or refused).

Without CURVE, a server's data port still admits only connections that prove the job's
secret, which the scheduler hands every node it registers with the address book (or
``PS_JOB_SECRET``, where a deployment shares one): zmq's PLAIN mechanism, checked by a
ZAP handler (:class:`JobGate`) before the connection's first message reaches the server.
A process that reaches the port but was never registered cannot push for a rank, nor be
stored. PLAIN is not encrypted: on a network others can watch, use CURVE.

The cluster shares one key pair, made by ``bpslaunch keygen DIR``. Sockets
that bind (the scheduler's, each server's) are CURVE servers with that
pair; sockets that connect are CURVE clients holding it too; a ZAP
authenticator admits only clients whose public key is the cluster's. A peer
without the secret key cannot complete the handshake, so nothing it sends
reaches the application.

Set ``PS_CURVE_KEYS`` to the directory holding ``cluster.key_secret`` (a
Kubernetes Secret mounted as files works) on every role.
"""
from __future__ import annotations

import hmac
import logging
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from adtopk_ps.core.env import EnvError

KEY_NAME = "cluster"
#: the PLAIN user name a data connection proves the job's secret under
JOB_USER = b"adtopk-ps"
#: the endpoint libzmq asks for a connection's verdict (ZAP, RFC 27)
ZAP_ENDPOINT = "inproc://zeromq.zap.01"
#: connections that may wait for a verdict before the job's secret is known
PENDING_LIMIT = 4096

log = logging.getLogger("adtopk_ps")


def job_secret_from_env(environ: Mapping[str, str] | None = None) -> str:
    """The job's secret: ``PS_JOB_SECRET`` where a deployment shares one, else a fresh one
    (made once, by the scheduler, and handed to every node it registers)."""
    env = os.environ if environ is None else environ
    shared = env.get("PS_JOB_SECRET", "").strip()
    if shared and len(shared) < 16:
        raise EnvError(f"environment variable PS_JOB_SECRET holds {len(shared)} characters; "
                       f"a job's secret needs at least 16 (make one with: "
                       f"python -c 'import secrets; print(secrets.token_hex(16))')")
    return shared or secrets.token_hex(16)


class JobGate:
    """The ZAP handler of a process whose data socket binds without CURVE: a connection is
    admitted when it proves the job's secret with PLAIN, and refused otherwise (a plain
    socket, another job's secret). Requests that come before the secret is known (a worker
    that got the address book a moment before this server did) wait for it; the server's
    loop polls :attr:`sock` and calls :meth:`serve`.

    Example::

        gate = JobGate(ctx)          # before a socket with plain_server binds
        gate.admit(b"the secret")    # from the address book
        gate.serve()                 # each time gate.sock is readable
    """

    def __init__(self, ctx: zmq.Context):
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(ZAP_ENDPOINT)
        self.secret: bytes | None = None
        self.pending: list[list[bytes]] = []
        self.refused = 0

    def admit(self, secret: bytes) -> None:
        """Know the job's secret, and answer the connections that waited for it."""
        self.secret = secret
        pending, self.pending = self.pending, []
        for request in pending:
            self._answer(request)

    def serve(self) -> None:
        """Answer every request that has come (or keep it until the secret is known)."""
        while True:
            try:
                request = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if self.secret is not None:
                self._answer(request)
            elif len(self.pending) < PENDING_LIMIT:
                self.pending.append(request)
            else:  # a flood of connections before the job formed: refused, not held
                self._answer(request)

    def _answer(self, request: list[bytes]) -> None:
        try:
            split = request.index(b"")
        except ValueError:
            return  # not a ZAP request (only libzmq writes to this endpoint)
        envelope, body = request[:split + 1], request[split + 1:]
        if len(body) < 6:
            return
        _, request_id, _, address, _, mechanism, *credentials = body
        ok = (self.secret is not None and mechanism == b"PLAIN" and len(credentials) == 2
              and credentials[0] == JOB_USER and hmac.compare_digest(credentials[1], self.secret))
        if not ok:
            self.refused += 1
            if self.refused in (1, 10, 100) or self.refused % 1000 == 0:
                log.warning("refused a connection from %s: it does not prove this job's secret "
                            "(%d refused so far)", address.decode(errors="replace"), self.refused)
        status = (b"200", b"OK") if ok else (b"400", b"not this job's secret")
        self.sock.send_multipart([*envelope, b"1.0", request_id, *status, b"" if not ok else JOB_USER, b""])

    def close(self) -> None:
        self.sock.close(0)


@dataclass(frozen=True)
class CurveKeys:
    """The cluster's CURVE key pair and where it was read from."""

    public: bytes
    secret: bytes
    directory: Path


def keygen(directory: str | Path) -> Path:
    """Write a fresh cluster key pair into ``directory``; returns the secret file's path."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    _, secret = zmq.auth.create_certificates(str(path), KEY_NAME)
    os.chmod(secret, 0o600)
    return Path(secret)


def keys_from_env(environ: Mapping[str, str] | None = None) -> CurveKeys | None:
    """The key pair in ``PS_CURVE_KEYS``, or None when it is unset; a bad directory raises ``EnvError``."""
    env = os.environ if environ is None else environ
    directory = env.get("PS_CURVE_KEYS", "").strip()
    if not directory:
        return None
    secret_file = Path(directory) / f"{KEY_NAME}.key_secret"
    if not secret_file.is_file():
        raise EnvError(f"environment variable PS_CURVE_KEYS={directory!r}: no {secret_file.name} "
                       f"there (make one with: bpslaunch keygen DIR)")
    try:
        public, secret = zmq.auth.load_certificate(str(secret_file))
    except (ValueError, OSError) as exc:
        raise EnvError(f"environment variable PS_CURVE_KEYS={directory!r}: {exc}") from None
    if not secret:
        raise EnvError(f"environment variable PS_CURVE_KEYS={directory!r}: {secret_file.name} "
                       f"holds no secret key")
    return CurveKeys(public, secret, Path(directory))


class Security:
    """Applies the cluster's keys (or the job's secret) to the sockets of one process."""

    def __init__(self, ctx: zmq.Context, keys: CurveKeys | None):
        self.ctx, self.keys = ctx, keys
        self._auth = None
        self.job_secret: bytes | None = None  # from the address book
        self.gate: JobGate | None = None  # where a data socket binds without CURVE
        if keys is not None:
            self._auth = ThreadAuthenticator(ctx)
            self._auth.start()
            self._auth.configure_curve(domain="*", location=str(keys.directory))

    def server(self, sock: zmq.Socket, data: bool = False) -> zmq.Socket:
        """Make a binding socket a CURVE server; without keys, a data socket (``data``)
        admits only connections that prove the job's secret."""
        if self.keys is not None:
            sock.curve_secretkey = self.keys.secret
            sock.curve_publickey = self.keys.public
            sock.curve_server = True
        elif data:
            if self.gate is None:
                self.gate = JobGate(self.ctx)
                if self.job_secret is not None:
                    self.gate.admit(self.job_secret)
            sock.plain_server = True
        return sock

    def client(self, sock: zmq.Socket, data: bool = False) -> zmq.Socket:
        """Make a connecting socket a CURVE client; without keys, a data socket (``data``)
        proves the job's secret."""
        if self.keys is not None:
            sock.curve_secretkey = self.keys.secret
            sock.curve_publickey = self.keys.public
            sock.curve_serverkey = self.keys.public
        elif data and self.job_secret is not None:
            sock.plain_username = JOB_USER
            sock.plain_password = self.job_secret
        return sock

    def admit(self, secret: str) -> None:
        """Know the job's secret (the address book's), for the data sockets made from here on
        and the connections this process's gate judges."""
        self.job_secret = secret.encode()
        if self.gate is not None:
            self.gate.admit(self.job_secret)

    def close(self) -> None:
        """Stop the ZAP authenticator or the gate, if one runs."""
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        if self.gate is not None:
            self.gate.close()
            self.gate = None
