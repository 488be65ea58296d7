"""Ratios of paired rounds and how far they could move with other rounds of the same noise;
the time an elastic job took to go on after each kill.

A paired round is (our step, the reference's step) timed back to back in the same
processes (``benchmarks/e2e.py --paired``); the speed-up is the reference's mean over ours.
"""
from __future__ import annotations

import random
import re
import statistics


def speed_of(pairs: list) -> float:
    """The reference's mean step over ours: above 1, ours is faster."""
    return statistics.mean(d for _, d in pairs) / statistics.mean(p for p, _ in pairs)


def interval(pairs: list, against: list | None = None, draws: int = 2000,
             seed: int = 0) -> tuple[float, float]:
    """The 5th and 95th percentiles of ``speed_of(pairs)`` (over ``speed_of(against)``, given
    another system's rounds) with rounds resampled with replacement: how far the pooled ratio
    could move with other rounds of the same noise."""
    rng = random.Random(seed)

    def draw(rounds: list) -> float:
        return speed_of(rng.choices(rounds, k=len(rounds)))
    speeds = sorted(draw(pairs) / (draw(against) if against else 1.0) for _ in range(draws))
    return speeds[draws // 20], speeds[draws - 1 - draws // 20]


def kill_to_next_step(out: str) -> list[float]:
    """Seconds from each kill to the first step after it that a survivor finished, from an
    elastic job's output (tests/programs/elastic_train.py prints ``killed after step S at
    T`` and ``step N of W at T``, wall-clock seconds): only a step the victim did not take
    part in counts, since some survivors may still be finishing the one before.

    Example::

        kill_to_next_step("w2: killed after step 5 at 10.0\nw0: step 6 of 2 at 11.2")  # [1.2]
    """
    steps = [(int(n), float(t)) for n, t in re.findall(r"step (\d+) of \d+ at ([\d.]+)", out)]
    kills = sorted((int(d), float(t)) for d, t in re.findall(r"killed after step (\d+) at ([\d.]+)", out))
    return [min(t for n, t in steps if n > done and t > kill) - kill for done, kill in kills]
