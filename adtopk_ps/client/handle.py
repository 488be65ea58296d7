"""The pending result of one push_pull, and what the scheduler agreed for a collective.

The engine (engine.py) completes a handle as the answers arrive; the caller
(ps_client.py) waits on it. A handle reaches its owner only through the
three things :class:`Owner` names, so that neither module imports the other
for it.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Protocol

import torch


class Blocking(Protocol):
    """The engine's side of a wait for the scheduler's agreement."""

    def blocked(self, reqid: int, waiting: bool, withdraw: bool = False) -> None:
        """This worker waits for request ``reqid`` (or no longer does; ``withdraw``: gives it up)."""


class Owner(Protocol):
    """What a handle reads of the client that made it."""

    size: int  # workers: an average divides by it
    timeout: float  # seconds a wait gives an answer by default

    @property
    def engine(self) -> Blocking:
        """The engine thread that completes handles."""


@dataclass(frozen=True)
class Agreement:
    """What the scheduler agreed for a collective: every worker's own part of its request
    (by rank), the joined workers standing in with zeros, and the last worker to ask."""

    own: dict[int, object]
    standins: list[int]
    last: int


class Handle:
    """The pending result of one ``push_pull`` (a :class:`adtopk_ps.torch.pending.Pending`)."""

    def __init__(self, client: Owner, name: str, out: torch.Tensor, parts: int, average: bool,
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
        self.flagged: set[int] = set()
        self.reqid: int | None = None  # a collective's request, until the scheduler answers it
        self.agreement: Agreement | None = None

    @property
    def nonfinite(self) -> bool:
        """Whether some worker's push of this tensor held a NaN or an infinity."""
        return bool(self.flagged)

    def flagging_ranks(self) -> list[int]:
        """The ranks whose push held a NaN or an infinity, ascending."""
        return sorted(self.flagged)

    def begin(self, out: torch.Tensor, parts: int, divisor: int, out_given: bool) -> None:
        """An agreed collective's push starts: its answer goes to ``out`` in ``parts`` keys."""
        self.out, self.parts, self._left = out, parts, parts
        self.divisor, self.out_given = divisor, out_given

    def complete(self, value: object = None) -> None:
        """Complete the handle with ``value`` and no push (a barrier, a join)."""
        self.out = value
        self.completed_at = time.monotonic()
        self._event.set()

    def done(self) -> bool:
        """Whether the answer is complete (or the push failed); never blocks."""
        return self._event.is_set()

    def wait_done(self, timeout: float | None = None) -> bool:
        """Block until :meth:`done` or ``timeout`` passed: whether it is done. Unlike
        :meth:`wait`, neither a failure nor the timeout raises."""
        return self._event.wait(timeout)

    def wait(self, timeout: float | None = None) -> torch.Tensor:
        """The averaged (or summed) result; raises if the job failed or ``timeout`` passed."""
        timeout = self._client.timeout if timeout is None else timeout
        if self.reqid is not None and not self._event.is_set():
            self._wait_agreed(timeout)
        if not self._event.wait(timeout):
            raise TimeoutError(f"push_pull of {self.name!r} not answered within {timeout:.1f} s")
        if self._error is not None:
            raise self._error
        return self.out

    def settle(self, timeout: float | None = None) -> None:
        """Wait as :meth:`wait` does (telling the scheduler while the call is not agreed), but
        raise nothing: whoever holds the handle reads its outcome."""
        try:
            self.wait(timeout)
        except Exception:  # noqa: BLE001 - the outcome is the holder's to read
            pass

    def _wait_agreed(self, timeout: float) -> None:
        """Wait for the scheduler's answer, having told it that this worker waits (so that a
        call no other worker will make is refused rather than waited for). A wait that times
        out gives the call up, on every worker that made it; one interrupted (Ctrl-C) says
        it no longer waits."""
        reqid, engine = self.reqid, self._client.engine
        if reqid is None:
            return
        engine.blocked(reqid, True)
        try:
            finished = self._event.wait(timeout)
        except BaseException:  # interrupted (Ctrl-C): the call stays, this worker no longer waits
            if self.reqid is not None:
                engine.blocked(reqid, False)
            raise
        if not finished and self.reqid is not None:
            engine.blocked(reqid, False, withdraw=True)
            error = TimeoutError(f"{self.name!r} not agreed by every worker within "
                                 f"{timeout:.1f} s; given up on every worker that made it")
            self.fail(error)
            raise error

    def part_done(self) -> None:
        """One partition's answer is in ``out`` (the engine calls this): the last completes
        the handle."""
        self._left -= 1
        if self._left == 0:
            self.completed_at = time.monotonic()
            self._event.set()

    def fail(self, error: BaseException) -> None:
        """Complete the handle with ``error``, which :meth:`wait` raises (the engine calls
        this); a handle already complete keeps its outcome."""
        if not self._event.is_set():
            self._error = error
            self._event.set()


