"""Sockets and the link every node keeps to the scheduler (ps-lite's Van).

A node registers, waits for the address book, heartbeats, and learns from
the scheduler when a peer is lost or the job is over. The link never blocks
forever: every wait is bounded by the heartbeat timeout, a closed connection
to the scheduler ends the job within ``RECONNECT_GRACE``, and a node waiting
to register says every few seconds what it is waiting for.
"""
from __future__ import annotations

import logging
import os
import time
import uuid
from typing import Callable, Mapping

import zmq

from adtopk_ps import wire
from adtopk_ps.cluster.liveness import PeerWatch
from adtopk_ps.cluster.membership import ClusterConfig
from adtopk_ps.cluster.security import Security, keys_from_env
from adtopk_ps.core.env import env_int
from adtopk_ps.wire import Op

log = logging.getLogger("adtopk_ps")


WAIT_NOTICE_S = (2.0, 5.0)  # a waiting node's first notice, then one every this often


class ClusterError(RuntimeError):
    """The job cannot go on: a peer was lost, the scheduler refused us, or it went silent."""


class RegistrationRefused(ClusterError):
    """The scheduler refused this node as it registered (another job's, another shape or
    config, a running job that takes no one): the job, if one runs, goes on without it."""


def exit_status(value: object) -> int:
    """A failed worker's exit status as a message carries it: 1 unless it is one a process
    can exit with and that reports a failure (1-255)."""
    return value if type(value) is int and 1 <= value <= 255 else 1


_security: dict[int, Security] = {}


def security(ctx: zmq.Context) -> Security:
    """This process's CURVE setup for ``ctx`` (from PS_CURVE_KEYS), made once."""
    sec = _security.get(id(ctx))
    if sec is None:
        sec = _security[id(ctx)] = Security(ctx, keys_from_env())
    return sec


def make_socket(ctx: zmq.Context, kind: int, identity: str | None = None,
                curve: str | None = None, data: ClusterConfig | None = None) -> zmq.Socket:
    """A socket that never lingers; ``curve`` is "server" for one that binds, "client" for
    one that connects, None for inproc sockets (which never leave the process).

    ``data``: the cluster's config, for a socket of the data path (pushes and answers):
    - its high-water marks are unlimited. zmq's default of 1,000 messages makes a ROUTER
      drop answers silently, and a worker pushes one message per key: a tensor cut into
      thousands of keys would hang. A worker has at most one round of a key in flight
      (two, briefly, after a join() stand-in), so what waits in the queues is bounded by
      the model's own size;
    - zmq pings the peer every heartbeat interval and closes the connection when nothing
      at all has come back for the heartbeat timeout, so that a link that drops every
      packet (a broken switch, a firewall) is seen as a closed connection (liveness.py)
      instead of a silent wait. A slow link that still delivers keeps the connection.
    """
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if data is not None:
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.HEARTBEAT_IVL, int(data.heartbeat_interval * 1000))
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(data.heartbeat_timeout * 1000))
        sock.setsockopt(zmq.HEARTBEAT_TTL, int(data.heartbeat_timeout * 1000))
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity.encode())
    if curve == "server":
        security(ctx).server(sock, data=data is not None)
    elif curve == "client":
        security(ctx).client(sock, data=data is not None)
    return sock


def send(sock: zmq.Socket, frames: list, identity: bytes | None = None) -> None:
    """Send ``frames`` without copying, to ``identity`` on a ROUTER socket."""
    if identity is not None:
        frames = [identity, *frames]
    sock.send_multipart(frames, copy=False)


def batch_bytes(environ: Mapping[str, str] | None = None) -> int:
    """``PS_BATCH_BYTES``: the messages to one peer that are ready together travel as one
    batch (wire's ``batch``) until it holds this many bytes, then the batch leaves and the
    next begins (default 1 MiB); 0 sends every message alone."""
    return env_int("PS_BATCH_BYTES", 1 << 20, minimum=0, environ=environ)


class Batches:
    """The messages for each peer that are ready together, sent as one ``batch`` (wire.py):
    a batch leaves once it holds ``limit`` bytes (a message that would take it past leaves
    it first; one larger alone) or ``wire.MAX_BATCH`` messages, and whatever waits leaves at
    :meth:`flush`. ``limit`` 0 sends every message at once, alone.

    Example::

        batches = Batches(batch_bytes(), lambda peer, frames: send(sock, frames, peer))
        batches.add(peer, wire.encode(Op.RESULT, key=1, payload=p))
        batches.flush()   # before the loop waits
    """

    def __init__(self, limit: int, deliver: Callable[[object, list], None]):
        self.limit, self._deliver = limit, deliver
        self.waiting: dict[object, list[list]] = {}
        self._bytes: dict[object, int] = {}

    def add(self, peer: object, frames: list) -> None:
        """Send ``frames`` to ``peer``, in its next batch."""
        if not self.limit:
            self._deliver(peer, frames)
            return
        size = sum(memoryview(f).nbytes for f in frames)
        if self._bytes.get(peer, 0) + size > self.limit:
            self.flush_to(peer)
        waiting = self.waiting.setdefault(peer, [])
        waiting.append(frames)
        self._bytes[peer] = self._bytes.get(peer, 0) + size
        if len(waiting) == wire.MAX_BATCH or self._bytes[peer] >= self.limit:
            self.flush_to(peer)

    def flush(self) -> None:
        """Send every peer what waits for it."""
        for peer in list(self.waiting):
            self.flush_to(peer)

    def flush_to(self, peer: object) -> None:
        """Send ``peer`` what waits for it: one message alone, several as a batch."""
        messages = self.waiting.pop(peer, [])
        self._bytes.pop(peer, None)
        if messages:
            self._deliver(peer, messages[0] if len(messages) == 1 else wire.batch(messages))

    def clear(self) -> None:
        """Forget what waits (its connections were closed)."""
        self.waiting.clear()
        self._bytes.clear()


def drain(sock: zmq.Socket, limit: int = 64, seconds: float | None = None):
    """Messages already waiting on a socket, up to ``limit``, without blocking; with
    ``seconds``, none after that long (a batch may hold thousands of messages: the loop
    that drains must still come back to its heartbeats in time)."""
    deadline = None if seconds is None else time.monotonic() + seconds
    for _ in range(limit):
        if deadline is not None and time.monotonic() > deadline:
            return
        try:
            yield sock.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return


class SchedulerLink:
    """A node's DEALER to the scheduler, and what the scheduler tells it."""

    def __init__(self, ctx: zmq.Context, config: ClusterConfig):
        self.config, self.ctx = config, ctx
        self.identity = f"{config.role}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.sock = make_socket(ctx, zmq.DEALER, self.identity, curve="client")
        self.watch = PeerWatch(self.sock)
        self.sock.connect(config.scheduler_address)
        self.rank = -1
        self.book: dict = {}
        self.progress: dict = {}  # who has registered so far, while we wait for the book
        self.shutdown = False
        self.failed: str | None = None  # with the shutdown: why the job failed, if it did
        self.status = 1  # and the exit status of the worker that failed first
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
        self._send(Op.REGISTER, role=cfg.role, worker_id=wid, host=cfg.node_host, port=data_port,
                   num_workers=cfg.num_workers, num_servers=cfg.num_servers,
                   partition_bytes=cfg.partition_bytes, placement=cfg.placement,
                   min_workers=cfg.min_workers,
                   max_workers=cfg.max_workers, job=os.environ.get("PS_JOB_ID", ""),
                   description=[list(pair) for pair in cfg.job],
                   **self._server_id)
        limit = register_timeout()
        began = time.monotonic()
        notice = began + WAIT_NOTICE_S[0]
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.watch.sock, zmq.POLLIN)
        while not self.book:
            now = time.monotonic()
            if now - began > limit:
                raise ClusterError(f"gave up after {limit:.0f} s (PS_REGISTER_TIMEOUT_S): "
                                   f"{self._waiting_for()}")
            if now >= notice:
                log.log(self._notice_level(), "%s; waiting up to %.0f s more (PS_REGISTER_TIMEOUT_S)",
                        self._waiting_for(), limit - (now - began))
                notice = now + WAIT_NOTICE_S[1]
            if dict(poller.poll(int(min(cfg.heartbeat_interval, 0.25) * 1000))).get(self.sock):
                for frames in drain(self.sock):
                    self.handle(frames)
            self.tick(expect_scheduler=False)
        return self.book

    def _notice_level(self) -> int:
        """A node that registered and waits for its peers is starting as it should (servers
        usually wait for the workers' imports): INFO where this process logs INFO (the roles,
        the training job). Anything else, and every notice in a process that configured no
        logging (whose silence would hide why it waits), is a WARNING."""
        registered = self.watch.ever_connected and self.progress.get("registered") \
            and self.progress.get("expected")
        return logging.INFO if registered and log.isEnabledFor(logging.INFO) else logging.WARNING

    def _waiting_for(self) -> str:
        """What this node is waiting for, in words, naming the scheduler's address."""
        address = self.config.scheduler_address
        if not self.watch.ever_connected and self.watch.problem:
            return (f"{self.config.role}: the scheduler at {address} answers, but "
                    f"{self.watch.problem}: every role needs the same PS_CURVE_KEYS, or none")
        if not self.watch.ever_connected and self.watch.tcp_connected:
            return (f"{self.config.role}: something at {address} accepts the connection but "
                    f"never completes zmq's handshake: a scheduler that is stopped, or another "
                    f"program on that port?")
        if not self.watch.ever_connected:
            return (f"{self.config.role}: no answer from the scheduler at {address}: cannot "
                    f"connect ({self.watch.retries} attempt(s) failed); is it running, "
                    f"and are DMLC_PS_ROOT_URI and DMLC_PS_ROOT_PORT right?")
        have, need = self.progress.get("registered"), self.progress.get("expected")
        if not have or not need:
            return f"{self.config.role}: connected to the scheduler at {address}; no answer yet"
        return (f"{self.config.role}: registered with the scheduler at {address}; waiting for the "
                f"other nodes: {have.get('worker')} of {need.get('worker')} worker(s) and "
                f"{have.get('server')} of {need.get('server')} server(s) so far")

    def _send(self, op: Op, flags: int = 0, **extra) -> None:
        self.sock.send_multipart(wire.encode(op, sender=max(self.rank, 0), **extra), flags,
                                 copy=False)
        self._last_sent = time.monotonic()

    def handle(self, frames: list) -> wire.Message:
        """Act on one message from the scheduler; raises ``ClusterError`` when the job must end."""
        try:
            msg = wire.decode(frames)
        except wire.WireError as exc:
            raise ClusterError(f"malformed message from the scheduler: {exc}") from None
        self._last_heard = time.monotonic()
        if msg.op == Op.HEARTBEAT and "registered" in msg.extra:
            self.progress = msg.extra
        elif msg.op == Op.ADDRESSBOOK:
            self.rank = msg.extra["rank"]
            self.book = msg.extra
            security(self.ctx).admit(msg.extra["secret"])
        elif msg.op == Op.RESHAPE:  # the caller acts on the rest (server.py, engine.py)
            self.rank = msg.extra["rank"]
        elif msg.op == Op.NODE_LOST:
            raise ClusterError(f"{msg.extra.get('what', 'a peer was lost')}; ending the job")
        elif msg.op == Op.ERROR:
            refused = ClusterError if self.book else RegistrationRefused
            raise refused(f"the scheduler refused this node: {msg.extra.get('message')}")
        elif msg.op == Op.SHUTDOWN:
            self.shutdown = True
            self.failed = msg.extra.get("failed")
            self.status = exit_status(msg.extra.get("status"))
        return msg

    def tick(self, expect_scheduler: bool = True) -> None:
        """Heartbeat when due; raise if the scheduler's connection closed or it went silent."""
        now = time.monotonic()
        if self.watch.lost() and not self.shutdown:
            raise ClusterError(f"scheduler at {self.config.scheduler_address} lost: its connection "
                               f"closed {self.watch.closed_for():.1f} s ago and did not come back "
                               f"(it exited or was killed); ending the job")
        if now - self._last_sent >= self.config.heartbeat_interval and self.watch.ever_connected:
            try:  # never queued behind a dead connection: a lost one changes nothing
                self._send(Op.HEARTBEAT, zmq.NOBLOCK)
            except zmq.Again:
                pass
        if expect_scheduler and now - self._last_heard > self.config.heartbeat_timeout:
            raise ClusterError(f"scheduler at {self.config.scheduler_address} silent for "
                               f"{now - self._last_heard:.1f} s (timeout "
                               f"{self.config.heartbeat_timeout:.1f} s; or this process was "
                               f"stopped that long); ending the job")

    def negotiate(self, reqid: int, fields: dict, epoch: int = 0) -> None:
        """Ask the scheduler to agree a collective (coordinator.py); it answers ``agreed``
        with ``reqid`` as the round. ``epoch``: the membership the request is made in (an
        elastic job's; the scheduler drops one of an older membership)."""
        self._send(Op.NEGOTIATE, round=reqid, **fields, **wire.epoch_field(epoch))

    def block(self, reqid: int, waiting: bool, withdraw: bool = False, epoch: int = 0) -> None:
        """Say that this worker now waits for request ``reqid``, no longer does, or (with
        ``withdraw``) gives it up (``epoch``: as for :meth:`negotiate`)."""
        self._send(Op.BLOCKED, round=reqid, waiting=waiting, withdraw=withdraw,
                   **wire.epoch_field(epoch))

    def finish(self, failed: str | None = None, status: int = 1) -> None:
        """Tell the scheduler this node is done, so its going quiet is not a loss; ``failed``:
        its process is ending on this error with exit ``status`` (the job then fails)."""
        self._send(Op.FINISH, **({"failed": failed, "status": status} if failed else {}))

    def report(self, op: Op, fields: dict) -> None:
        """Tell the scheduler something it should know (a server's stalled rounds)."""
        self._send(op, **fields)

    def close(self) -> None:
        """Close the link to the scheduler."""
        self.watch.close()
        self.sock.close(0)


def register_timeout() -> float:
    """Seconds to wait for the cluster to form (``PS_REGISTER_TIMEOUT_S``, default 600)."""
    return float(env_int("PS_REGISTER_TIMEOUT_S", 600, minimum=1))
