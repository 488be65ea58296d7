"""``overlap="auto"``: try pushing during backward and after it, keep the faster.

Overlap pays where a core is free for the engine thread (e2e benchmark, VGG,
one worker on two cores: 179 ms a step with overlap, 222 without). Where
every core is busy (more processes than cores, servers on the workers' hosts)
the engine's compression takes the CPU the backward pass needs, and the two
ways measured within 1-8% of each other, either one faster (two workers on two
cores: VGG 264 against 273 ms, ResNet-18 475 against 459). Which holds depends
on the job's hosts, so it is measured
in the job: after a few steps to settle in, steps alternate between the two,
so that a shared machine's drift slows both alike, and the one with the
lower median step time stays.
"""
from __future__ import annotations

import logging
import statistics
import time
from typing import Callable

from ..env import env_int

log = logging.getLogger("adtopk_ps.overlap")
WARMUP = 2  # timed steps left out before alternating (the first step is never timed)


def trial_steps() -> int:
    """``PS_OVERLAP_TRIAL_STEPS``: steps timed in each mode before choosing (default 8)."""
    return env_int("PS_OVERLAP_TRIAL_STEPS", 8, minimum=1)


def steps_to_choose(steps: int | None = None, warmup: int = WARMUP) -> int:
    """Steps a trial runs before every later one goes the chosen way."""
    return warmup + 1 + 2 * (trial_steps() if steps is None else steps)


class OverlapTrial:
    """Times whole steps (one ``step()`` to the next) in each mode and picks one."""

    def __init__(self, steps: int | None = None, warmup: int = WARMUP,
                 clock: Callable[[], float] = time.perf_counter):
        self.steps = trial_steps() if steps is None else steps
        self.warmup, self.clock = warmup, clock
        self.times: dict[bool, list[float]] = {True: [], False: []}
        self.choice: bool | None = None
        self._mode = True
        self._ended = 0  # steps whose duration is known
        self._last: float | None = None

    def next_mode(self) -> bool:
        """Call at the end of every step; the mode for the next one."""
        if self.choice is not None:
            return self.choice
        now = self.clock()
        if self._last is not None:
            self._ended += 1
            if self._ended > self.warmup:
                self.times[self._mode].append(now - self._last)
        self._last = now
        if min(len(t) for t in self.times.values()) >= self.steps:
            with_, without = (statistics.median(self.times[m]) for m in (True, False))
            self.choice = with_ <= without
            log.info("overlap=auto: %.1f ms a step with overlap, %.1f ms without (medians of %d); "
                     "pushing %s", 1000 * with_, 1000 * without, self.steps,
                     "during backward" if self.choice else "after backward")
            return self.choice
        if self._ended >= self.warmup:
            self._mode = not self._mode
        return self._mode
