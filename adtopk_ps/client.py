"""The worker's side of the parameter server (ps-lite's KVWorker).

``push_pull`` returns at once with a handle. One background engine thread
owns every socket: it compresses queued tensors in priority order (later
layers, whose gradients the backward pass produces first, go first), splits
them into keys, sends each key as soon as it is encoded (many keys in flight
on one DEALER per server), and writes each answer into the handle's output
as it arrives.

Keys are never held back for credit: under BSP a round completes only when
every worker has pushed it, so if workers held back different keys (their
queues need not be in the same order) each would wait for the others.
"""
from __future__ import annotations

import heapq
import itertools
import logging
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Mapping

import torch
import zmq

from . import wire
from .cluster import ClusterConfig, make_key, partition_rows, server_of
from .compression import Compressor, Dense
from .env import env_int
from .liveness import PeerWatch
from .transport import (ClusterError, SchedulerLink, drain, make_socket, register_timeout,
                        security, send)

log = logging.getLogger("adtopk_ps.client")
FLUSH_MS = 2000  # how long closing waits for queued messages after a clean finish


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


def split(tensor: torch.Tensor, blocks: list[tuple[int, int]]) -> list[torch.Tensor]:
    """Views of a tensor's partitions (rows for 2+ dimensions, flat elements otherwise)."""
    if tensor.dim() >= 2:
        return [tensor.narrow(0, start, length) for start, length in blocks]
    flat = tensor.reshape(-1)
    return [flat.narrow(0, start, length) for start, length in blocks]


def part_name(name: str, index: int) -> str:
    """The name a partition's compressor state is kept under."""
    return f"{name}#{index}"


class PushPullError(RuntimeError):
    """A server refused one of this worker's pushes."""


class Handle:
    """The pending result of one ``push_pull``."""

    def __init__(self, client: "PSClient", name: str, out: torch.Tensor, parts: int, average: bool,
                 out_given: bool = False):
        self.name, self.out, self.out_given = name, out, out_given
        self.divisor = client.size if average else 1
        self._client = client
        self.parts = self._left = parts
        self._event = threading.Event()
        self._error: BaseException | None = None
        self.completed_at: float | None = None  # time.monotonic() when the answer was complete
        # ranks whose push of this tensor held a NaN or an infinity (the servers' answers say,
        # alike on every worker): the result is not to be trusted
        self.nonfinite: set[int] = set()

    def done(self) -> bool:
        """Whether the answer is complete (or the push failed); never blocks."""
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> torch.Tensor:
        """The averaged (or summed) result; raises if the job failed or ``timeout`` passed."""
        timeout = self._client.timeout if timeout is None else timeout
        if not self._event.wait(timeout):
            raise TimeoutError(f"push_pull of {self.name!r} not answered within {timeout:.1f} s")
        if self._error is not None:
            raise self._error
        return self.out

    def _part_done(self) -> None:
        self._left -= 1
        if self._left == 0:
            self.completed_at = time.monotonic()
            self._event.set()

    def _fail(self, error: BaseException) -> None:
        if not self._event.is_set():
            self._error = error
            self._event.set()


@dataclass
class _Tensor:
    id: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    blocks: list[tuple[int, int]]
    keys: list[int]


@dataclass(order=True)
class _Job:
    priority: int
    seq: int
    handle: Handle = field(compare=False)
    tensor: torch.Tensor = field(compare=False)
    meta: _Tensor = field(compare=False)
    compressor: Compressor = field(compare=False)
    step: int = field(compare=False)
    ratio: float | None = field(compare=False)


@dataclass
class _Part:
    handle: Handle
    view: torch.Tensor  # where the answer goes
    round: int


class PSClient:
    """One worker's connection to the scheduler and every server."""

    def __init__(self, config: ClusterConfig | None = None, ctx: zmq.Context | None = None):
        self.config = config or ClusterConfig.from_env(role="worker")
        self.timeout = float(env_int("PS_PUSH_PULL_TIMEOUT_S", 600, minimum=1))
        self.ctx = ctx or zmq.Context.instance()
        # a bad PS_CURVE_KEYS fails here, naming the variable
        self.encrypted = security(self.ctx).keys is not None
        self.rank, self.size = -1, self.config.num_workers
        self.servers: list[str] = []
        self.bytes_pushed = self.bytes_pulled = 0
        self.compress_seconds = 0.0
        self._tensors: dict[str, _Tensor] = {}
        self._ids: dict[str, int] = {}  # tensor ids by name, given at declaration or reservation
        self._steps: dict[str, int] = {}
        self._last: dict[str, Handle] = {}
        self._rounds: dict[int, int] = {}
        self._jobs: list[_Job] = []
        self._in_hand: _Job | None = None  # the engine's, between the queue and the wire
        self._inflight: dict[int, _Part] = {}  # by key; the engine thread's own
        self._commands: list[tuple] = []
        self._seq = itertools.count()
        self._lock = threading.RLock()  # re-entrant: push_pull pokes while holding it
        wake_addr = f"inproc://adtopk-wake-{id(self)}"
        self._wake_in = make_socket(self.ctx, zmq.PULL)
        self._wake_in.bind(wake_addr)
        self._wake_out = make_socket(self.ctx, zmq.PUSH)
        self._wake_out.connect(wake_addr)
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._closed = False
        shorten_gil_switch()
        self._thread = threading.Thread(target=self._engine, name="adtopk-engine", daemon=True)
        self._thread.start()
        if not self._ready.wait(register_timeout() + 5) or self._error is not None:
            self._closed = True
            raise self._error or ClusterError("the worker engine did not start")

    # --- the caller's side -------------------------------------------------

    def push_pull(self, tensor: torch.Tensor, name: str, compressor: Compressor | None = None,
                  average: bool = True, priority: int | None = None,
                  ratio: float | None = None, step: int | None = None,
                  out: torch.Tensor | None = None) -> Handle:
        """Start summing ``tensor`` across workers; do not modify it until the handle is done.

        ``out`` receives the result (default: a new tensor); it may be
        ``tensor`` itself, as a key's answer comes only after the server has
        every push of it, this worker's included. ``ratio`` overrides the
        compressor's density for this tensor (the partial-sparsification
        policy's per-layer choice); ``step`` is what the compressor sees
        (default: how often this name was pushed), which a resumed job sets
        so that seeds and schedules continue.

        Example::

            client = PSClient()                       # from the DMLC environment
            handle = client.push_pull(grad, "fc.weight", create("adtopk", ratio=0.01), out=grad)
            handle.wait()                             # grad now holds the average over workers
        """
        self.check()
        meta = self._declare(name, tensor)
        last = self._last.get(name)
        if last is not None and not last.done():
            raise ValueError(f"push_pull of {name!r} is still in flight; wait for it first")
        if step is None:
            step = self._steps.get(name, 0)
        self._steps[name] = step + 1
        given = out is not None
        if not given:
            out = torch.empty(meta.shape, dtype=meta.dtype, device=tensor.device)
        elif (out.shape, out.dtype, out.device) != (tensor.shape, tensor.dtype, tensor.device):
            raise ValueError(f"out for {name!r} is {out.dtype} {tuple(out.shape)} on {out.device}; "
                             f"the tensor is {tensor.dtype} {tuple(tensor.shape)} on {tensor.device}")
        handle = self._last[name] = Handle(self, name, out, len(meta.keys), average, given)
        job = _Job(-meta.id if priority is None else priority, next(self._seq), handle,
                   tensor.detach(), meta, compressor or Dense(), step, ratio)
        with self._lock:
            # the engine empties the queue before it sleeps: only a push into an empty queue
            # must wake it (each wake-up is a send and a GIL hand-over on the training thread)
            wake = not self._jobs
            heapq.heappush(self._jobs, job)
        if wake:
            self._poke()
        return handle

    def barrier(self, timeout: float | None = None) -> None:
        """Wait until every worker has reached this barrier."""
        self.check()
        done = threading.Event()
        with self._lock:
            self._commands.append(("barrier", done))
        self._poke()
        timeout = self.timeout if timeout is None else timeout
        if not done.wait(timeout):
            raise TimeoutError(f"barrier not reached by every worker within {timeout:.1f} s")
        self.check()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Tell the scheduler this worker is done and stop the engine."""
        if self._closed:
            return
        self._closed = True
        if self._thread.is_alive():
            with self._lock:
                self._commands.append(("finish", None))
            self._poke()
            self._thread.join(timeout)
        self._wake_out.close(0)

    def check(self) -> None:
        """Raise what ended this worker's part in the job (a lost peer, a refused push), if any."""
        if self._error is not None:
            raise self._error
        if self._closed:
            raise ClusterError("the parameter-server client has been shut down")

    def _poke(self) -> None:
        with self._lock:
            try:
                self._wake_out.send(b"", zmq.NOBLOCK)
            except zmq.Again:  # a wake-up is already queued, or the engine has stopped
                pass

    def reserve(self, name: str) -> int:
        """Give ``name`` its tensor id before its shape is known (byteps' ``declare(name)``);
        every worker must reserve and declare in the same order."""
        return self._ids.setdefault(name, len(self._ids))

    def quiesce(self, timeout: float | None = None) -> None:
        """Wait until every push_pull started so far has its answer (or has failed: its own
        handle reports that)."""
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        for name, handle in list(self._last.items()):
            if not handle._event.wait(max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"push_pull of {name!r} still in flight after {timeout:.1f} s")

    def declare(self, name: str, tensor: torch.Tensor) -> int:
        """Give ``name`` its tensor id now; every worker must declare in the same order.

        A tensor first pushed without a declaration is declared then, so
        workers whose first pushes come in different orders must declare
        up front (the torch integration declares every parameter at start).
        """
        return self._declare(name, tensor).id

    def _declare(self, name: str, tensor: torch.Tensor) -> _Tensor:
        meta = self._tensors.get(name)
        shape = tuple(tensor.shape)
        if meta is None:
            tid = self.reserve(name)
            blocks = partition_rows(shape, tensor.element_size(), self.config.partition_bytes)
            keys = [make_key(tid, i) for i in range(len(blocks))]
            meta = self._tensors[name] = _Tensor(tid, shape, tensor.dtype, blocks, keys)
        elif meta.shape != shape or meta.dtype != tensor.dtype:
            raise ValueError(f"tensor {name!r} was declared as {meta.dtype} {meta.shape}, "
                             f"now pushed as {tensor.dtype} {shape}")
        return meta

    # --- the engine thread -------------------------------------------------

    def _engine(self) -> None:
        link = SchedulerLink(self.ctx, self.config)
        servers: list[zmq.Socket] = []
        watches: list[PeerWatch] = []  # each server connection's, to notice a server's death
        linger = 0
        try:
            book = link.register()
            self.rank, self.servers = link.rank, list(book["servers"])
            for address in book["servers"]:
                sock = make_socket(self.ctx, zmq.DEALER, f"{link.identity}-s{len(servers)}",
                                   curve="client")
                watches.append(PeerWatch(sock))
                sock.connect(address)
                servers.append(sock)
            self._ready.set()
            self._serve(link, servers, watches)
            linger = FLUSH_MS  # a clean finish: what is queued (the finish markers) still leaves
        except BaseException as exc:  # anything here ends the job for this worker
            if not isinstance(exc, ClusterError):
                log.exception("worker engine failed")
            self._error = exc if isinstance(exc, ClusterError) else ClusterError(f"engine failed: {exc}")
            self._ready.set()
            self._fail_all(self._error)
        finally:
            for watch in watches:
                watch.close()
            for sock in servers:
                sock.close(linger)
            link.close()
            self._wake_in.close(0)

    def _serve(self, link: SchedulerLink, servers: list[zmq.Socket],
               watches: list[PeerWatch]) -> None:
        poller = zmq.Poller()
        # a monitor's event wakes the loop (a peer that is down keeps producing reconnection
        # events); link.tick() and _check_servers() read them
        for sock in [link.sock, self._wake_in, link.watch.sock, *servers, *(w.sock for w in watches)]:
            poller.register(sock, zmq.POLLIN)
        which = {sock: i for i, sock in enumerate(servers)}
        barriers: list[tuple[int, threading.Event]] = []
        barrier_seq = 0
        finishing = False
        tick_ms = int(self.config.heartbeat_interval * 1000)
        while True:
            for sock, _ in poller.poll(tick_ms):
                if sock is link.sock:
                    link.handle(link.sock.recv_multipart(copy=False))
                elif sock is self._wake_in:
                    for _ in drain(self._wake_in):
                        pass
                elif sock in which:
                    for frames in drain(sock):
                        self._on_answer(which[sock], frames)
            with self._lock:
                commands, self._commands = self._commands, []
            # every push queued before a barrier or finish was queued goes out before it
            self._launch(servers)
            for op, event in commands:
                if op == "barrier":
                    barrier_seq += 1
                    link.barrier(barrier_seq)
                    barriers.append((barrier_seq, event))
                elif not finishing:
                    # behind this worker's last push on each connection: a server fails at once
                    # any round this worker left unpushed, rather than let the others wait
                    marker = wire.encode("finish", sender=self.rank)
                    for sock in servers:
                        send(sock, marker)
                    link.finish()
                    finishing = True
            for seq, event in [b for b in barriers if b[0] <= link.barrier_done]:
                barriers.remove((seq, event))
                event.set()
            if finishing and link.shutdown:
                return
            link.tick()
            self._check_servers(watches, finishing)

    def _check_servers(self, watches: list[PeerWatch], finishing: bool) -> None:
        """Raise when a server's connection closed for good; once this worker has finished,
        the servers may exit before the scheduler's answer comes (events are still read:
        a monitor nobody reads fills up)."""
        for index, watch in enumerate(watches):
            if watch.lost() and not finishing:
                raise ClusterError(f"server {index} ({self.servers[index]}) lost: its connection "
                                   f"closed {watch.closed_for():.1f} s ago and did not come back "
                                   f"(it exited or was killed); ending the job")

    def _launch(self, servers: list[zmq.Socket]) -> None:
        while True:
            with self._lock:
                if not self._jobs:
                    return
                job = heapq.heappop(self._jobs)
                self._in_hand = job  # off the queue: if it fails, _fail_all must still find it
            self._send_job(job, servers)
            self._in_hand = None

    def _send_job(self, job: _Job, servers: list[zmq.Socket]) -> None:
        meta = job.meta
        parts = split(job.tensor, meta.blocks)
        outs = split(job.handle.out, meta.blocks)
        for index, (part, out, key) in enumerate(zip(parts, outs, meta.keys)):
            started = time.perf_counter()
            payload = job.compressor.compress(part, part_name(job.handle.name, index), job.step,
                                              job.ratio)
            self.compress_seconds += time.perf_counter() - started
            rnd = self._rounds.get(key, 0)
            self._rounds[key] = rnd + 1
            flag = {"nonfinite": True} if payload.nonfinite else {}
            frames = wire.encode("push", key=key, round=rnd, sender=self.rank, payload=payload, **flag)
            self.bytes_pushed += sum(memoryview(f).nbytes for f in frames)
            self._inflight[key] = _Part(job.handle, out, rnd)
            send(servers[server_of(key, len(servers))], frames)

    def _on_answer(self, server: int, frames: list) -> None:
        self.bytes_pulled += sum(memoryview(f).nbytes for f in frames)
        try:
            msg = wire.decode(frames)
        except wire.WireError as exc:
            raise ClusterError(f"server {server} sent a malformed answer: {exc}") from None
        part = self._inflight.pop(msg.key, None)
        if part is None or msg.round != part.round:
            raise ClusterError(f"server {server} answered key {msg.key} round {msg.round}, "
                               f"which this worker is not waiting for")
        if msg.op == "error":
            part.handle._fail(PushPullError(f"server {server} refused key {msg.key} of "
                                            f"{part.handle.name!r}: {msg.extra.get('message')}"))
            return
        if msg.op != "result" or msg.payload.shape != tuple(part.view.shape):
            raise ClusterError(f"server {server} answered key {msg.key} with {msg.op} "
                               f"of the wrong shape")
        handle, payload = part.handle, msg.payload
        flagged = msg.extra.get("nonfinite", [])
        if flagged and flagged[-1] >= self.size:
            raise ClusterError(f"server {server} flagged worker(s) {flagged} of key {msg.key}, "
                               f"beyond the {self.size} workers")
        handle.nonfinite.update(flagged)
        if handle.parts == 1 and not handle.out_given and payload.codec == "dense" \
                and payload.values.dtype == handle.out.dtype and handle.out.device.type == "cpu":
            handle.out = payload.values.view(handle.out.shape)  # the received frame, no copy
            if handle.divisor != 1:
                handle.out.div_(handle.divisor)
        else:
            payload.write_into(part.view, handle.divisor)
        handle._part_done()

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            jobs, self._jobs = self._jobs, []
            if self._in_hand is not None:
                jobs.append(self._in_hand)
                self._in_hand = None
        for job in jobs:
            job.handle._fail(error)
        for part in self._inflight.values():
            part.handle._fail(error)
