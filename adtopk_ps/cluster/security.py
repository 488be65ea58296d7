"""Optional CurveZMQ on every socket: authenticated and encrypted, or refused.

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

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from adtopk_ps.core.env import EnvError

KEY_NAME = "cluster"


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
    """Applies the cluster's keys (or nothing) to the sockets of one process."""

    def __init__(self, ctx: zmq.Context, keys: CurveKeys | None):
        self.keys = keys
        self._auth = None
        if keys is not None:
            self._auth = ThreadAuthenticator(ctx)
            self._auth.start()
            self._auth.configure_curve(domain="*", location=str(keys.directory))

    def server(self, sock: zmq.Socket) -> zmq.Socket:
        """Make a binding socket a CURVE server (unchanged without keys)."""
        if self.keys is not None:
            sock.curve_secretkey = self.keys.secret
            sock.curve_publickey = self.keys.public
            sock.curve_server = True
        return sock

    def client(self, sock: zmq.Socket) -> zmq.Socket:
        """Make a connecting socket a CURVE client (unchanged without keys)."""
        if self.keys is not None:
            sock.curve_secretkey = self.keys.secret
            sock.curve_publickey = self.keys.public
            sock.curve_serverkey = self.keys.public
        return sock

    def close(self) -> None:
        """Stop the ZAP authenticator, if one runs."""
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
