"""The server process: a ROUTER socket for workers' pushes, a link to the scheduler.

Every push is decoded and checked before it touches an aggregate; a bad one
gets an ``error`` reply naming what was wrong and the server carries on.
When a round of a key completes, every worker that pushed it gets the
answer.
"""
from __future__ import annotations

import logging
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
import zmq

from adtopk_ps import wire
from adtopk_ps.cluster.membership import ClusterConfig, start_role
from adtopk_ps.cluster.transport import (Batches, ClusterError, SchedulerLink, batch_bytes,
                                         drain, make_socket, security, send)
from adtopk_ps.compression import Compressor, Dense, create
from adtopk_ps.core.env import env_int
from adtopk_ps.wire import Op

from .aggregator import Aggregator, PushRejected
from .stalls import StallWatch

log = logging.getLogger("adtopk_ps.server")


@dataclass(frozen=True)
class ServerLimits:
    """What one server accepts: the largest message, the most keys, the most bytes of buffers."""

    max_message_bytes: int
    max_keys: int
    max_bytes: int

    @classmethod
    def from_env(cls) -> "ServerLimits":
        """The limits from ``PS_MAX_MESSAGE_BYTES``, ``PS_MAX_KEYS`` and ``PS_SERVER_MAX_BYTES``."""
        return cls(
            max_message_bytes=env_int("PS_MAX_MESSAGE_BYTES", wire.DEFAULT_MAX_MESSAGE_BYTES, minimum=1),
            max_keys=env_int("PS_MAX_KEYS", 1 << 20, minimum=1),
            max_bytes=env_int("PS_SERVER_MAX_BYTES", default_max_bytes(), minimum=1),
        )


def default_max_bytes() -> int:
    """``PS_SERVER_MAX_BYTES`` where it is unset: a quarter of the memory this process may
    use (the host's, or its container's limit where that is lower), at most 16 GiB. A
    server that a flood pushes to its limit then leaves the host, and the processes beside
    it, their memory."""
    return min(1 << 34, memory_bytes() // 4)


def memory_bytes() -> int:
    """The memory this process may use: the host's physical memory, or its cgroup's limit
    (v2's memory.max, v1's memory.limit_in_bytes) where that is lower."""
    limit = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            limit = min(limit, int(text))
    return limit


#: the compressors that keep a width in pushes: their selection is exactly as many entries as
#: asked (ADTopk keeps some in every row, a threshold as many as pass it)
COUNTED = ("topk", "randomk")
#: how many memberships ahead of its own a server keeps a push for (re-forms can come in a
#: burst before it hears of the first); a push further ahead is of no membership announced
EARLY_EPOCHS = 16
#: what workers send a server: pushes, their finish, and a checkpoint's residuals out and in
SERVED = (Op.PUSH, Op.FINISH, Op.FETCH, Op.RESIDUAL, Op.BATCH)


class Resparsifier(NamedTuple):
    """How a server re-sparsifies sparse keys' answers: with ``compressor``, at its own
    density, or (``pushes_wide``) that many times as wide as each round's pushes were on
    average."""

    compressor: Compressor
    pushes_wide: float | None


def resparsifier_from_env() -> Resparsifier | None:
    """``BYTEPS_SERVER_COMPRESSOR`` re-sparsifies sparse keys' answers: ``topk:0.01`` at that
    density; ``topk:2x`` twice as wide as the workers' pushes (whatever density they chose),
    so that an answer no longer grows with the number of workers; ``topk`` alone as ``topk:1x``."""
    spec = os.environ.get("BYTEPS_SERVER_COMPRESSOR", "").strip()
    if not spec:
        return None
    name, colon, width = spec.partition(":")
    try:
        if not colon or width.lower().endswith("x"):
            compressor = create(name)
            if name not in COUNTED:
                raise ValueError(f"a width in pushes ('2x', or none) needs a compressor that keeps "
                                 f"exactly the entries it is asked for: one of {list(COUNTED)}")
            times = number(width[:-1] if colon else "1", "the multiple of the pushes' width before 'x'")
            if not 0 < times < math.inf:
                raise ValueError(f"the multiple of the pushes' width must be a positive finite "
                                 f"number, got {width!r}")
            return Resparsifier(compressor, times)
        density = number(width, "the density after ':'")
        if density > 1:
            hint = f" (a multiple of the pushes' width is written {width}x)" if density < math.inf else ""
            raise ValueError(f"the density after ':' must be in (0, 1], got {width!r}{hint}")
        return Resparsifier(create(name, ratio=density), None)
    except ValueError as exc:
        raise ValueError(f"environment variable BYTEPS_SERVER_COMPRESSOR={spec!r}: {exc}") from None


def number(text: str, what: str) -> float:
    """``text`` as a float; anything else raises ``ValueError`` naming ``what``."""
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{what} must be a number, got {text!r}") from None


class Server:
    """The server process: receives pushes, aggregates them per key, answers each round to every worker."""

    def __init__(self, config: ClusterConfig, limits: ServerLimits,
                 resparsify: Resparsifier | None = None,
                 ctx: zmq.Context | None = None):
        self.config, self.limits = config, limits
        self.ctx = ctx or zmq.Context.instance()
        self.data = make_socket(self.ctx, zmq.ROUTER, curve="server", data=config)
        # a worker's connection that closed and came back (same name) takes over at once,
        # though this side may not have seen the old one close yet
        self.data.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.port = self.data.bind_to_random_port(f"tcp://{config.listen_host}")
        self.link = SchedulerLink(self.ctx, config)
        self.resparsify = resparsify
        self.aggregator = self._aggregator(config.num_workers)
        self.waiting: dict[int, list[bytes]] = {}
        self.senders: dict[int, bytes] = {}  # worker rank -> the connection that pushes for it
        self.finished: set[int] = set()  # workers that said no push of theirs is left to come
        self.dead: dict[int, str] = {}  # key -> why its round can never complete
        # key -> its last answered round and the answer, for a worker that sends a push of
        # that round again (the answer may have been lost with a connection that closed)
        self.answers: dict[int, tuple[int, list]] = {}
        self.rejected = 0
        self.stalls = StallWatch.from_env()
        self._stalls_checked = 0.0  # when check_stalls last looked (once a heartbeat interval)
        self.workers = config.num_workers  # in the job now (elastic jobs re-form with fewer)
        self.epoch = 0  # the membership's: pushes of an older one are dropped
        self.started_as = -1  # its rank when the job formed (an elastic job renumbers servers)
        # pushes of a newer membership, until the scheduler's word of it comes (bounded in bytes
        # by PS_SERVER_MAX_BYTES, as the sums are)
        self.early: list[tuple[int, bytes, list]] = []
        self.early_bytes = 0
        # peers that send batches get their answers in batches, gathered while a burst of
        # messages is served and sent before the loop waits again (``_flush``)
        self.batching: set[bytes] = set()
        self._batches = Batches(batch_bytes(), lambda peer, frames: send(self.data, frames, peer))

    def _aggregator(self, workers: int) -> Aggregator:
        how = self.resparsify
        return Aggregator(workers, how and how.compressor, self.limits.max_keys, self.limits.max_bytes,
                          pushes_wide=how and how.pushes_wide)

    def run(self) -> int:
        """Register, serve until the scheduler says to stop (0) or a peer is lost (non-zero)."""
        try:
            self.link.register(self.port)
            self.started_as = self.link.rank
            log.info("server %d serving on port %d (pid %d)", self.link.rank, self.port, os.getpid())
            poller = zmq.Poller()
            poller.register(self.data, zmq.POLLIN)
            poller.register(self.link.sock, zmq.POLLIN)
            poller.register(self.link.watch.sock, zmq.POLLIN)  # wakes us; link.tick() reads it
            gate = security(self.ctx).gate  # who may connect (without CURVE)
            if gate is not None:
                poller.register(gate.sock, zmq.POLLIN)
            tick_ms = int(self.config.heartbeat_interval * 1000)
            while not self.link.shutdown:
                for sock, _ in poller.poll(tick_ms):
                    if sock is self.link.sock:  # every word waiting: re-forms come in bursts
                        for frames in drain(self.link.sock):
                            msg = self.link.handle(frames)
                            if msg.op == Op.RESHAPE:
                                self.reshape(msg.extra["epoch"], msg.extra["num_workers"])
                    elif sock is self.data:
                        for identity, *frames in drain(self.data, seconds=tick_ms / 2000):
                            self.on_push(identity.bytes, frames)
                    elif gate is not None and sock is gate.sock:
                        gate.serve()
                self.link.tick()
                self.check_stalls()
                self._flush()
            if self.link.failed:
                log.error("server %d: the job failed (%s); shutting down", self.link.rank,
                          self.link.failed)
                return self.link.status
            log.info("server %d shutting down (%d message(s) rejected)", self.link.rank, self.rejected)
            return 0
        except ClusterError as exc:
            log.error("server %d: %s", self.link.rank, exc)
            return 1
        finally:
            self.data.close(0)
            self.link.close()

    def _reply(self, peer: bytes, frames: list) -> None:
        """Send ``frames`` to ``peer``: at once, or into its next batch where it sends
        batches (which leaves once it holds ``PS_BATCH_BYTES``, or when the loop waits again)."""
        if peer in self.batching:
            self._batches.add(peer, frames)
        else:
            send(self.data, frames, peer)

    def _flush(self) -> None:
        self._batches.flush()

    def on_push(self, identity: bytes, frames: list, batched: bool = False) -> None:
        """Decode, check and aggregate one message (each of a batch's in turn); a bad one
        gets an ``error`` reply and nothing else changes."""
        key = rnd = 0
        epoch = self.epoch  # the push's, which an error reply carries back
        try:
            msg = wire.decode(frames, max_bytes=self.limits.max_message_bytes)
            if msg.op == Op.BATCH:
                if batched:
                    raise PushRejected("a batch holds another batch; batches do not nest")
                self.batching.add(identity)
                for part in wire.unbatch(frames, msg):
                    self.on_push(identity, part, batched=True)
                return
            key, rnd, epoch = msg.key, msg.round, msg.extra.get("epoch", 0)
            if msg.op not in SERVED:
                raise PushRejected(f"op {msg.op.value!r} is not served here; send "
                                   f"{', '.join(sorted(op.value for op in SERVED))}")
            if epoch != self.epoch:  # an abandoned round (dropped), or one of a newer membership
                if epoch > self.epoch:
                    self.keep_early(epoch, msg.sender, identity, frames)
                return
            if self.senders.get(msg.sender, identity) != identity:
                raise PushRejected(f"sender {msg.sender} is bound to another connection")
            if msg.op == Op.FINISH:
                return self.on_finish(msg.sender, identity)
            if msg.key in self.dead:
                raise PushRejected(self.dead[msg.key])
            if msg.op in (Op.FETCH, Op.RESIDUAL):
                self.aggregator.check_sender(msg.sender)  # (a push binds its rank; these do not)
                return self.on_fetch(msg, identity) if msg.op == Op.FETCH else self.on_restore(msg, identity)
            if self.sent_again(msg, identity):
                return
            answer = self.aggregator.push(msg.key, msg.round, msg.sender, msg.payload, owned=True,
                                          nonfinite=msg.extra.get("nonfinite", False))
            self.senders[msg.sender] = identity  # only an accepted push binds a rank
            if msg.extra.get("ack"):  # its sender's credit window (before any answer)
                self._reply(identity, wire.encode(Op.RECEIVED, key=msg.key, round=msg.round,
                                                  **wire.epoch_field(self.epoch)))
        except (wire.WireError, PushRejected) as exc:
            if isinstance(exc, wire.WireError):
                key, rnd = wire.envelope(frames)
            self.rejected += 1
            log.warning("rejected a message from %r: %s", identity, exc)
            self._reply(identity, wire.encode(Op.ERROR, key=key, round=rnd, message=str(exc),
                                              **wire.epoch_field(epoch)))
            return
        self.waiting.setdefault(msg.key, []).append(identity)
        if answer is None:
            self.stalls.start(msg.key, time.monotonic())
            self.fail_if_stranded(msg.key)
            return
        self.stalls.end(msg.key)
        flagged = self.aggregator.keys[msg.key].flagged  # told to every worker alike
        frames_out = wire.encode(Op.RESULT, key=msg.key, round=msg.round, payload=answer,
                                 **({"nonfinite": flagged} if flagged else {}), **wire.epoch_field(self.epoch))
        self.answers[msg.key] = (msg.round, frames_out)
        for peer in self.waiting.pop(msg.key):
            self._reply(peer, frames_out)

    def sent_again(self, msg: wire.Message, identity: bytes) -> bool:
        """Whether ``msg`` is a push this server already has (its worker sent it again after
        its connection closed and came back): one of the round being summed is dropped (with
        a receipt, if asked), one of the round last answered gets that answer again."""
        state = self.aggregator.keys.get(msg.key)
        if msg.op != Op.PUSH or state is None or self.senders.get(msg.sender) != identity:
            return False
        if msg.round == state.round and msg.sender in state.pushed:
            if msg.extra.get("ack"):
                self._reply(identity, wire.encode(Op.RECEIVED, key=msg.key, round=msg.round,
                                                  **wire.epoch_field(self.epoch)))
            return True
        answered = self.answers.get(msg.key)
        if answered is not None and answered[0] == msg.round:
            self._reply(identity, answered[1])
            return True
        return False

    def on_fetch(self, msg: wire.Message, identity: bytes) -> None:
        """Send the key's residual as of the round asked (none: a header alone)."""
        residual = self.aggregator.residual(msg.key, msg.round)
        payload = None if residual is None else Dense().compress(residual, f"residual {msg.key}")
        self._reply(identity, wire.encode(Op.RESIDUAL, key=msg.key, round=msg.round, payload=payload,
                                          **wire.epoch_field(self.epoch)))

    def on_restore(self, msg: wire.Message, identity: bytes) -> None:
        """Hold a resumed checkpoint's residual for the key, and say so (``received``). One
        that cannot be held is refused, and makes every push of the key fail, to every
        worker alike, naming why: the job must not go on from a state other than the one it
        saved."""
        try:
            self.aggregator.restore(msg.key, msg.round, msg.payload)
            self._reply(identity, wire.encode(Op.RECEIVED, key=msg.key, round=msg.round,
                                              **wire.epoch_field(self.epoch)))
        except PushRejected as exc:
            self.dead[msg.key] = f"worker {msg.sender} put back a residual the server cannot hold: {exc}"
            log.error("server %d: %s", self.link.rank, self.dead[msg.key])
            self._reply(identity, wire.encode(Op.ERROR, key=msg.key, round=msg.round,
                                              message=self.dead[msg.key],
                                              **wire.epoch_field(self.epoch)))
            state = self.aggregator.keys.get(msg.key)
            for peer in self.waiting.pop(msg.key, []):  # their pushes of the key's round
                self._reply(peer, wire.encode(Op.ERROR, key=msg.key, round=state.round,
                                              message=self.dead[msg.key], **wire.epoch_field(self.epoch)))

    def reshape(self, epoch: int, workers: int) -> None:
        """The workers changed (an elastic job re-formed): every round in progress is of the
        old membership, so all of it goes (the workers abandon those rounds and go back to
        their last committed state), and the pushes of the new one that came early are
        served now."""
        log.warning("server %d (started as server %d): the job re-formed with %d worker(s) "
                    "(epoch %d); %d round(s) in progress dropped", self.link.rank, self.started_as,
                    workers, epoch, len(self.waiting))
        self.epoch, self.workers = epoch, workers
        self.aggregator = self._aggregator(workers)
        self.waiting, self.senders, self.finished, self.dead = {}, {}, set(), {}
        self.answers = {}
        self._flush()  # (answers of the old membership, which its workers drop)
        self.batching = set()  # every worker connects anew for the new membership
        self.stalls = StallWatch.from_env()
        early, self.early, self.early_bytes = self.early, [], 0
        for pushed, identity, frames in early:  # this epoch's served; later ones kept again
            if pushed >= epoch:
                self.on_push(identity, frames)

    def keep_early(self, epoch: int, sender: int, identity: bytes, frames: list) -> None:
        """Keep a push of a newer membership than this server has been told of (two re-forms
        can come before it hears of the first). Refused with an error: one from a rank no
        membership of this job can have, one more than ``EARLY_EPOCHS`` ahead, and any past
        a quarter of ``PS_SERVER_MAX_BYTES`` in all: what is kept is bounded by what the
        job's own workers can send before the word of their re-form reaches this server."""
        ranks = self.config.bounds[1]
        if not 0 <= sender < ranks:
            raise PushRejected(f"sender {sender} is not a worker rank of this job (0 to {ranks - 1})")
        if epoch > self.epoch + EARLY_EPOCHS:
            raise PushRejected(f"epoch {epoch} was never announced: this server is at epoch "
                               f"{self.epoch}, and keeps pushes at most {EARLY_EPOCHS} ahead")
        size = sum(memoryview(f).nbytes for f in frames)
        if self.early_bytes + size > self.limits.max_bytes // 4:
            raise PushRejected(f"epoch {epoch} is ahead of this server's {self.epoch}, and the "
                               f"pushes that came before it pass a quarter of PS_SERVER_MAX_BYTES")
        self.early.append((epoch, identity, frames))
        self.early_bytes += size

    def on_finish(self, rank: int, identity: bytes) -> None:
        """A worker's finish comes behind its last push on the same connection: from here on,
        a round it has not pushed can never complete."""
        self.aggregator.check_sender(rank)
        self.senders[rank] = identity
        self.finished.add(rank)
        for key in list(self.waiting):
            self.fail_if_stranded(key)

    def fail_if_stranded(self, key: int) -> None:
        """A round that a finished worker has not pushed can never complete: every worker
        waiting on it gets an error now, naming the worker, instead of a timeout; later
        pushes of the key get the same error."""
        state = self.aggregator.keys.get(key)
        if state is None or not state.pushed:
            return
        missing = sorted(self.finished - state.pushed)
        if not missing:
            return
        reason = self.dead[key] = (f"worker(s) {missing} finished without pushing round {state.round} "
                                   f"of key {key}; the round cannot complete")
        log.error("%s", reason)
        self.stalls.end(key)
        for peer in self.waiting.pop(key, []):
            self._reply(peer, wire.encode(Op.ERROR, key=key, round=state.round, message=reason,
                                          **wire.epoch_field(self.epoch)))


    def check_stalls(self) -> None:
        """Rounds that have waited too long for some workers: told to the workers that wait
        and to the scheduler, which ends the job once they pass the abort threshold."""
        now = time.monotonic()
        if now - self._stalls_checked < self.config.heartbeat_interval:
            return  # the loop turns once per batch of pushes: no scan of every round each time
        self._stalls_checked = now

        def missing(key: int) -> list[int]:
            return sorted(set(range(self.workers)) - self.aggregator.keys[key].pushed)
        warn, abort = self.stalls.check(now, missing)
        for stall, ending in [(s, False) for s in warn] + [(s, True) for s in abort]:
            fields = {"keys": stall.keys[:64], "rounds": len(stall.keys),
                      "missing": list(stall.missing), "seconds": round(stall.seconds, 1),
                      "server": self.link.rank, "abort": ending}
            log.warning("server %d: %d round(s) (keys %s) have waited %.0f s for worker(s) %s%s",
                        self.link.rank, len(stall.keys), stall.keys[:4], stall.seconds,
                        list(stall.missing), "; asking the scheduler to end the job" if ending else "")
            self.link.report(Op.STALL, fields)
            if not ending:  # once to every worker that waits in one of these rounds
                peers = {peer for key in stall.keys for peer in self.waiting.get(key, [])}
                for peer in peers:
                    self._reply(peer, wire.encode(Op.STALL, **fields, **wire.epoch_field(self.epoch)))
        for stall in abort:  # told once: the scheduler ends the job
            for key in stall.keys:
                self.stalls.end(key)


def main() -> int:
    """The server process: configured from the environment, returns its exit status."""
    try:
        config = start_role("server")
        limits = ServerLimits.from_env()
        resparsify = resparsifier_from_env()
        threads = env_int("BYTEPS_SERVER_ENGINE_THREAD", 1, minimum=1)
        torch.set_num_threads(threads)
        server = Server(config, limits, resparsify)
    except ValueError as exc:
        print(f"server: {exc}", file=sys.stderr)
        return 2
    return server.run()
