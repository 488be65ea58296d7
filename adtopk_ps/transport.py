"""Sockets and the link every node keeps to the scheduler (ps-lite's Van).

A node registers, waits for the address book, heartbeats, and learns from
the scheduler when a peer is lost or the job is over. The link never blocks
forever: every wait is bounded by the heartbeat timeout.
"""
from __future__ import annotations

import logging
import os
import time
import uuid

import zmq

from . import wire
from .cluster import ClusterConfig
from .env import env_int
from .security import Security, keys_from_env

log = logging.getLogger("adtopk_ps")


class ClusterError(RuntimeError):
    """The job cannot go on: a peer was lost, the scheduler refused us, or it went silent."""


_security: dict[int, Security] = {}


def security(ctx: zmq.Context) -> Security:
    """This process's CURVE setup for ``ctx`` (from PS_CURVE_KEYS), made once."""
    sec = _security.get(id(ctx))
    if sec is None:
        sec = _security[id(ctx)] = Security(ctx, keys_from_env())
    return sec


def make_socket(ctx: zmq.Context, kind: int, identity: str | None = None,
                curve: str | None = None) -> zmq.Socket:
    """A socket that never lingers; ``curve`` is "server" for one that binds, "client" for
    one that connects, None for inproc sockets (which never leave the process)."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity.encode())
    if curve == "server":
        security(ctx).server(sock)
    elif curve == "client":
        security(ctx).client(sock)
    return sock


def send(sock: zmq.Socket, frames: list, identity: bytes | None = None) -> None:
    if identity is not None:
        frames = [identity, *frames]
    sock.send_multipart(frames, copy=False)


def drain(sock: zmq.Socket, limit: int = 64):
    """Messages already waiting on a socket, up to ``limit``, without blocking."""
    for _ in range(limit):
        try:
            yield sock.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return


class SchedulerLink:
    """A node's DEALER to the scheduler, and what the scheduler tells it."""

    def __init__(self, ctx: zmq.Context, config: ClusterConfig):
        self.config = config
        self.identity = f"{config.role}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.sock = make_socket(ctx, zmq.DEALER, self.identity, curve="client")
        self.sock.connect(config.scheduler_address)
        self.rank = -1
        self.book: dict = {}
        self.shutdown = False
        self.barrier_done = 0
        self._last_heard = self._last_sent = time.monotonic()
        self._server_id = {"server_id": env_int("PS_SERVER_ID", minimum=0)} \
            if config.role == "server" and os.environ.get("PS_SERVER_ID", "").strip() else {}

    def register(self, data_port: int = 0) -> dict:
        """Announce this node and wait for the address book (bounded by the registration timeout).

        A server sends ``PS_SERVER_ID`` (set by ``bpslaunch --local``) when it is set: the rank
        it asks for, so that its launcher's label and its rank name the same server.
        """
        cfg = self.config
        wid = -1 if cfg.worker_id is None else cfg.worker_id
        self._send("register", role=cfg.role, worker_id=wid, host=cfg.node_host, port=data_port,
                   **self._server_id)
        deadline = time.monotonic() + register_timeout()
        while not self.book:
            if time.monotonic() > deadline:
                raise ClusterError(f"no address book from the scheduler at {cfg.scheduler_address} "
                                   f"within {register_timeout():.0f} s (PS_REGISTER_TIMEOUT_S)")
            if self.sock.poll(int(cfg.heartbeat_interval * 1000)):
                self.handle(self.sock.recv_multipart(copy=False))
            self.tick(expect_scheduler=False)
        return self.book

    def _send(self, op: str, **extra) -> None:
        send(self.sock, wire.encode(op, sender=max(self.rank, 0), **extra))
        self._last_sent = time.monotonic()

    def handle(self, frames: list) -> wire.Message:
        """Act on one message from the scheduler; raises ``ClusterError`` when the job must end."""
        try:
            msg = wire.decode(frames)
        except wire.WireError as exc:
            raise ClusterError(f"malformed message from the scheduler: {exc}") from None
        self._last_heard = time.monotonic()
        if msg.op == "addressbook":
            self.rank = msg.extra["rank"]
            self.book = msg.extra
        elif msg.op == "node_lost":
            raise ClusterError(f"{msg.extra.get('what', 'a peer was lost')}; ending the job")
        elif msg.op == "error":
            raise ClusterError(f"the scheduler refused this node: {msg.extra.get('message')}")
        elif msg.op == "shutdown":
            self.shutdown = True
        elif msg.op == "barrier_done":
            self.barrier_done = msg.round
        return msg

    def tick(self, expect_scheduler: bool = True) -> None:
        """Heartbeat when due; raise if the scheduler has gone silent."""
        now = time.monotonic()
        if now - self._last_sent >= self.config.heartbeat_interval:
            self._send("heartbeat")
        if expect_scheduler and now - self._last_heard > self.config.heartbeat_timeout:
            raise ClusterError(f"scheduler at {self.config.scheduler_address} silent for "
                               f"{now - self._last_heard:.1f} s (timeout "
                               f"{self.config.heartbeat_timeout:.1f} s); ending the job")

    def barrier(self, seq: int) -> None:
        self._send("barrier", round=seq)

    def finish(self) -> None:
        self._send("finish")

    def close(self) -> None:
        self.sock.close(0)


def register_timeout() -> float:
    return float(env_int("PS_REGISTER_TIMEOUT_S", 600, minimum=1))
