"""Rounds that wait too long for some workers: named, and then the job ended.

A worker whose training loop hangs (a stuck data loader, a call the others
never make) keeps its process and heartbeats alive, so no liveness check
sees it; the others would wait for their push_pull timeout and then name a
tensor, not the worker. The server sees it first: a round that some workers
pushed and others did not. After ``PS_STALL_WARN_S`` (default 60 s, as
horovod's stall check) every waiting worker and the scheduler are told which
workers have not pushed which keys; after ``PS_STALL_ABORT_S`` (default 300 s;
0: never) the scheduler ends the job naming them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from adtopk_ps.cluster.liveness import stall_limits


@dataclass
class Stall:
    """Keys whose rounds wait for the same workers, and for how long the oldest has waited."""

    missing: tuple[int, ...]
    keys: list[int]
    seconds: float


@dataclass
class StallWatch:
    """When each key's round in progress began, and which stalls were told already."""

    warn_s: float
    abort_s: float
    began: dict[int, float] = field(default_factory=dict)  # key -> its round's first push
    warned: set[int] = field(default_factory=set)

    @classmethod
    def from_env(cls) -> "StallWatch":
        """The thresholds from ``PS_STALL_WARN_S`` and ``PS_STALL_ABORT_S``."""
        return cls(*stall_limits())

    def start(self, key: int, now: float) -> None:
        """A round of ``key`` got its first push."""
        self.began.setdefault(key, now)

    def end(self, key: int) -> None:
        """The round of ``key`` was answered (or can never complete)."""
        self.began.pop(key, None)
        self.warned.discard(key)

    def check(self, now: float, missing_of) -> tuple[list[Stall], list[Stall]]:
        """(stalls to warn of now, stalls past the abort threshold); ``missing_of(key)`` gives
        the workers a key's round waits for."""
        warn: dict[tuple[int, ...], Stall] = {}
        abort: dict[tuple[int, ...], Stall] = {}
        for key, since in self.began.items():
            waited = now - since
            if waited < self.warn_s:
                continue
            missing = tuple(missing_of(key))
            if self.abort_s and waited >= self.abort_s:
                _add(abort, missing, key, waited)
            elif key not in self.warned:
                self.warned.add(key)
                _add(warn, missing, key, waited)
        return list(warn.values()), list(abort.values())


def _add(into: dict[tuple[int, ...], Stall], missing: tuple[int, ...], key: int,
         waited: float) -> None:
    stall = into.setdefault(missing, Stall(missing, [], 0.0))
    stall.keys.append(key)
    stall.seconds = max(stall.seconds, waited)
