"""The worker's engine thread: the queue, the sends and the answers (ps-lite's Van under
a KVWorker; the caller's side is ps_client.py, the book of rounds in flight that answers
are matched against customer.py, where each key goes slicer.py).

One background thread owns every socket: it takes every tensor queued at once
as one batch in priority order (later layers, whose gradients the backward pass
produces first, go first), splits them into keys, hands each compressor its
keys of the batch in one call (ADTopk's CUDA kernel selects them in one launch),
sends each key's payload as it comes (many keys in flight on one DEALER per server:
the messages for one server that are ready together leave as one ``batch`` of up to
``PS_BATCH_BYTES``, and whatever waits leaves before the thread waits, or every 256 keys
of a long batch), and writes each answer into the handle's output as it arrives.

With ``PS_CREDIT_BYTES`` the pushes to each server pass a credit window (credit.py): at most that many bytes the
server has not yet acknowledged receiving are on their way, and the rest wait in
priority order, so an urgent push overtakes. Credit returns on receipt, never on the
round's answer: under BSP a round completes only when every worker has pushed it, so
workers holding back different keys until their answers came would wait for each other.
"""
from __future__ import annotations

import heapq
import itertools
import logging
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Protocol

import torch
import zmq

from adtopk_ps import wire
from adtopk_ps.client.credit import Outbox
from adtopk_ps.client.customer import Customer, Part
from adtopk_ps.client.errors import HostsUpdatedInterrupt, MembershipChanged
from adtopk_ps.client.handle import Handle
from adtopk_ps.client.ledger import Ledger
from adtopk_ps.client.resend import LinkDropsLargeMessages, Resender
from adtopk_ps.client.server_residuals import Replies
from adtopk_ps.cluster.liveness import PeerWatch
from adtopk_ps.client.slicer import Slicer
from adtopk_ps.cluster.membership import ClusterConfig, KeyLayout, part_name, split
from adtopk_ps.cluster.stop import exit_unless_ended
from adtopk_ps.cluster.transport import (Batches, ClusterError, SchedulerLink, batch_bytes,
                                         drain, make_socket, register_timeout, send)
from adtopk_ps.compression import Compressor, Dense, Request, start_each
from adtopk_ps.core.env import env_int
from adtopk_ps.wire import Op

log = logging.getLogger("adtopk_ps.client")
FLUSH_MS = 2000  # how long closing waits for queued messages after a clean finish
KEEP_ALIVE_KEYS = 256  # keys sent between two heartbeat checks while one tensor is sent


def shorten_gil_switch(environ: Mapping[str, str] | None = None) -> None:
    """Make a thread waiting for the GIL get it sooner (``PS_GIL_SWITCH_US``, default 200 us;
    0 keeps Python's 5 ms).

    The engine thread and the training thread hand the GIL back and forth at
    every gradient the backward pass produces; with Python's default each
    hand-over can wait up to 5 ms, which the step then waits too
    (docs/benchmark-e2e.md measures steps with this setting).
    """
    micros = env_int("PS_GIL_SWITCH_US", 200, minimum=0, environ=environ)
    if micros and micros / 1e6 < sys.getswitchinterval():
        sys.setswitchinterval(micros / 1e6)


def credit_window(environ: Mapping[str, str] | None = None) -> int:
    """The credit window in bytes, ``PS_CREDIT_BYTES`` (0, the default: none, every push
    leaves at once). In bytes, as ByteScheduler's ``BYTESCHEDULER_CREDIT``: compressed
    pushes are far smaller than byteps' partitions, its ``BYTEPS_SCHEDULING_CREDIT`` unit."""
    return env_int("PS_CREDIT_BYTES", 0, minimum=0, environ=environ)


class Negotiation(Protocol):
    """A call waiting for the scheduler's agreement."""

    def answered(self, msg: wire.Message) -> None:
        """The scheduler's answer (on the engine thread)."""

    def fail(self, error: BaseException) -> None:
        """The engine ended before the answer came."""


@dataclass(order=True)
class Job:
    """One ``push_pull`` waiting for the engine: lower ``priority`` goes first, then order of arrival."""

    priority: int
    seq: int
    handle: Handle = field(compare=False)
    tensor: torch.Tensor = field(compare=False)
    layout: KeyLayout = field(compare=False)
    compressor: Compressor = field(compare=False)
    step: int = field(compare=False)
    ratio: float | None = field(compare=False)


class Engine:
    """The thread that talks to the scheduler and the servers for one worker."""

    def __init__(self, config: ClusterConfig, ctx: zmq.Context, slicer: Slicer | None = None):
        self.config, self.ctx = config, ctx
        # which server each key goes to (the client's; byteps' partitions where it plans none)
        self.slicer = slicer or Slicer(config.num_servers, config.partition_bytes, config.placement,
                                        config.elastic)
        self.size = config.num_workers
        self.rank = -1
        self.servers: list[str] = []
        self.ledger = Ledger()  # bytes to and from each server, the answers' width
        # the rounds in flight and what answers them; the engine thread's
        self.customer = Customer(self.ledger)
        self.compress_seconds = 0.0
        self.error: BaseException | None = None  # what ended the engine, if anything did
        self.epoch = 0  # the membership's (elastic jobs): pushes and answers carry it
        # the last re-form's error, until the caller acknowledges it: every call raises it
        self.changed: MembershipChanged | None = None
        # clear while a re-form is taken in, and while the job waits below its minimum for
        # workers to join (what it says then in ``waiting``); set again once the re-form is
        # (the next, when waiting), or when the engine ends
        self.resumed = threading.Event()
        self.resumed.set()
        self.waiting = ""
        self._rebook: list[str] | None = None  # the servers of a re-form, to connect to
        self.joined_epoch = 0  # the epoch of a running job this worker joined (0: from its start)
        self.lock = threading.RLock()  # the queue's and the commands'; re-entrant for _poke
        self._jobs: list[Job] = []
        self._in_hand: list[Job] = []  # between the queue and the wire
        # pushes waiting for credit (none without PS_CREDIT_BYTES); the engine thread's
        self.outbox = Outbox(credit_window())
        # every push to each server until its answer: sent again after a reconnect
        self.resend = Resender(config.heartbeat_timeout)
        self._reconnects: list[int] = []  # each server connection's, as last seen
        self._credit: int | None = None  # a window set by set_credit, for the engine thread
        self._sockets: list[zmq.Socket] = []  # the servers' connections, while _serve runs
        # messages for each server that are ready together leave as one batch (PS_BATCH_BYTES;
        # 0: each alone), once it is that large or when the loop turns; the engine thread's
        self._batches = Batches(batch_bytes(),
                                lambda server, frames: send(self._sockets[server], frames))
        self._commands: list[tuple[Op, int, dict]] = []
        # request id -> the call waiting for the scheduler's answer (its ``answered`` runs on
        # the engine thread; its ``fail`` if the engine ends first)
        self._agreements: dict[int, Negotiation] = {}
        self._reqids = itertools.count(1)
        self.on_standin: Callable[[dict], None] | None = None  # the client's, for join()
        self._seq = itertools.count()
        wake_addr = f"inproc://adtopk-wake-{id(self)}"
        self._wake_in = make_socket(ctx, zmq.PULL)
        self._wake_in.bind(wake_addr)
        self._wake_out = make_socket(ctx, zmq.PUSH)
        self._wake_out.connect(wake_addr)
        self._ready = threading.Event()
        self._started_at = 0.0  # when the servers' connections were opened
        self._keep_alive: Callable[[], None] = lambda: None  # the scheduler link's tick, in _serve
        self._thread = threading.Thread(target=self._run, name="adtopk-engine", daemon=True)

    def start(self) -> None:
        """Start the thread and wait until this worker has registered; raise if it could not."""
        shorten_gil_switch()
        self._thread.start()
        if not self._ready.wait(register_timeout() + 5) or self.error is not None:
            raise self.error or ClusterError("the worker engine did not start")

    def submit(self, priority: int, handle: Handle, tensor: torch.Tensor, layout: KeyLayout,
               compressor: Compressor, step: int, ratio: float | None) -> None:
        """Queue one tensor for compression and sending; raises :class:`MembershipChanged`
        where the job has re-formed and the caller has not acknowledged it (checked under
        the lock the re-form takes: a push checked before it cannot slip in after)."""
        job = Job(priority, next(self._seq), handle, tensor, layout, compressor, step, ratio)
        with self.lock:
            if self.changed is not None:
                raise self.changed
            # the engine empties the queue before it sleeps: only a push into an empty queue
            # must wake it (each wake-up is a send and a GIL hand-over on the training thread)
            wake = not self._jobs
            heapq.heappush(self._jobs, job)
        if wake:
            self._poke()

    def set_credit(self, window: int) -> None:
        """Change the credit window (credit.py) to ``window`` bytes, on the engine thread:
        what fits the new window leaves at once (everything, for none); what it holds beyond
        a smaller one, as receipts come."""
        with self.lock:
            self._credit = window
        self._poke()

    @property
    def credit(self) -> int:
        """The credit window in bytes, or the one :meth:`set_credit` asked for."""
        with self.lock:
            return self.outbox.window if self._credit is None else self._credit

    def new_request(self) -> int:
        """A request id for :meth:`negotiate`, to be known before the answer can come."""
        return next(self._reqids)

    def negotiate(self, reqid: int, fields: dict, call: "Negotiation") -> None:
        """Ask the scheduler to agree a collective (coordinator.py); ``call.answered`` gets its
        answer, on the engine thread. The request goes out behind every push queued before
        it. Raises as :meth:`submit` does."""
        with self.lock:
            if self.changed is not None:
                raise self.changed
            self._agreements[reqid] = call
            self._commands.append((Op.NEGOTIATE, reqid, fields))
        self._poke()

    def blocked(self, reqid: int, waiting: bool, withdraw: bool = False) -> None:
        """Tell the scheduler that the caller now waits for request ``reqid``, no longer does,
        or (``withdraw``) gives it up."""
        with self.lock:
            self._commands.append((Op.BLOCKED, reqid, {"waiting": waiting, "withdraw": withdraw}))
        self._poke()

    def fetch_residuals(self, keys: list[int]) -> Replies:
        """Ask the servers for these keys' residuals as of their next round (a re-sparsifying
        server's, for a checkpoint); the fetch completes once every server answered. With a
        push of this worker still unanswered, its key's server refuses: the round asked has
        not begun there. Raises as :meth:`submit` does."""
        call = Replies(keys)
        self._command(Op.FETCH, {"call": call})
        return call

    def restore_residuals(self, residuals: dict[int, torch.Tensor]) -> Replies:
        """Put these residuals back on their servers (a resumed checkpoint's); the call
        completes once every server has taken its own, or fails with the first refusal. A
        push queued after it goes behind them: the key's round cannot complete before they
        are in. A server that refuses one also refuses every later push of its key."""
        call = Replies(list(residuals))
        self._command(Op.RESIDUAL, {"residuals": residuals, "call": call})
        return call

    def _command(self, op: Op, fields: dict) -> None:
        with self.lock:
            if self.changed is not None:
                raise self.changed
            self._commands.append((op, 0, fields))
        self._poke()

    def finish(self, failed: str | None = None, status: int = 1) -> None:
        """Queue this worker's finish, behind every push and request queued before it;
        ``failed``: the error its process ends on, and the exit status it ends with."""
        with self.lock:
            self._commands.append((Op.FINISH, 0, {"failed": failed, "status": status}))
        self._poke()

    def stop(self, timeout: float, failed: str | None = None, status: int = 1) -> None:
        """Finish (if the thread still runs) and wait up to ``timeout`` for the thread to end."""
        if self._thread.is_alive():
            self.finish(failed, status)
            self._thread.join(timeout)
        self._wake_out.close(0)

    def _poke(self) -> None:
        with self.lock:
            try:
                self._wake_out.send(b"", zmq.NOBLOCK)
            except zmq.Again:  # a wake-up is already queued, or the engine has stopped
                pass

    def _run(self) -> None:
        link = SchedulerLink(self.ctx, self.config)
        servers: list[zmq.Socket] = []
        watches: list[PeerWatch] = []  # each server connection's, to notice a server's death
        linger = 0
        try:
            book = link.register()
            self.rank = link.rank
            # a worker that joined a running elastic job: its membership's
            self.epoch, self.size = book.get("epoch", 0), book.get("num_workers", self.size)
            self.joined_epoch = self.epoch
            self._connect(link, book["servers"], servers, watches)
            self._ready.set()
            self._serve(link, servers, watches)
            linger = FLUSH_MS  # a clean finish: what is queued (the finish markers) still leaves
        except BaseException as exc:  # anything here ends the job for this worker
            if not isinstance(exc, ClusterError):
                log.exception("worker engine failed")
            self.error = exc if isinstance(exc, ClusterError) else ClusterError(f"engine failed: {exc}")
            grace = float(env_int("PS_EXIT_GRACE_S", 0, minimum=0))
            if grace and self._ready.is_set():  # (an error before that is init()'s to raise)
                exit_unless_ended(f"worker {self.rank}: {self.error}", link.status if
                                  link.shutdown else 1, grace)
            self._ready.set()
            self.resumed.set()
            self._fail_all(self.error)
        finally:
            for watch in watches:
                watch.close()
            for sock in servers:
                sock.close(linger)
            link.close()
            self._wake_in.close(0)

    def _connect(self, link: SchedulerLink, addresses: list[str], servers: list[zmq.Socket],
                 watches: list[PeerWatch]) -> None:
        """Connect to the servers at ``addresses`` (in place of any connected before: an elastic
        job that lost a server re-forms with a shorter address book). The connections are
        named for the epoch: a server still holding the old one by that name would drop a
        new one of the same name."""
        for watch in watches:
            watch.close()
        for sock in servers:
            sock.close(0)
        watches.clear()
        servers.clear()
        self._batches.clear()
        self.servers = list(addresses)
        self._reconnects = [0] * len(addresses)
        for address in addresses:
            sock = make_socket(self.ctx, zmq.DEALER, f"{link.identity}-e{self.epoch}-s{len(servers)}",
                               curve="client", data=self.config)
            watches.append(PeerWatch(sock))
            sock.connect(address)
            servers.append(sock)
        self._started_at = time.monotonic()  # each connection has until the timeout to open

    def _serve(self, link: SchedulerLink, servers: list[zmq.Socket],
               watches: list[PeerWatch]) -> None:
        def listen() -> tuple[zmq.Poller, dict]:
            poller = zmq.Poller()
            # a monitor's event wakes the loop (a peer that is down keeps producing
            # reconnection events); link.tick() and _check_servers() read them
            for sock in [link.sock, self._wake_in, link.watch.sock, *servers,
                         *(w.sock for w in watches)]:
                poller.register(sock, zmq.POLLIN)
            return poller, {sock: i for i, sock in enumerate(servers)}
        poller, which = listen()

        def keep_alive() -> None:  # a tensor of thousands of keys takes seconds to send
            self._flush()  # what is compressed so far leaves while the rest is
            for frames in drain(link.sock):  # the heartbeats' answers count as hearing
                self._on_scheduler(link.handle(frames))
            link.tick()

        self._keep_alive = keep_alive
        self._sockets = servers  # (the same list: _connect refills it in place)
        finishing = False
        tick_ms = int(self.config.heartbeat_interval * 1000)
        while True:
            for sock, _ in poller.poll(tick_ms):
                if sock is link.sock:
                    self._on_scheduler(link.handle(link.sock.recv_multipart(copy=False)))
                elif sock is self._wake_in:
                    for _ in drain(self._wake_in):
                        pass
                elif sock in which:
                    for frames in drain(sock, seconds=tick_ms / 2000):
                        self._on_answer(which[sock], frames)
            if self._rebook is not None:  # the servers changed (an elastic re-form)
                self._connect(link, self._rebook, servers, watches)
                self._rebook = None
                poller, which = listen()
            with self.lock:
                commands, self._commands = self._commands, []
                credit, self._credit = self._credit, None
            if credit is not None:
                self.outbox.resize(credit, self._send_to)
            # every push queued before a request or finish was queued goes out before it
            self._launch(servers)
            if commands:
                self.outbox.send_all(self._send_to)
            for op, reqid, fields in commands:
                if op == Op.NEGOTIATE:
                    link.negotiate(reqid, fields, self.epoch)
                elif op == Op.BLOCKED:
                    link.block(reqid, fields["waiting"], fields["withdraw"], self.epoch)
                elif op == Op.FETCH:
                    self._send_fetch(fields["call"], len(servers))
                elif op == Op.RESIDUAL:
                    self._send_residuals(fields["residuals"], fields["call"], len(servers))
                elif not finishing:
                    # behind this worker's last push on each connection: a server fails at once
                    # any round this worker left unpushed, rather than let the others wait
                    self._flush()
                    marker = wire.encode(Op.FINISH, sender=self.rank, **wire.epoch_field(self.epoch))
                    for sock in servers:
                        send(sock, marker)
                    link.finish(fields["failed"], fields["status"])
                    finishing = True
            self._flush()
            if finishing and link.shutdown:
                return
            link.tick()
            self._check_servers(watches, finishing)

    def _on_scheduler(self, msg: wire.Message) -> None:
        """An answer to a request (its callback runs here), or a stand-in for join()."""
        if msg.op == Op.AGREED:
            with self.lock:
                answered = self._agreements.pop(msg.round, None)
            if answered is None:
                raise ClusterError(f"the scheduler answered request {msg.round}, which this "
                                   f"worker did not make")
            answered.answered(msg)
        elif msg.op == Op.STANDIN and self.on_standin is not None:
            self.on_standin(msg.extra)
        elif msg.op == Op.RESHAPE:
            self._reshape(msg.extra)

    def _reshape(self, x: dict) -> None:
        """The job re-formed: this worker's new rank and the number of workers; every push,
        queued tensor and collective of the old membership fails with
        :class:`MembershipChanged`, and every key's rounds start again at 0. ``waiting``: the
        job is below its minimum and waits for workers to join (the caller waits in
        :meth:`~adtopk_ps.client.ps_client.PSClient.acknowledge_membership` until it re-forms)."""
        what, waiting = x.get("what", "the workers changed"), x.get("waiting", "")
        kind = HostsUpdatedInterrupt if x.get("joined") else MembershipChanged
        error = kind(f"{what}; {waiting}" if waiting else
                     f"{what}; the job goes on with {x['num_workers']} worker(s), this one now "
                     f"rank {x['rank']} (epoch {x['epoch']}): go back to the last committed state")
        with self.lock:  # from here on, a call queues nothing (submit, negotiate)
            # an acknowledgement waits until everything of the old membership has failed: one
            # that came between here and _fail_all would let a request through that fails
            # below and still goes out
            self.resumed.clear()
            # requests of the old membership not yet sent go too (a finish stays)
            self._commands = [c for c in self._commands if c[0] == Op.FINISH]
            was = self.rank  # the rank the message speaks as: the new one is in ``error``
            self.epoch, self.rank, self.size = x["epoch"], x["rank"], x["num_workers"]
            self.resend = Resender(self.config.heartbeat_timeout)  # the old rounds are abandoned
            self.changed = error
        self.customer.rounds.clear()
        if x.get("servers", self.servers) != self.servers:  # connected before the next push
            self._rebook = list(x["servers"])
        log.warning("worker %d: %s", was, error)
        self._fail_all(error)
        self.waiting = waiting
        if not waiting:
            self.resumed.set()

    def _check_servers(self, watches: list[PeerWatch], finishing: bool) -> None:
        """Raise when a server's connection closed for good, or never opened within the
        heartbeat timeout; once this worker has finished, the servers may exit before the
        scheduler's answer comes (events are still read: a monitor nobody reads fills up)."""
        waited = time.monotonic() - self._started_at
        for index, watch in enumerate(watches):
            if not watch.lost() and not watch.ever_connected and not finishing \
                    and waited > self.config.heartbeat_timeout:
                raise ClusterError(
                    f"worker {self.rank} cannot reach server {index} ({self.servers[index]}): "
                    f"no connection in {waited:.0f} s (a firewall, or the server's address "
                    f"is not reachable from this host?); ending the job")
            if watch.reconnects > self._reconnects[index] and not finishing:
                self._reconnects[index] = watch.reconnects
                self._send_again(index)
            # an elastic job re-forms without a lost server: the scheduler's word comes as
            # soon as this worker's own notice (both see the connection close), or soon after
            patience = self.config.heartbeat_timeout if self.config.elastic else 0.0
            if watch.lost() and not finishing and watch.closed_for() > patience:
                raise ClusterError(
                    f"worker {self.rank} cannot reach server {index} ({self.servers[index]}): "
                    f"their connection closed {watch.closed_for():.1f} s ago and did not come "
                    f"back (the server exited or was killed, or nothing came back over the "
                    f"link for {self.config.heartbeat_timeout:.0f} s: PS_HEARTBEAT_TIMEOUT_MS); "
                    f"ending the job")

    def _send_again(self, server: int) -> None:
        """The connection to ``server`` came back: what it may have lost goes again."""
        try:
            again = self.resend.reconnected(server, f"worker {self.rank}",
                                            f"server {server} ({self.servers[server]})")
        except LinkDropsLargeMessages as exc:
            raise ClusterError(f"{exc}; ending the job") from None
        for frames in again:
            self._send_to(server, frames)
        log.warning("worker %d: the connection to server %d (%s) closed and came back; %d "
                    "message(s) without an answer sent again", self.rank, server,
                    self.servers[server], len(again))

    def _launch(self, servers: list[zmq.Socket]) -> None:
        while True:
            with self.lock:
                if not self._jobs:
                    return
                jobs = [heapq.heappop(self._jobs) for _ in range(len(self._jobs))]
                self._in_hand = jobs  # off the queue: if they fail, _fail_all must still find them
            self._send_jobs(jobs, servers)
            self._in_hand = []

    def _send_jobs(self, jobs: list[Job], servers: list[zmq.Socket]) -> None:
        """Compress and send every key of ``jobs`` (in their order): each compressor gets its
        keys in one :meth:`~Compressor.start`, and each key goes out as its payload comes."""
        parts = [(job, part_name(job.handle.name, index), part, out, key) for job in jobs
                 for index, (part, out, key) in enumerate(zip(split(job.tensor, job.layout.blocks),
                                                              split(job.handle.out, job.layout.blocks),
                                                              job.layout.keys))]
        started = time.perf_counter()
        payloads = start_each([(job.compressor, Request(part, pname, job.step, job.ratio))
                               for job, pname, part, _, _ in parts])
        self.compress_seconds += time.perf_counter() - started
        epoch = self.epoch
        for count, (job, pname, _, out, key) in enumerate(parts):
            if count % KEEP_ALIVE_KEYS == KEEP_ALIVE_KEYS - 1:
                self._keep_alive()  # heartbeats go on while a long batch is sent
                if self.epoch != epoch:
                    return  # the job re-formed meanwhile: the rest of the batch is abandoned
            started = time.perf_counter()
            payload = next(payloads)
            self.compress_seconds += time.perf_counter() - started
            rnd = self.customer.next_round(key)
            flags = {"nonfinite": True} if payload.nonfinite else {}
            if self.outbox.window:
                flags["ack"] = True  # a receipt brings the credit back
            frames = wire.encode(Op.PUSH, key=key, round=rnd, sender=self.rank, payload=payload,
                                 **flags, **wire.epoch_field(self.epoch))
            size = sum(memoryview(f).nbytes for f in frames)
            server = self.slicer.server_of(key, len(servers))
            self.customer.sent(key, server, size,
                               Part(job.handle, out, rnd, job.compressor, pname, payload.codec != "dense"))
            self.resend.sent(server, key, rnd, frames, size)
            self.outbox.post(server, job.priority, frames, (key, rnd), size, self._send_to)

    def _send_to(self, server: int, frames: list) -> None:
        self._batches.add(server, frames)

    def _flush(self) -> None:
        """Send every server what waits for it (before the loop waits, and before a finish)."""
        self._batches.flush()

    def _send_fetch(self, call: Replies, servers: int) -> None:
        for key, rnd in self.customer.fetch(call):
            self._send_to(self.slicer.server_of(key, servers), wire.encode(
                Op.FETCH, key=key, round=rnd, sender=self.rank, **wire.epoch_field(self.epoch)))

    def _send_residuals(self, residuals: dict[int, torch.Tensor], call: Replies, servers: int) -> None:
        for key, rnd, residual in self.customer.restore(residuals, call):
            frames = wire.encode(Op.RESIDUAL, key=key, round=rnd, sender=self.rank,
                                 payload=Dense().compress(residual.detach().cpu(), f"residual {key}"),
                                 **wire.epoch_field(self.epoch))
            self._send_to(self.slicer.server_of(key, servers), frames)

    def _on_answer(self, server: int, frames: list, batched: bool = False) -> None:
        try:
            msg = wire.decode(frames)
        except wire.WireError as exc:
            raise ClusterError(f"server {server} sent a malformed answer: {exc}") from None
        if msg.op == Op.BATCH:
            if batched:
                raise ClusterError(f"server {server} sent a batch inside a batch")
            for part in wire.unbatch(frames, msg):
                self._on_answer(server, part, batched=True)
            return
        if msg.extra.get("epoch", 0) != self.epoch:
            return  # an answer of the old membership's, whose rounds this worker abandoned
        if msg.op == Op.STALL:
            return self._on_stall(server, msg)
        if self.customer.on_fetched(server, msg) or self.customer.on_restored(server, msg):
            return
        self.outbox.received(server, (msg.key, msg.round), self._send_to)  # (answers count too)
        if msg.op == Op.RECEIVED:
            self.resend.received(server, msg.key, msg.round)
            return
        if not self.resend.answered(server, msg.key, msg.round):
            return  # a push sent again after a reconnect, answered twice: the first counted
        self.customer.on_result(server, msg, sum(memoryview(f).nbytes for f in frames), self.size)

    def _on_stall(self, server: int, msg: wire.Message) -> None:
        """A server says that rounds this worker waits in wait for other workers: named here,
        with the tensors (once per server and set of workers)."""
        x = msg.extra
        names = self.customer.names(x.get("keys", []))
        log.warning("worker %d: %s round(s) on server %d have waited %.0f s for worker(s) %s, "
                    "which pushed nothing for them; tensors: %s%s", self.rank, x.get("rounds"),
                    server, x.get("seconds", 0), x.get("missing"), ", ".join(names[:8]),
                    " ..." if len(names) > 8 else "")

    def _fail_all(self, error: BaseException) -> None:
        """Fail every queued tensor, every key in flight and every request waiting for the
        scheduler with ``error``, and forget them (the engine ends, or the job re-formed)."""
        with self.lock:
            jobs, self._jobs, self._in_hand = self._jobs + self._in_hand, [], []
            calls, self._agreements = list(self._agreements.values()), {}
        handles, waiting = self.customer.abandon()
        calls += waiting
        self.outbox.clear()
        for job in jobs:
            job.handle.fail(error)
        for handle in handles:
            handle.fail(error)
        for call in calls:
            call.fail(error)
