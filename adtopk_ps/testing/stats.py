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
    """Seconds from each kill to the first step the job finished after it re-formed, from an
    elastic job's output (tests/programs/elastic_train.py prints ``killed after step S at T``
    for a worker it kills, the tests and benchmarks the same for a server, and a survivor
    ``resumed in D s at T`` with its first step after a re-form, D after the last one;
    and ``step N of W at T`` after every step; wall-clock seconds). Only a re-form after the
    kill counts: a step that merely ended after it may have had its answers before, and a
    resumption may follow an earlier re-form. A kill before training (in the start-up
    agreement, re-formed before any step) counts to the first step.

    Example::

        kill_to_next_step("w2: killed after step 5 at 10.0\nw0: resumed in 0.1 s at 11.2")  # [1.2]
    """
    resumed = [(float(t) - float(d), float(t))
               for d, t in re.findall(r"resumed in ([\d.]+) s at ([\d.]+)", out)]
    steps = [float(t) for t in re.findall(r"step \d+ of \d+ at ([\d.]+)", out)]
    kills = sorted(float(t) for t in re.findall(r"killed after step \d+ at ([\d.]+)", out))
    gaps = []
    for kill in kills:
        after = [t for reformed, t in resumed if reformed > kill] or [t for t in steps if t > kill]
        gaps.append(min(after) - kill)
    return gaps


def join_to_first_step(out: str) -> list[float]:
    """Seconds from each joiner's registration to its first step, from ``bpslaunch --local``'s
    output of an elastic job (tests/programs/elastic_train.py prints ``joined the running job
    ..., registering at T`` and then ``step N of W at T``, each line behind its launcher label).

    Example::

        join_to_first_step("[worker 1] w2: joined the running job (epoch 2), registering at "
                           "10.0\n[worker 1] w2: step 8 of 3 at 11.5")  # [1.5]
    """
    lines, gaps = out.splitlines(), []
    for at, line in enumerate(lines):
        joined = re.match(r"(\[worker \d+\]) .*joined the running job.*registering at ([\d.]+)", line)
        if joined:
            steps = (re.search(r"step \d+ of \d+ at ([\d.]+)", later) for later in lines[at + 1:]
                     if later.startswith(joined[1]))
            gaps.append(float(next(s for s in steps if s)[1]) - float(joined[2]))
    return gaps

