"""What one worker has moved to and from each server, and how wide the servers' answers to its
sparse pushes were.

A server's answer to a sparse push carries the union of every worker's selection, so its
width, not the push's, decides what every worker pulls as the job grows; and a server's
load is what all the workers push to it and pull from it. Both are measured here, at the
worker, from the frames it sends and receives: the scale study's model is built on them
(``benchmarks/scale.py``), and a user can watch them grow on a live job.

Example::

    before = bps.client().ledger.snapshot()
    ...  # some steps
    moved = bps.client().ledger.snapshot().since(before)
    moved.pushed          # {server: bytes this worker pushed to it}
    moved.answer_density  # the answers' share of their tensors' elements
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Tally:
    """A snapshot of a :class:`Ledger`, or the difference of two."""

    pushed: dict[int, int] = field(default_factory=dict)  # server -> bytes of pushes sent
    pulled: dict[int, int] = field(default_factory=dict)  # server -> bytes of answers received
    # (answers only: a server's receipts and stall notices are not counted)
    answer_elements: int = 0  # values carried by the answers to sparse pushes (dense: all)
    answer_numel: int = 0  # elements of the tensors those answers stand for

    @property
    def answer_density(self) -> float | None:
        """The answers' width over their tensors' size (None before any sparse answer)."""
        return self.answer_elements / self.answer_numel if self.answer_numel else None

    def since(self, earlier: "Tally") -> "Tally":
        """What moved between ``earlier`` and this one."""
        def minus(now: dict[int, int], then: dict[int, int]) -> dict[int, int]:
            return {s: now[s] - then.get(s, 0) for s in now}
        return Tally(minus(self.pushed, earlier.pushed), minus(self.pulled, earlier.pulled),
                     self.answer_elements - earlier.answer_elements,
                     self.answer_numel - earlier.answer_numel)

    def as_dict(self) -> dict:
        """Plain data (server ranks as strings, as JSON has them)."""
        return {"pushed": {str(s): n for s, n in sorted(self.pushed.items())},
                "pulled": {str(s): n for s, n in sorted(self.pulled.items())},
                "answer_elements": self.answer_elements, "answer_numel": self.answer_numel}


class Ledger:
    """Counts kept by the engine's thread; :meth:`snapshot` may be taken from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pushed: dict[int, int] = {}
        self._pulled: dict[int, int] = {}
        self._answer_elements = self._answer_numel = 0

    def add_push(self, server: int, size: int) -> None:
        with self._lock:
            self._pushed[server] = self._pushed.get(server, 0) + size

    def add_answer_bytes(self, server: int, size: int) -> None:
        with self._lock:
            self._pulled[server] = self._pulled.get(server, 0) + size

    def add_width(self, carried: int, numel: int) -> None:
        """An answer to a sparse push: ``carried`` values (a dense answer carries them all)
        of a tensor of ``numel`` elements."""
        with self._lock:
            self._answer_elements += carried
            self._answer_numel += numel

    @property
    def bytes_pushed(self) -> int:
        with self._lock:
            return sum(self._pushed.values())

    @property
    def bytes_pulled(self) -> int:
        with self._lock:
            return sum(self._pulled.values())

    def snapshot(self) -> Tally:
        with self._lock:
            return Tally(dict(self._pushed), dict(self._pulled), self._answer_elements,
                         self._answer_numel)
