"""The scheduler role: membership, the address book, agreeing collectives, and liveness.

It waits for DMLC_NUM_SERVER servers and DMLC_NUM_WORKER workers, gives
every node its rank and the servers' addresses, agrees every collective by
name before its data moves (coordinator.py), answers heartbeats, and
when a node's connection closes (it crashed or was killed) or it goes
silent (it hangs) tells everyone which one, so the job ends with a clear
error instead of a hang. In an elastic job (``PS_MIN_WORKERS``,
``PS_MAX_WORKERS``) the workers may change instead: a lost worker re-forms
the job without it, a worker that registers late joins it (reform.py). When
every worker has finished it tells the servers to shut down and exits 0.

    DMLC_ROLE=scheduler ... python -m adtopk_ps.cluster.scheduler
"""
from __future__ import annotations

import logging
import os
import sys
import time

import zmq

from adtopk_ps import wire
from adtopk_ps.cluster.coordinator import Coordinator, Outgoing
from adtopk_ps.cluster.liveness import RECONNECT_GRACE, ConnectionTable, stall_limits
from adtopk_ps.cluster.membership import ClusterConfig, job_differences, start_role
from adtopk_ps.cluster.node import Node
from adtopk_ps.cluster.reform import Reforming
from adtopk_ps.cluster.security import job_secret_from_env
from adtopk_ps.cluster.stop import exit_when_done
from adtopk_ps.cluster.transport import (WAIT_NOTICE_S, drain, exit_status, make_socket,
                                         register_timeout, send)
from adtopk_ps.core.env import EnvError, env_int
from adtopk_ps.wire import Op

log = logging.getLogger("adtopk_ps.scheduler")


def _shown(value: object) -> str:
    return "unset" if value is None else str(value)


class Scheduler(Reforming):
    """The scheduler's state: the nodes, the collectives being agreed and who has finished."""

    def __init__(self, config: ClusterConfig, ctx: zmq.Context | None = None):
        self.config = config
        self.ctx = ctx or zmq.Context.instance()
        self.sock = make_socket(self.ctx, zmq.ROUTER, curve="server")
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        try:
            self.sock.bind(f"tcp://{config.listen_host}:{config.root_port}")
        except zmq.ZMQError as exc:
            self.sock.close(0)
            raise EnvError(f"cannot listen on DMLC_PS_ROOT_PORT={config.root_port}: {exc.strerror} "
                           f"(another scheduler, or another program, holds it; stop it or "
                           f"choose another port)") from None
        self.conns = ConnectionTable(self.sock)
        self.secret = job_secret_from_env()  # handed to every node with the address book
        self.description: list | None = None  # the job's (the first worker's): joiners must match
        self.stall_limits = stall_limits()
        self.stall_warned: set[str] = set()  # calls named as stalled already
        self.nodes: dict[bytes, Node] = {}
        self.started = False
        self.fatal: tuple[str, int] | None = None  # why the job cannot go on, and the status
        self.failures: list[str] = []  # workers whose processes ended on an error
        self.status = 1  # the exit status of the first of them: the job's
        self.workers = config.num_workers  # in the job now (fewer after an elastic re-form)
        self.epoch = 0  # how many times the job has re-formed
        self.grace = env_int("PS_DEADLOCK_GRACE_MS", 500, minimum=0) / 1000
        self.coordinator = Coordinator(config.num_workers, self.grace)
        self._init_reforming()

    def run(self) -> int:
        """Serve until every worker has finished (0; 1 if one ended on an error) or a node
        is lost (non-zero)."""
        cfg = self.config
        log.info("scheduler listening on port %d for %d server(s) and %d worker(s) (pid %d)",
                 cfg.root_port, cfg.num_servers, cfg.num_workers, os.getpid())
        deadline = time.monotonic() + register_timeout()
        notice = time.monotonic() + WAIT_NOTICE_S[1]
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.conns.sock, zmq.POLLIN)
        try:
            while True:
                poller.poll(int(min(cfg.heartbeat_interval, RECONNECT_GRACE / 4) * 1000))
                for identity, *frames in drain(self.sock):
                    if self._on_message(identity.bytes, frames, identity.get(zmq.SRCFD)):
                        return self._done()
                if self.fatal is not None:
                    return self._end_job(*self.fatal)
                for fd in self.conns.update():
                    self._connection_closed(fd)
                if self.started:
                    self._deliver(self.coordinator.tick())
                    self._check_collective_stalls()
                lost = self._closed_node() or self._silent_node()
                status = self._lost(*lost) if lost is not None else self._check_short()
                if status is not None:
                    return status
                self._take_in()
                if not self.started and time.monotonic() >= notice:
                    have = self._count()
                    log.info("waiting for %d more server(s) and %d more worker(s); giving up in "
                             "%.0f s (PS_REGISTER_TIMEOUT_S)", cfg.num_servers - have["server"],
                             cfg.num_workers - have["worker"], deadline - time.monotonic())
                    notice = time.monotonic() + WAIT_NOTICE_S[1]
                if not self.started and time.monotonic() > deadline:
                    have = self._count()
                    log.error("only %d server(s) and %d worker(s) registered within %.0f s "
                              "(PS_REGISTER_TIMEOUT_S); giving up", have["server"], have["worker"],
                              register_timeout())
                    return 1
        finally:
            self.conns.close()
            self.sock.close(0)

    def _count(self) -> dict:
        counts = {"server": 0, "worker": 0}
        for node in self.nodes.values():
            counts[node.role] += 1
        return counts

    def _reply(self, identity: bytes, op: Op, **extra) -> None:
        try:
            send(self.sock, wire.encode(op, **extra), identity)
        except zmq.ZMQError as exc:  # the peer is gone; its silence will be noticed
            log.warning("could not reach %r: %s", identity, exc)

    def _on_message(self, identity: bytes, frames: list, fd: int) -> bool:
        try:
            msg = wire.decode(frames, tensors=False)
        except wire.WireError as exc:
            log.warning("dropped a malformed message from %r: %s", identity, exc)
            self._reply(identity, Op.ERROR, message=str(exc))
            return False
        node = self.nodes.get(identity) or self.joining.get(identity)
        if node is not None:
            node.last_seen, node.fd = time.monotonic(), fd
        if msg.op == Op.REGISTER:
            self._register(identity, msg, fd)
        elif node is not None and node.identity in self.joining and msg.op == Op.HEARTBEAT:
            self._reply(identity, Op.HEARTBEAT, **self._progress())  # waits to be taken in
        elif node is None or node.identity in self.joining:
            self._reply(identity, Op.ERROR, message=f"{msg.op} from a node that never registered")
        elif msg.op == Op.HEARTBEAT:
            # until the job starts, a waiting node learns who else is there
            self._reply(identity, Op.HEARTBEAT, **({} if self.started else self._progress()))
        elif msg.op in (Op.NEGOTIATE, Op.BLOCKED) and node.role == "worker":
            self._negotiate(node, msg)
        elif msg.op == Op.STALL and node.role == "server":
            self._stall(node, msg.extra)
        elif msg.op == Op.FINISH:
            failed = msg.extra.get("failed")
            return self._finish(node, failed if isinstance(failed, str) else None,
                                exit_status(msg.extra.get("status")))
        else:
            self._reply(identity, Op.ERROR, message=f"op {msg.op.value!r} is not for the scheduler")
        return False

    def _register(self, identity: bytes, msg: wire.Message, fd: int) -> None:
        cfg = self.config
        role = msg.extra.get("role")
        host, port = msg.extra.get("host"), msg.extra.get("port")
        wid = msg.extra.get("worker_id", -1)
        if role == "server":
            wid = msg.extra.get("server_id", -1)  # PS_SERVER_ID: the rank it asks for
        problem = None
        joining = self.started and role == "worker"
        if self.started and role != "worker":
            problem = "the job has already started"
        elif role not in ("server", "worker"):
            problem = f"role {role!r} cannot register"
        elif not isinstance(host, str) or not isinstance(port, int) or not isinstance(wid, int):
            problem = "register needs host (str), port (int) and worker_id (int)"
        elif joining:
            problem = self._refuse_join()
        elif self._count()[role] >= (cfg.num_servers if role == "server" else cfg.num_workers):
            problem = (f"all {role}s have already registered (expected "
                       f"{cfg.num_servers if role == 'server' else cfg.num_workers}: DMLC_NUM_SERVER, "
                       f"or DMLC_NUM_WORKER x BYTEPS_LOCAL_SIZE)")
        elif role == "worker" and wid >= cfg.num_workers:
            problem = f"DMLC_WORKER_ID={wid} is not below DMLC_NUM_WORKER={cfg.num_workers}"
        elif role == "worker" and wid >= 0 and any(
                n.role == "worker" and n.rank == wid for n in self.nodes.values()):
            problem = f"DMLC_WORKER_ID={wid} is taken by another worker"
        elif role == "server" and wid >= cfg.num_servers:
            problem = f"PS_SERVER_ID={wid} is not below DMLC_NUM_SERVER={cfg.num_servers}"
        elif role == "server" and wid >= 0 and any(
                n.role == "server" and n.rank == wid for n in self.nodes.values()):
            problem = f"PS_SERVER_ID={wid} is taken by another server"
        job, theirs = os.environ.get("PS_JOB_ID", ""), msg.extra.get("job", "")
        if problem is None and job and theirs and theirs != job:
            problem = (f"this scheduler runs job {job!r} (PS_JOB_ID); the {role} at {host} "
                       f"belongs to job {theirs!r}: a scheduler left from another run on this "
                       f"port?")
        if problem is None and role in ("server", "worker"):
            problem = self._shape_disagrees(role, host, msg.extra)
            if problem and not joining:  # a joiner that disagrees is refused; the job goes on
                self.fatal = (f"the job cannot run: {problem}", 2)
        if problem is None and role == "worker":
            problem = self._job_disagrees(host, msg.extra.get("description", []), joining)
        if problem:
            log.error("refused %s from %s:%s: %s", role, host, port, problem)
            self._reply(identity, Op.ERROR, message=problem)
            return
        address = f"tcp://{host}:{port}" if role == "server" else f"{host}"
        if joining:
            return self._join(Node(identity, role, -1, address, time.monotonic(), fd, started_as=wid))
        self.nodes[identity] = Node(identity, role, wid, address, time.monotonic(), fd)
        log.info("registered %s at %s", role, address)
        counts = self._count()
        if counts["server"] == cfg.num_servers and counts["worker"] == cfg.num_workers:
            self._start()
        else:
            self._reply(identity, Op.HEARTBEAT, **self._progress())

    def _shape_disagrees(self, role: str, host: object, extra: dict) -> str | None:
        """Where a node was given another cluster shape than the scheduler, which variable,
        and each side's value: the job cannot run (a server would wait for workers that
        never come, or refuse ranks that exist)."""
        cfg = self.config
        for field, ours, variable in (
                ("num_workers", cfg.num_workers, "DMLC_NUM_WORKER x BYTEPS_LOCAL_SIZE"),
                ("num_servers", cfg.num_servers, "DMLC_NUM_SERVER"),
                # keys are cut by it: two sizes cut one tensor into keys that never match
                ("partition_bytes", cfg.partition_bytes, "BYTEPS_PARTITION_BYTES"),
                # the same key would go to different servers
                ("placement", cfg.placement, "PS_PLACEMENT"),
                # a role that is not elastic would end the job where the others re-form
                ("min_workers", cfg.min_workers, "PS_MIN_WORKERS"),
                ("max_workers", cfg.max_workers, "PS_MAX_WORKERS")):
            theirs = extra.get(field)
            if theirs != ours:
                return (f"the {role} at {host} has {variable} = {_shown(theirs)}, the scheduler "
                        f"{_shown(ours)}: every role must be given the same values")
        return None

    def _job_disagrees(self, host: object, theirs: object, joining: bool) -> str | None:
        """Where a joining worker's job description (``init(job=...)``) differs from the
        running job's, each difference: it is refused, and the job never sees it. Workers
        that form the job compare theirs in their own agreement, on every worker alike."""
        if not isinstance(theirs, list) or not all(
                isinstance(p, list) and len(p) == 2 and all(isinstance(v, str) for v in p)
                for p in theirs):
            return f"the worker at {host} sent a malformed job description"
        if self.description is None:
            self.description = theirs
            return None
        if not joining or not self.description:
            return None
        if not theirs:
            return (f"the worker at {host} does not describe its job (init(job=...)), and the "
                    f"running job's workers do")
        lines = job_differences(self.description, theirs)
        if not lines:
            return None
        more = f" (and {len(lines) - 5} more)" if len(lines) > 5 else ""
        return (f"the worker at {host} would run another job than the running one: "
                + "; ".join(lines[:5]) + more)

    def _end_job(self, why: str, status: int) -> int:
        """End the job at once (roles that disagree, a stall), telling every node why."""
        log.error("%s; ending the job", why)
        for node in [*self.nodes.values(), *self.joining.values()]:
            if not node.finished:
                self._reply(node.identity, Op.NODE_LOST, what=why)
        self._await_hangups(1.0)
        return status

    def _stall(self, node: Node, x: dict) -> None:
        """A server's rounds wait for some workers: said here, and past the abort threshold
        the job ends naming them."""
        missing = ", ".join(self._worker_label(r) for r in x.get("missing", []))
        what = (f"{x.get('rounds', '?')} round(s) on {node.label} (keys {x.get('keys', [])[:4]}) "
                f"have waited {x.get('seconds', 0):.0f} s for {missing or 'no worker'}, which "
                f"pushed nothing for them (a hung training loop or data loader, or a call the "
                f"others never make?)")
        if x.get("abort"):
            self.fatal = (f"the job stalled: {what} (PS_STALL_ABORT_S)", 1)
        else:
            log.warning("%s (PS_STALL_WARN_S)", what)

    def _check_collective_stalls(self) -> None:
        """Workers that wait in a call others never make: named after ``PS_STALL_WARN_S``;
        after ``PS_STALL_ABORT_S`` an elastic job goes on without those others (each told
        why), any other job ends naming them."""
        warn_s, abort_s = self.stall_limits
        for name, missing, waited in self.coordinator.stalls():
            who = ", ".join(self._worker_label(r) for r in missing)
            what = (f"the other workers have waited {waited:.0f} s in {name} for {who}, "
                    f"which has not called it (a hung training loop or data loader, or a "
                    f"joiner slow to start?)")
            if abort_s and waited > abort_s:
                nodes = [n for n in self._ranked() if n.rank in missing]
                if not self._changeable() or len(nodes) >= len(self._ranked()):
                    self.fatal = (f"the job stalled: {what} (PS_STALL_ABORT_S)", 1)
                    return
                for node in nodes:
                    why = f"dropped from the job: {what} (PS_STALL_ABORT_S)"
                    self._reply(node.identity, Op.NODE_LOST, what=f"{node.label} {why}")
                    self._lost(node, why)
                return  # (the re-form closes the calls; what stalls next is judged afresh)
            if waited > warn_s and name not in self.stall_warned:
                self.stall_warned.add(name)
                log.warning("%s (PS_STALL_WARN_S)", what)

    def _worker_label(self, rank: object) -> str:
        node = next((n for n in self.nodes.values() if n.role == "worker" and n.rank == rank), None)
        return node.label if node is not None else f"worker {rank}"

    def _progress(self) -> dict:
        """How many nodes of each role have registered, and how many the job needs."""
        cfg = self.config
        return {"registered": self._count(),
                "expected": {"server": cfg.num_servers, "worker": cfg.num_workers}}

    def _start(self) -> None:
        for role, count in (("server", self.config.num_servers), ("worker", self.config.num_workers)):
            taken = {n.rank for n in self.nodes.values() if n.role == role and n.rank >= 0}
            free = iter(r for r in range(count) if r not in taken)
            for node in self.nodes.values():
                if node.role == role and node.rank < 0:
                    node.rank = next(free)
                if node.role == role:
                    node.started_as = node.rank
        book = self._book()
        for node in self.nodes.values():
            self._reply(node.identity, Op.ADDRESSBOOK, rank=node.rank, servers=book,
                        num_workers=self.config.num_workers, secret=self.secret)
        self.started = True
        log.info("all %d node(s) registered; job started", len(self.nodes))
        formed = os.environ.get("PS_FORMED_FILE", "").strip()  # bpslaunch --local watches it
        if formed:
            with open(formed, "w"):
                pass

    def _book(self) -> list[str]:
        """The servers' addresses by rank: what every node connects to."""
        servers = sorted((n for n in self.nodes.values() if n.role == "server"), key=lambda n: n.rank)
        return [n.address for n in servers]

    def _negotiate(self, node: Node, msg: wire.Message) -> None:
        """A worker's request for a collective, or word that it waits for one; one sent before
        the worker knew of the last re-form is of a membership that is gone (dropped)."""
        x = msg.extra
        if x.get("epoch", 0) != self.epoch:
            return
        if msg.op == Op.BLOCKED:
            if x.get("withdraw"):
                self._deliver(self.coordinator.withdraw(node.rank, msg.round))
            elif x.get("waiting", True):
                self._deliver(self.coordinator.block(node.rank, msg.round))
            else:
                self.coordinator.unblock(node.rank, msg.round)
            return
        name, match, failed = x.get("name"), x.get("match", {}), x.get("failed")
        if not isinstance(name, str) or not name or not isinstance(match, dict) or \
                not isinstance(failed, (str, type(None))):
            self._reply(node.identity, Op.AGREED, round=msg.round, ok=False, name=str(name),
                        message=f"malformed negotiate: name {name!r:.60}, match {match!r:.60}")
            return
        self._deliver(self.coordinator.request(
            node.rank, msg.round, name, match, x.get("own"), failed,
            bool(x.get("standin", False)), bool(x.get("release", False))))

    def _deliver(self, messages: list[Outgoing]) -> None:
        by_rank = {n.rank: n for n in self.nodes.values() if n.role == "worker"}
        logged = set()
        for out in messages:
            node = by_rank.get(out.rank)
            if node is None or node.finished:
                continue
            if out.op == "agreed":
                fields = dict(out.fields)
                if not fields.get("ok") and fields["name"] not in logged:
                    logged.add(fields["name"])
                    log.warning("refused %s", fields.get("message"))
                self._reply(node.identity, Op.AGREED, round=fields.pop("reqid"), **fields)
            else:
                self._reply(node.identity, Op.STANDIN, **out.fields)

    def _finish(self, node: Node, failed: str | None = None, status: int = 1) -> bool:
        """A node is done; ``failed``: its process is ending on this error with exit
        ``status``, and the job has failed (every role then exits with the first failed
        worker's status, naming it)."""
        node.finished = True
        self._reply(node.identity, Op.SHUTDOWN)
        if failed:
            if not self.failures:
                self.status = status
            self.failures.append(f"{node.label} failed: {failed}")
            log.error("%s failed: %s", node.label, failed)
        else:
            log.info("%s finished", node.label)
        if node.role == "worker":
            self._deliver(self.coordinator.finished(node.rank))
        return self._all_finished()

    def _all_finished(self) -> bool:
        """Whether every worker has finished; then the servers are told to shut down."""
        if all(n.finished for n in self.nodes.values() if n.role == "worker"):
            verdict = {"failed": "; ".join(self.failures), "status": self.status} if self.failures else {}
            for n in self.nodes.values():
                if n.role == "server":
                    n.finished = True
                    self._reply(n.identity, Op.SHUTDOWN, **verdict)
            if self.failures:
                log.error("all workers finished, %d of them on an error; shutting down with "
                          "status %d", len(self.failures), self.status)
            else:
                log.info("all workers finished; shutting down")
            return True
        return False

    def _connection_closed(self, fd: int) -> None:
        now = time.monotonic()
        for node in [*self.nodes.values(), *self.joining.values()]:
            if node.fd == fd and not node.finished and node.closed_at is None:
                node.closed_at = now

    def _closed_node(self) -> tuple[Node, str] | None:
        """A node whose connection closed and that has not spoken on another one within
        the grace (zmq reconnects on its own); before the job starts it is dropped, so
        that a restarted node can take its place."""
        now = time.monotonic()
        for identity, node in [*self.nodes.items(), *self.joining.items()]:
            if node.closed_at is None or node.finished:
                continue
            if node.last_seen > node.closed_at and node.fd in self.conns.open:
                node.closed_at = None  # it reconnected
            elif now - node.closed_at > RECONNECT_GRACE:
                why = (f"its connection to the scheduler closed {now - node.closed_at:.1f} s ago "
                       f"and did not come back (the process exited or was killed)")
                if self.started:
                    return node, why
                log.warning("%s dropped before the job started: %s", node.label, why)
                del self.nodes[identity]
        return None

    def _silent_node(self) -> tuple[Node, str] | None:
        now = time.monotonic()
        for identity, node in [*self.nodes.items(), *self.joining.items()]:
            if node.finished or now - node.last_seen <= self.config.heartbeat_timeout:
                continue
            why = f"no heartbeat for {now - node.last_seen:.1f} s"
            if self.started:
                return node, why
            log.warning("%s went silent before the job started (%s); dropping it", node.label, why)
            del self.nodes[identity]
        return None

    def _done(self) -> int:
        """Every worker has finished: the job's exit status, once the servers have heard."""
        self._await_hangups(2.0)  # the shutdown notices leave before we do
        return self.status if self.failures else 0

    def _lose(self, lost: Node, why: str) -> int:
        what = f"{lost.label} lost: {why}"
        if self.config.elastic and not self._changeable():
            what += "; a worker has already finished, so the job cannot re-form"
        elif self.config.elastic and lost.role == "server":
            what += "; no other server remains to take its keys"
        elif self.config.elastic:
            what += "; no other worker remains to hand the training state to one that joins"
        log.error("%s; telling every node", what)
        for node in [*self.nodes.values(), *self.joining.values()]:
            if node is not lost and not node.finished:
                self._reply(node.identity, Op.NODE_LOST, what=what)
        self._await_hangups(1.0, skip=lost)  # the notices leave before the socket closes
        return 1

    def _await_hangups(self, timeout: float, skip: Node | None = None) -> None:
        """Wait (at most ``timeout`` s) until every node has closed its connection: it
        has read what we sent last, which closing our socket now could have dropped."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.conns.update()
            if not any(n.fd in self.conns.open for n in self.nodes.values() if n is not skip):
                return
            self.conns.sock.poll(50)


def main() -> int:
    """The scheduler process: configured from the environment, returns its exit status."""
    try:
        scheduler = Scheduler(start_role("scheduler"))
    except EnvError as exc:
        print(f"scheduler: {exc}", file=sys.stderr)
        return 2
    return scheduler.run()


if __name__ == "__main__":
    exit_when_done(main())
