"""Elastic jobs measured: seconds from a worker's SIGKILL to the survivors' next step, and the
accuracy a job reaches when it loses a worker against the same job undisturbed.

Every job is tests/programs/elastic_train.py (a horovod elastic script, the import changed)
under ``bpslaunch --local --min-workers 2``: 5 workers and 2 servers losing three of them at
random ranks and steps, before a push or between the pushes and their answers, for the
timings; 3 workers trained for ``--steps`` with and without one kill, per seed, for the
accuracies (on every digit of scikit-learn's set: a figure to compare runs, not a test score).

    python benchmarks/elastic.py                      # 7 jobs: 21 kills; 3 seeds
    python benchmarks/elastic.py --jobs 3 --seeds 0 1
"""
from __future__ import annotations

import argparse
import os
import random
import re
import statistics
import subprocess
import sys
from pathlib import Path

from adtopk_ps.testing.stats import kill_to_next_step

ROOT = Path(__file__).resolve().parents[1]
PROGRAM = ROOT / "tests" / "programs" / "elastic_train.py"
FAST = {"PS_HEARTBEAT_INTERVAL_MS": "200", "PS_HEARTBEAT_TIMEOUT_MS": "2000"}


def job(workers: int, args: list[str], steps: int) -> str:
    """One job's output; raises where it did not finish."""
    cmd = [sys.executable, "-m", "adtopk_ps.launcher", "--local", "--num-workers", str(workers),
           "--num-servers", "2", "--min-workers", "2", "--timeout", "300", "--",
           sys.executable, str(PROGRAM), "--steps", str(steps), *args]
    out = subprocess.run(cmd, env={**os.environ, **FAST}, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, timeout=360).stdout
    if "done step" not in out:
        raise RuntimeError(f"{' '.join(args)}: the job did not finish:\n{out[-3000:]}")
    return out


def accuracy(out: str) -> float:
    found = {float(a) for a in re.findall(r"accuracy=([\d.]+)", out)}
    assert len(found) == 1, found  # the replicas agree
    return found.pop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=7, help="5-worker jobs, three kills each")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=150, help="steps of each accuracy run")
    args = ap.parse_args()
    rng = random.Random(0)
    measured = []
    for i in range(args.jobs):
        victims = rng.sample(range(5), 3)
        at = sorted(rng.sample(range(1, 14), 3))
        when = ["before-push", "mid-push"][i % 2]
        out = job(5, ["--when", when, *(f"--kill={v}:{s}" for v, s in zip(victims, at))], 16)
        measured += kill_to_next_step(out)
        print(f"job {i + 1}: {when}, kills {list(zip(victims, at))}: "
              f"{', '.join(f'{g:.2f}' for g in kill_to_next_step(out))} s", flush=True)
    print(f"\nkill to next step over {len(measured)} kills: median {statistics.median(measured):.2f} s, "
          f"min {min(measured):.2f}, max {max(measured):.2f}\n")
    print("| seed | undisturbed (3 workers) | one worker killed at step 40 |")
    print("|---|---|---|")
    for seed in args.seeds:
        whole = accuracy(job(3, ["--seed", str(seed)], args.steps))
        lost = accuracy(job(3, ["--seed", str(seed), "--kill=2:40"], args.steps))
        print(f"| {seed} | {whole:.4f} | {lost:.4f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
