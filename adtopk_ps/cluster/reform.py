"""The scheduler's elastic half: the workers and servers of a running job change
(``PS_MIN_WORKERS``, ``PS_MAX_WORKERS``).

Every change is one re-form: a new epoch, the workers renumbered 0..W-1 in their order
(a joiner last), the servers 0..S-1, and every node told at once, so that servers drop the
rounds of the old membership and workers go back to their last committed state. Four kinds:

- a worker lost while at least the minimum remain: the job goes on without it;
- a worker lost that leaves fewer than the minimum: the job re-forms *paused* (the
  workers abandon their rounds and wait) and waits up to ``PS_ELASTIC_TIMEOUT_S`` for
  workers to join, saying so while it waits; then it ends, naming why;
- a worker registers into the running job (a restarted process, a replaced pod) while
  fewer than the maximum run: it joins at once, or, while the job waits below the
  minimum, once enough have come;
- a server lost while another remains: its keys move to the others (workers place keys by
  the new address book) and the workers push again from their last commit. Servers keep
  nothing between rounds, so nothing else moves.

A job in which some worker has finished changes no more: its rounds are over.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Sequence
from adtopk_ps.cluster.coordinator import Coordinator
from adtopk_ps.cluster.node import Node
from adtopk_ps.wire import Op

log = logging.getLogger("adtopk_ps.scheduler")

#: seconds between the notices of a job that waits below its minimum
WAIT_NOTICE_EVERY_S = 5.0


def _record(event: str, node: Node) -> None:
    """``lost worker N G``, ``joined worker N G`` or ``lost server N G`` (N: the rank it started
    as, or asked for: DMLC_WORKER_ID, PS_SERVER_ID; G: its process group, see
    :func:`_launched_as`) for ``bpslaunch --local``, which judges its children's exits by them
    (``PS_REFORMED_FILE``)."""
    reformed = os.environ.get("PS_REFORMED_FILE", "").strip()
    if reformed:
        with open(reformed, "a") as out:
            out.write(f"{event} {node.role} {node.started_as} {_launched_as(node)}\n")


def _launched_as(node: Node) -> int:
    """The process group of ``node``'s process (its pid where that has ended; -1 where its
    identity names none): which of ``bpslaunch --local``'s children it is, each the leader of
    a group of its own, even where the child runs the worker under a wrapper. Several restarts
    of one worker share a DMLC_WORKER_ID, and some never register: only this tells bpslaunch
    whether the restart still running is the one that joined. bpslaunch runs this scheduler on
    the workers' host, where their pids are this process's to look up. The pid is the one in
    the identity the node's SchedulerLink gives itself (``role-pid-random``, transport.py)."""
    field = node.identity.split(b"-")[1:2]
    if not field or not field[0].isdigit():
        return -1
    pid = int(field[0])
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return pid


class Reforming:
    """Mixed into :class:`~adtopk_ps.cluster.scheduler.Scheduler`: the state of a changing
    membership (joiners not yet taken in, since when the job waits below its minimum) and
    the re-forms."""

    def _init_reforming(self) -> None:
        self.joining: dict[bytes, Node] = {}  # registered into the running job, not yet in it
        self.short_since: float | None = None  # when the job fell below its minimum
        self._short_notice = 0.0

    # -- losses ----------------------------------------------------------------------------

    def _ranked(self, role: str = "worker") -> list[Node]:
        return sorted((n for n in self.nodes.values() if n.role == role), key=lambda n: n.rank)

    def _changeable(self) -> bool:
        """An elastic job none of whose workers has finished."""
        return self.config.elastic and not any(n.finished for n in self._ranked())

    def _lost(self, lost: Node, why: str) -> int | None:
        """React to a lost node: re-form without it (None), or end the job (its status)."""
        if lost.identity in self.joining:  # not in the job yet: nothing re-forms
            log.warning("%s went away before it was taken in: %s", lost.label, why)
            del self.joining[lost.identity]
            return None
        others = [n for n in self._ranked(lost.role) if n is not lost]
        if self.config.elastic and lost.role == "worker" and others and \
                all(n.finished for n in others):
            # the others finished every step: nothing waits for it (a finish comes behind a
            # worker's last push), so the job is done without it
            log.warning("%s lost: %s; the other workers had finished every step, so the job is "
                        "done", lost.label, why)
            del self.nodes[lost.identity]
            _record("lost", lost)
            self._all_finished()  # (it is) the servers are told to shut down
            return self._done()
        if not self._changeable() or not others:  # no worker or server left to go on with
            return self._lose(lost, why)
        del self.nodes[lost.identity]
        _record("lost", lost)
        if lost.role == "server":  # (the workers go on waiting where the job is short)
            self._reform(f"{lost.label} lost: {why}; its keys move to the other server(s)",
                         paused=self.short_since is not None)
        else:
            self._settle(f"{lost.label} lost: {why}")
        return None

    def _settle(self, what: str | None) -> None:
        """After a loss (``what``) or for joiners (None): re-form, taking in every joiner, when
        that makes the minimum; otherwise (a loss) re-form paused and wait for joiners."""
        minimum = self.config.bounds[0]
        if len(self._ranked()) + len(self.joining) < minimum:
            self.short_since = self.short_since or time.monotonic()
            self._short_notice = 0.0
            self._reform(what, paused=True)
            return
        self.short_since = None
        joined = list(self.joining.values())
        self.joining = {}
        for node in joined:
            node.rank = len(self._ranked())
            node.joined = self.epoch + 1
            self.nodes[node.identity] = node
            _record("joined", node)
        joins = [f"{n.role} {n.rank} ({n.address}) joined" for n in joined]
        self._reform("; ".join(filter(None, [what, *joins])), joined=joined, lost=what is not None)

    def _why_short(self) -> str:
        have, minimum = len(self._ranked()), self.config.bounds[0]
        return (f"only {have} worker(s) remain, below PS_MIN_WORKERS={minimum}: waiting up to "
                f"{self.config.elastic_timeout:.0f} s (PS_ELASTIC_TIMEOUT_S) for "
                f"{minimum - have - len(self.joining)} more to join")

    def _check_short(self) -> int | None:
        """While the job waits below its minimum: a notice every few seconds, and the end
        (its status) once the timeout has passed."""
        if self.short_since is None:
            return None
        now = time.monotonic()
        waited = now - self.short_since
        closed = os.environ.get("PS_NO_JOINERS_FILE", "").strip()  # bpslaunch --local's word
        if closed and os.path.exists(closed) and not self.joining:
            have, minimum = len(self._ranked()), self.config.bounds[0]
            return self._end_job(f"only {have} worker(s) remain, below PS_MIN_WORKERS={minimum}, "
                                 f"and no worker can join (bpslaunch has no restarts left)", 1)
        if waited > self.config.elastic_timeout:
            have, minimum = len(self._ranked()), self.config.bounds[0]
            return self._end_job(f"only {have} worker(s) remain, below PS_MIN_WORKERS={minimum}, "
                                 f"and no worker joined to make up the rest within "
                                 f"{self.config.elastic_timeout:.0f} s (PS_ELASTIC_TIMEOUT_S)", 1)
        if now >= self._short_notice:
            log.warning("%s (%.0f s left)", self._why_short(), self.config.elastic_timeout - waited)
            self._short_notice = now + WAIT_NOTICE_EVERY_S
        return None

    # -- joins -----------------------------------------------------------------------------

    def _refuse_join(self) -> str | None:
        """Why a worker cannot join the running job now, or None."""
        if not self.config.elastic:
            return ("the job has already started (a worker may join a running job only when "
                    "it is elastic: PS_MIN_WORKERS or PS_MAX_WORKERS)")
        if not self._changeable():
            return "the job is finishing: a worker has already finished, so none can join"
        maximum = self.config.bounds[1]  # a worker whose connection closed is on its way out
        live = [n for n in self._ranked() if n.closed_at is None]
        if len(live) + len(self.joining) >= maximum:
            return f"the job already runs {maximum} worker(s) (PS_MAX_WORKERS={maximum})"
        return None

    def _join(self, node: Node) -> None:
        """A registered worker waits to be taken into the running job (:meth:`_take_in`)."""
        self.joining[node.identity] = node
        log.info("worker at %s registered to join the running job", node.address)
        self._take_in()

    def _take_in(self) -> None:
        """Take the waiting joiners in: at once, unless a worker's connection has closed (they
        come in with the re-form of its loss, if it is lost) or the job is short of its
        minimum (they come in once enough have come)."""
        if not self.joining or any(n.closed_at is not None for n in self._ranked()):
            return
        if self.short_since is None or \
                len(self._ranked()) + len(self.joining) >= self.config.bounds[0]:
            self._settle(None)

    # -- the re-form -----------------------------------------------------------------------

    def _reform(self, what: str, paused: bool = False, joined: Sequence[Node] = (),
                lost: bool = True) -> None:
        """A new epoch: the workers renumbered in their order, every node told at once (the
        collectives being agreed are dropped: every worker abandons what it had in flight).
        ``paused``: below the minimum, the workers wait for the next re-form; ``joined``: the
        nodes taken in, which get their address book (the others a reshape); ``lost``: whether
        a node was lost too (else workers only joined: horovod's HostsUpdatedInterrupt)."""
        self.epoch += 1
        for role in ("worker", "server"):
            for rank, node in enumerate(self._ranked(role)):
                node.rank = rank
        self.workers = len(self._ranked())
        self.coordinator = Coordinator(self.workers, self.grace)
        if paused:
            log.warning("%s; %s (epoch %d)", what, self._why_short(), self.epoch)
        else:
            log.warning("%s; going on with %d worker(s) and %d server(s) (epoch %d, "
                        "PS_MIN_WORKERS=%d, PS_MAX_WORKERS=%d)", what, self.workers,
                        len(self._ranked("server")), self.epoch, *self.config.bounds)
        book = self._book()
        note = {"waiting": self._why_short()} if paused else {}
        for node in self.nodes.values():
            if node in joined:
                self._reply(node.identity, Op.ADDRESSBOOK, rank=node.rank, servers=book,
                            num_workers=self.workers, epoch=self.epoch, secret=self.secret)
            else:
                self._reply(node.identity, Op.RESHAPE, epoch=self.epoch, rank=node.rank,
                            num_workers=self.workers, servers=book, what=what,
                            **note, **({} if lost else {"joined": True}))
