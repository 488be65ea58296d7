"""The scheduler's collective coordinator: every collective is agreed by name before any data moves.

horovod's coordinator, for a parameter server. A worker that starts a
collective (an allreduce, a broadcast, an allgather, a barrier, a join)
first sends the scheduler a request naming it, with what must match across
the workers (``match``: kind, dtype, shape, root, op, ...) and what is its
own (``own``: its first dimension, its object's length). Once every worker
that must take part has asked for that name, the coordinator compares the
``match`` of each and answers all of them at once: agreed (with every
worker's ``own``), or refused, naming the name and each worker's side. No
worker is left waiting for a partner that sent something else, and since a
refused call never reaches the servers, no later key is shifted.

A worker whose own side of a call failed (an object that does not pickle, a
root rank out of range) still asks, with ``failed``: the others get its
reason with the same refusal, when the last of them asks.

Three ways a name can be waited for that will never come, each answered at
once rather than left to a timeout:

- a worker finished (its process ended) without asking: refused, naming it
  (a barrier instead goes on without it, as byteps' does);
- every worker that must take part is blocked waiting for a call that some
  other one has not made (each says so when its wait begins): the calls they
  wait in are refused, each naming who waits where;
- a worker has joined (horovod's ``join``): a sum goes on with that worker
  standing in with zeros (it is told to push them, as the ``own`` part of the
  sum's first request describes); any other kind is refused (and the joined
  worker told, with nothing to push, so that its unnamed calls count it too).

Names are bounded (:func:`check_name`: valid UTF-8, a length limit), and no message
grows with the number of workers times a name: an agreement lists each distinct ``own``
once (a sum's, which holds its key's name, is alike on every worker), and a refusal
groups the workers by the call they wait in or the reason they failed with, naming a
few and counting the rest. Every message stays well under the wire's header limit.

The coordinator is plain state: it returns the messages to send, and the
scheduler sends them.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

JOIN = ".join"  # the name join() negotiates
MAX_PENDING = 1 << 16  # names waiting at once; beyond, a new one is refused to its asker
#: the longest name a caller may give a collective (allreduce's ``name=``, broadcast_parameters'
#: prefix and parameter names), in UTF-8 bytes
MAX_NAME_BYTES = 1024
#: the longest name a call is agreed under: room for what the library adds to a caller's
#: (the kind, a prefix, ``.grad`` for a gradient's call); a name travels at most a few times
#: in one message, which then stays well under the wire's 64 KiB header limit
MAX_AGREED_NAME_BYTES = 4 * MAX_NAME_BYTES
SHOWN = 3  # calls waited in, or failure reasons, that one refusal names; the rest are counted
MAX_REASON_CHARS = 1024  # of one worker's failure reason, as a refusal quotes it


def _shown(name: str, chars: int = 60) -> str:
    """``name`` quoted, cut to ``chars`` characters: how messages name a name that may be long."""
    return repr(name) if len(name) <= chars else f"{name[:chars]!r}..."


def check_name(name: object, limit: int = MAX_NAME_BYTES) -> str:
    """``name`` if it can name a collective: a non-empty string, valid UTF-8 (msgpack's
    strings are) of at most ``limit`` bytes. Otherwise ``ValueError``, naming the limit: a
    name travels in the scheduler's messages, and one that cannot be encoded, or that would
    take a message past the header limit, would end the job (or the engine thread) for
    every worker; refused where it is made, before anything is sent, it fails only its call.

    Example::

        check_name("allreduce.loss")   # returns it
        check_name("x" * 30000)        # ValueError: ... of 30000 bytes exceeds the limit of 1024 bytes
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"a collective name must be a non-empty string, got {repr(name)[:80]}")
    try:
        size = len(name.encode())
    except UnicodeEncodeError as exc:
        raise ValueError(f"collective name {_shown(name)} is not valid UTF-8 (lone surrogate "
                         f"{name[exc.start]!r} at position {exc.start})") from None
    if size > limit:
        raise ValueError(f"collective name {_shown(name)} of {size} bytes exceeds the limit of "
                         f"{limit} bytes (UTF-8); give it a shorter name")
    return name


@dataclass(frozen=True)
class Outgoing:
    """One message for a worker: ``op`` is "agreed" or "standin"."""

    rank: int
    op: str
    fields: dict


@dataclass
class Request:
    """One worker's request for a name."""

    reqid: int
    match: dict
    own: object = None
    failed: str | None = None


@dataclass
class Item:
    """A name being negotiated: who asked, with what, and how absent workers are treated."""

    name: str
    standin: bool  # a joined worker takes part by pushing zeros (a sum)
    release: bool  # a finished worker is not waited for (a barrier); otherwise the call fails
    requests: dict[int, Request] = field(default_factory=dict)
    order: list[int] = field(default_factory=list)  # ranks in the order they asked
    since: float = 0.0  # when its first request came


def _workers(ranks: list[int]) -> str:
    """``worker 1``, ``workers 0 and 2``, ``workers 0-5, 7 and 9``: ``ranks`` (sorted) with
    runs of three or more as ranges, so that naming many workers stays short."""
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    if len(ranks) == 1:
        return f"worker {ranks[0]}"
    parts = [f"{a}-{b}" if b > a + 1 else (f"{a}, {b}" if b == a + 1 else str(a)) for a, b in runs]
    head, _, tail = ", ".join(parts).rpartition(", ")
    return f"workers {head} and {tail}" if head else f"workers {tail}"


def _few(lines: list[str], sep: str, rest: str) -> str:
    """The first :data:`SHOWN` of ``lines``, and how many ``rest`` there are beyond them."""
    more = len(lines) - SHOWN
    return sep.join(lines[:SHOWN]) + (f"{sep}and {more} {rest}" if more > 0 else "")


def _cut(text: str, chars: int) -> str:
    """``text`` cut to ``chars`` characters: a worker's reason may be any length."""
    return text if len(text) <= chars else f"{text[:chars]}..."


def describe(value: object) -> str:
    """A field's value as messages show it: lists as tuples (shapes read as shapes)."""
    if isinstance(value, list):
        return "(" + ", ".join(describe(v) for v in value) + ("," if len(value) == 1 else "") + ")"
    return str(value)


class Coordinator:
    """Pending collectives of one job, by name, for ``num_workers`` worker ranks.

    ``grace``: how long every worker must have waited, with nothing answerable and no new
    request, before the calls they wait in are refused (a worker's other threads may still
    be about to ask); ``clock`` gives the time.
    """

    def __init__(self, num_workers: int, grace: float = 0.0,
                 clock: Callable[[], float] = time.monotonic):
        self.active: set[int] = set(range(num_workers))  # ranks that have not finished
        self.finished_ranks: set[int] = set()
        self.items: dict[str, Item] = {}
        self.blocked: dict[int, set[str]] = {}  # rank -> the names it waits in
        # rank -> names refused when every worker waited, which it had not asked for: its
        # next request of one is refused at once, so that workers one call apart line up
        self.tombstones: dict[int, set[str]] = {}
        self.grace, self.clock = grace, clock
        self.stuck_since: float | None = None  # when every worker began to wait in vain
        self.agreed = 0  # names agreed so far
        self.refused = 0  # names refused so far

    def request(self, rank: int, reqid: int, name: str, match: dict, own: object = None,
                failed: str | None = None, standin: bool = False,
                release: bool = False) -> list[Outgoing]:
        """Worker ``rank`` asks for ``name``. A second request for a name it already has in
        flight is refused at once (to that worker only: the first stays pending), and so is
        a name that :func:`check_name` refuses (every worker's client refuses one first)."""
        try:
            check_name(name, MAX_AGREED_NAME_BYTES)
        except ValueError as exc:
            return [Outgoing(rank, "agreed", {"reqid": reqid, "name": _shown(name), "ok": False,
                                              "message": str(exc)})]
        item = self.items.get(name)
        if item is not None and rank in item.requests:
            return [self._refusal(rank, reqid, name, f"{_shown(name)} is already in flight on "
                                  f"worker {rank}; a name can be used again once its call is done")]
        if name in self.tombstones.get(rank, ()):
            self.tombstones[rank].discard(name)
            return [self._refusal(rank, reqid, name, "the other workers' call of it was refused "
                                  "earlier, when every worker waited in a call another had not "
                                  "made; this worker's calls now line up with theirs again")]
        if item is None and len(self.items) >= MAX_PENDING:
            return [self._refusal(rank, reqid, name, f"{len(self.items)} collectives are "
                                  f"already waiting for their workers; call synchronize() on "
                                  f"some before starting more")]
        if item is None:
            item = self.items[name] = Item(name, standin, release, since=self.clock())
        item.requests[rank] = Request(reqid, match, own, failed)
        item.order.append(rank)
        if name == JOIN:
            self.blocked.setdefault(rank, set()).add(JOIN)
        self.stuck_since = None  # something new happened: wait the grace again
        return self._settle()

    def block(self, rank: int, reqid: int) -> list[Outgoing]:
        """Worker ``rank`` now waits for its request ``reqid`` (ignored if already answered)."""
        item = self._item_of(rank, reqid)
        if item is None:
            return []
        self.blocked.setdefault(rank, set()).add(item.name)
        return self._settle()

    def unblock(self, rank: int, reqid: int) -> None:
        """Worker ``rank`` stopped waiting for ``reqid`` (an interrupted wait)."""
        item = self._item_of(rank, reqid)
        if item is not None:
            self.blocked.get(rank, set()).discard(item.name)

    def withdraw(self, rank: int, reqid: int) -> list[Outgoing]:
        """Worker ``rank`` gave up on ``reqid`` (its wait timed out): the call is refused on
        every worker that asked, so that none goes on with a sum this worker abandoned."""
        item = self._item_of(rank, reqid)
        if item is None:
            return []
        return self._close(item, f"worker {rank} stopped waiting for it (its timeout)", [])

    def finished(self, rank: int) -> list[Outgoing]:
        """Worker ``rank`` is done: it will ask for nothing more."""
        self.active.discard(rank)
        self.finished_ranks.add(rank)
        self.blocked.pop(rank, None)
        self.tombstones.pop(rank, None)
        return self._settle()

    def tick(self) -> list[Outgoing]:
        """Refuse what every worker has waited in for ``grace`` (the scheduler calls this)."""
        return self._settle()

    def stalls(self) -> list[tuple[str, list[int], float]]:
        """The calls some workers wait in while others, waiting in nothing, have not made
        them (a loop or data loader that hangs, a joiner slow to start): each name (quoted,
        cut short), the ranks it waits for, and the seconds since its first request. (Where every worker waits,
        the deadlock's refusal comes first.)"""
        now, out = self.clock(), []
        for item in self.items.values():
            if not any(item.name in self.blocked.get(r, ()) for r in item.requests):
                continue
            missing = sorted(r for r in self.active - set(item.requests) if not self.blocked.get(r))
            if missing:
                out.append((_shown(item.name), missing, now - item.since))
        return out

    def _item_of(self, rank: int, reqid: int) -> Item | None:
        for item in self.items.values():
            req = item.requests.get(rank)
            if req is not None and req.reqid == reqid:
                return item
        return None

    # ------------------------------------------------------------------ settling

    def _joined(self) -> set[int]:
        item = self.items.get(JOIN)
        return set(item.requests) & self.active if item is not None else set()

    def _settle(self) -> list[Outgoing]:
        """Answer every name that can be answered now; then, if every active worker has waited
        ``grace`` and nothing can move, refuse the names they wait in."""
        out: list[Outgoing] = []
        progress = True
        while progress:
            progress = False
            for item in list(self.items.values()):
                verdict = self._verdict(item)
                if verdict is not None:
                    out += self._close(item, *verdict)
                    progress = True
        if out or not self.active or not all(self.blocked.get(r) for r in self.active):
            self.stuck_since = None
            return out
        now = self.clock()
        if self.stuck_since is None:
            self.stuck_since = now
        if now - self.stuck_since >= self.grace:
            self.stuck_since = None
            out += self._break_deadlock()
        return out

    def _verdict(self, item: Item) -> tuple[str | None, list[int]] | None:
        """None while ``item`` must wait; else (refusal or None for agreed, stand-in ranks)."""
        if item.name == JOIN:
            return (None, []) if self.active <= set(item.requests) else None
        asked = set(item.requests)
        gone = self.finished_ranks - asked
        if gone and not item.release:
            return f"worker(s) {sorted(gone)} finished without calling it", []
        joined = self._joined() - asked
        if joined and not item.standin:  # the joined are told too: their unnamed calls count it
            return (f"worker(s) {sorted(joined)} called join(); only a sum (allreduce, "
                    f"push_pull) goes on with joined workers standing in"), sorted(joined)
        if not (self.active - joined) <= asked:
            return None
        reasons: dict[str, list[int]] = {}  # each reason once, with the workers that gave it
        for r, req in sorted(item.requests.items()):
            if req.failed is not None:
                reasons.setdefault(_cut(req.failed, MAX_REASON_CHARS), []).append(r)
        if reasons:
            return _few([f"{_workers(ranks)}: {why}" for why, ranks in reasons.items()], "; ",
                        "other reasons"), []
        return self._mismatch(item), sorted(joined)

    def _mismatch(self, item: Item) -> str | None:
        """Every field on which the requests differ, with each worker's value; None if none."""
        ranks = sorted(item.requests)
        keys = sorted({k for r in ranks for k in item.requests[r].match})
        differ = [k for k in keys if len({describe(item.requests[r].match.get(k)) for r in ranks}) > 1]
        if not differ:
            return None
        sides = "; ".join(
            f"{k}: " + ", ".join(f"worker {r} {describe(item.requests[r].match.get(k, '(none)'))}"
                                  for r in ranks) for k in differ)
        return f"the workers' calls differ ({sides})"

    def _close(self, item: Item, refusal: str | None, standins: list[int]) -> list[Outgoing]:
        del self.items[item.name]
        for rank in item.requests:
            self.blocked.get(rank, set()).discard(item.name)
        if refusal is not None:
            self.refused += 1
            return [self._refusal(r, req.reqid, item.name, refusal)
                    for r, req in item.requests.items()] + \
                [Outgoing(r, "standin", {"name": item.name, "push": None}) for r in standins]
        self.agreed += 1
        for rank in item.requests:  # these workers' calls line up again
            self.tombstones.pop(rank, None)
        owns: list = []  # each distinct own part once; ``own``: each rank's, by its index
        at: dict[str, int] = {}
        own = {}
        for r, req in item.requests.items():
            index = own[str(r)] = at.setdefault(repr(req.own), len(owns))
            if index == len(owns):
                owns.append(req.own)
        last = item.order[-1] if item.order else -1
        out = [Outgoing(r, "agreed", {"reqid": req.reqid, "name": item.name, "ok": True,
                                      "own": own, "owns": owns, "standins": standins,
                                      "last": last})
               for r, req in item.requests.items()]
        push = next(iter(item.requests.values())).own  # a sum's own part: what it pushes
        out += [Outgoing(r, "standin", {"name": item.name, "push": push}) for r in standins]
        return out

    def _refusal(self, rank: int, reqid: int, name: str, why: str) -> Outgoing:
        return Outgoing(rank, "agreed", {"reqid": reqid, "name": name, "ok": False,
                                         "message": f"{name}: {why}"})

    def _break_deadlock(self) -> list[Outgoing]:
        """Every active worker waits, and no name can be answered: each name waited in lacks a
        worker that waits elsewhere. Those names are refused, each saying who waits where; a
        worker that had not asked for one is refused its next request of it at once (it is
        one call behind the others: the refusal lines it up with them). The message groups
        the workers by the call they wait in and names a few calls, so that it does not grow
        with the workers times the names' length."""
        waiting: dict[str, list[int]] = {}  # name -> the ranks waiting in it
        for r in sorted(self.active):
            for name in sorted(self.blocked[r]):
                waiting.setdefault(name, []).append(r)
        where = _few([f"{_workers(ranks)} {'waits' if len(ranks) == 1 else 'wait'} in "
                      f"{_shown(name)}" for name, ranks in waiting.items()], ", ", "other calls")
        out: list[Outgoing] = []
        for name in waiting:
            item = self.items.get(name)
            if item is None or name == JOIN:
                continue
            missing = sorted(self.active - set(item.requests))
            for rank in missing:
                self.tombstones.setdefault(rank, set()).add(name)
            out += self._close(item, f"it can never complete: worker(s) {missing} have not called "
                                     f"it and wait elsewhere ({where})", [])
        return out
