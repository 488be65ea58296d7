"""Ratios of paired rounds, and how far they could move with other rounds of the same noise.

A paired round is (our step, the reference's step) timed back to back in the same
processes (``benchmarks/e2e.py --paired``); the speed-up is the reference's mean over ours.
"""
from __future__ import annotations

import random
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
