"""Elastic jobs measured: seconds from a worker's or a server's SIGKILL to the next step, from
a joiner's registration to its first step, and the accuracy a job reaches when it loses a
worker and a server and takes in a new worker, against the same job undisturbed.

Every job is tests/programs/elastic_train.py (a horovod elastic script, the import changed)
under ``bpslaunch --local --min-workers 2`` with 2 servers:
- kills: 5 workers losing three of them at random ranks and steps, before a push or between
  the pushes and their answers;
- joins: 3 workers, one killed at step 5 and started again (``--restarts 1``): it joins;
- server kills: 3 workers, a random server killed at step 6;
- accuracy, per seed: 3 workers for ``--steps``, undisturbed, and losing worker 2 at step 40
  and server 1 at step 80 while worker 2's restart joins (on every digit of scikit-learn's
  set: a figure to compare runs, not a test score).

    python benchmarks/elastic.py                      # 21 kills, 20 joins, 20 server kills; 3 seeds
    python benchmarks/elastic.py --jobs 3 --joins 2 --server-kills 2 --seeds 0 1
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
from typing import Callable

from adtopk_ps.testing.roles import run_and_kill
from adtopk_ps.testing.stats import join_to_first_step, kill_to_next_step

ROOT = Path(__file__).resolve().parents[1]
PROGRAM = ROOT / "tests" / "programs" / "elastic_train.py"
# kills are seen by their closed connections; heartbeats only for hung processes
FAST = {"PS_HEARTBEAT_INTERVAL_MS": "200", "PS_HEARTBEAT_TIMEOUT_MS": "6000"}


def job(workers: int, args: list[str], steps: int, restarts: int = 0,
        kill_server: tuple[int, int] | None = None) -> str:
    """One job's output; raises where it did not finish. ``kill_server``: (server, step), the
    server killed when the first worker reports that step."""
    cmd = [sys.executable, "-m", "adtopk_ps.launcher", "--local", "--num-workers", str(workers),
           "--num-servers", "2", "--min-workers", "2", "--timeout", "300",
           "--restarts", str(restarts), "--", sys.executable, str(PROGRAM), "--steps", str(steps), *args]
    env = {**os.environ, **FAST}
    if kill_server is None:
        result = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, timeout=360)
    else:
        server, at = kill_server
        result, killed = run_and_kill(cmd, env, rf"step {at} of \d+ at", "server", server, 360)
        result.stdout += "".join(f"server {server}: killed after step {at} at {t:.3f}\n" for t in killed)
    if result.returncode != 0 or "done step" not in result.stdout:
        raise RuntimeError(f"{' '.join(args)}: the job did not finish:\n{result.stdout[-3000:]}")
    return result.stdout


def accuracy(out: str) -> float:
    found = {float(a) for a in re.findall(r"accuracy=([\d.]+)", out)}
    assert len(found) == 1, found  # the replicas agree
    return found.pop()


def series(title: str, count: int, one: Callable[[int], tuple[str, list[float]]]) -> None:
    """Run ``one`` ``count`` times (each gives what it did and its figures), printing each
    and then the figures' median and range."""
    figures = []
    for i in range(count):
        what, got = one(i)
        figures += got
        print(f"{what}: {', '.join(f'{g:.2f}' for g in got)} s", flush=True)
    if figures:
        print(f"\n{title} over {len(figures)} events: median {statistics.median(figures):.2f} s, "
              f"min {min(figures):.2f}, max {max(figures):.2f}\n", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=7, help="5-worker jobs, three kills each")
    ap.add_argument("--joins", type=int, default=20, help="jobs with one worker restarted")
    ap.add_argument("--server-kills", type=int, default=20, help="jobs losing a server")
    ap.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=200, help="steps of each accuracy run")
    args = ap.parse_args()
    rng = random.Random(0)

    def worker_kills(i: int) -> tuple[str, list[float]]:
        victims, at = rng.sample(range(5), 3), sorted(rng.sample(range(1, 14), 3))
        when = ["before-push", "mid-push"][i % 2]
        out = job(5, ["--when", when, *(f"--kill={v}:{s}" for v, s in zip(victims, at))], 16)
        return f"job {i + 1}: {when}, kills {list(zip(victims, at))}", kill_to_next_step(out)

    def joins(i: int) -> tuple[str, list[float]]:
        victim = rng.randrange(3)
        out = job(3, [f"--kill={victim}:5", "--step-s=0.1"], 50, restarts=1)
        return f"join {i + 1}: worker {victim} restarted", join_to_first_step(out)

    def server_kills(i: int) -> tuple[str, list[float]]:
        server = rng.randrange(2)
        out = job(3, ["--step-s=0.05"], 30, kill_server=(server, 6))
        return f"server kill {i + 1}: server {server}", kill_to_next_step(out)
    series("worker kill to next step", args.jobs, worker_kills)
    series("a joiner's registration to its first step", args.joins, joins)
    series("server kill to next step", args.server_kills, server_kills)
    if args.seeds:
        print("| seed | undisturbed (3 workers) | worker 2 killed at step 40, server 1 at step "
              "80, worker 2 restarted |\n|---|---|---|")
    for seed in args.seeds:
        paced = ["--seed", str(seed), "--step-s=0.05"]  # the restart joins well before the end
        whole = accuracy(job(3, paced, args.steps))
        out = job(3, [*paced, "--kill=2:40"], args.steps, restarts=1, kill_server=(1, 80))
        assert len(join_to_first_step(out)) == 1 and "server 1 (" in out, out[-3000:]
        print(f"| {seed} | {whole:.4f} | {accuracy(out):.4f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
