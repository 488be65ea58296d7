"""Choosing by timing real steps: overlap or not (``overlap="auto"``), and with the cost
model, its routes or every tensor dense.

Overlap pays where a core is free for the engine thread. Where every core is
busy (more processes than cores, servers on the workers' hosts) the engine's
compression takes the CPU the backward pass needs, and either way can be the
faster (docs/benchmark-e2e.md, "Overlap").

The cost model prices each tensor from link and compression speeds timed
with nothing else running. Where the step is CPU-bound, the sparse route's
CPU (compression, the servers' aggregation) comes out of the backward pass
while a dense all-reduce's link time does not, which the model cannot see.
So its plan is timed against sending every tensor dense.

Which holds depends on the job's hosts, so it is measured in the job: after
a few steps to settle in, steps take the modes in turn, so that a shared
machine's drift slows all alike, and the mode with the lowest median step
time stays; every worker's medians are averaged first, as every worker must
route alike.
"""
from __future__ import annotations

import logging
import statistics
import time
from typing import Callable, Hashable, Sequence

from adtopk_ps.core.env import env_int

log = logging.getLogger("adtopk_ps.trial")
WARMUP = 2  # timed steps left out before the modes take turns (the first step is never timed)


def trial_steps() -> int:
    """``PS_OVERLAP_TRIAL_STEPS``: steps timed in each mode before choosing (default 8)."""
    return env_int("PS_OVERLAP_TRIAL_STEPS", 8, minimum=1)


class Trial:
    """Times whole steps (one ``step()`` to the next) in each of ``modes`` and picks one.

    ``agree`` turns this worker's medians into the ones every worker decides
    from (default: its own). ``block``: each turn runs a mode that many steps in a row
    and times all but the first (where a step's communication lands in the next step, as
    crossing the barrier's does, the first step of a turn still pays for the mode before)."""

    def __init__(self, modes: Sequence[Hashable], steps: int | None = None, warmup: int = WARMUP,
                 clock: Callable[[], float] = time.perf_counter,
                 agree: Callable[[list[float]], list[float]] = lambda medians: medians,
                 describe: Callable[[Hashable], str] = str, block: int = 1):
        self.modes = list(modes)
        self.steps = trial_steps() if steps is None else steps
        self.warmup, self.clock, self.agree, self.describe = warmup, clock, agree, describe
        self.block = block
        self.times: dict[Hashable, list[float]] = {mode: [] for mode in self.modes}
        self.choice: Hashable | None = None
        self.medians: list[float] = []  # what every worker decided from, in mode order
        self._turn = 0
        self._at = 0  # the coming step's place in its turn
        self._ended = 0  # steps whose duration is known
        self._last: float | None = None

    @property
    def length(self) -> int:
        """Steps the trial runs before every later one goes the chosen way."""
        timed = max(1, self.block - 1)  # per turn
        return self.warmup + 1 + len(self.modes) * -(-self.steps // timed) * self.block

    @property
    def mode(self) -> Hashable:
        """The mode of the coming step."""
        return self.modes[self._turn] if self.choice is None else self.choice

    def next_mode(self) -> Hashable:
        """Call at the end of every step; the mode for the next one."""
        if self.choice is not None:
            return self.choice
        now = self.clock()
        if self._last is not None:
            self._ended += 1
            if self._ended > self.warmup and self._at >= min(1, self.block - 1):
                self.times[self.mode].append(now - self._last)
        self._last = now
        if min(len(t) for t in self.times.values()) >= self.steps:
            self.medians = self.agree([statistics.median(self.times[m]) for m in self.modes])
            self.choice = self.modes[self.medians.index(min(self.medians))]
            log.info("step trial (medians of %d steps): %s; keeping %s", self.steps,
                     ", ".join(f"{self.describe(m)} {1000 * t:.1f} ms"
                               for m, t in zip(self.modes, self.medians)),
                     self.describe(self.choice))
            return self.choice
        if self._ended == self.warmup:  # the turns begin, with the next mode
            self._turn, self._at = (self._turn + 1) % len(self.modes), 0
        elif self._ended > self.warmup:
            self._at += 1
            if self._at == self.block:
                self._turn, self._at = (self._turn + 1) % len(self.modes), 0
        return self.mode
