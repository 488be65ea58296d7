"""Soak: many workers and servers on one host for thousands of rounds, every aggregate checked.

W self-checking workers (``worker.selfcheck``: each predicts every exact sum
from shared seeds) push a mix of dense and sparse keys to S servers, round
after round. Meanwhile the RSS of every role is sampled once a second.
Reported: rounds/s, round latency (p50, p99, max over every worker's
rounds), and each role's RSS at the start, middle and end of the run. The
run fails if any aggregate is wrong, any role exits non-zero, or any role's
memory keeps growing (its last third against its middle third, after a
warm-up third).

    python benchmarks/soak.py                                  # 8 x 4, 3000 rounds
    python benchmarks/soak.py --workers 8 --servers 4 --rounds 300 --out /tmp/soak
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from adtopk_ps.launcher import free_port

ROOT = Path(__file__).resolve().parents[1]

# dense (1-D, and small) and sparse keys, one of them split over several servers
SHAPES = ["64x300", "1000", "7x3x5x5", "33x1", "200x256", "4096"]
# growth allowed between the middle and the last third of a run: allocator noise, not a leak
GROWTH_SLACK_BYTES = 8 << 20
GROWTH_SLACK_SHARE = 0.05


def rss_bytes(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def start_roles(args: argparse.Namespace, reports: Path) -> dict[str, subprocess.Popen]:
    env = {**os.environ, "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": str(free_port()),
           "DMLC_NUM_WORKER": str(args.workers), "DMLC_NUM_SERVER": str(args.servers),
           "DMLC_NODE_HOST": "127.0.0.1", "BYTEPS_PARTITION_BYTES": str(64 << 10),
           "OMP_NUM_THREADS": "1", "PS_REGISTER_TIMEOUT_S": "120"}
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.PIPE, "text": True,
             "start_new_session": True}
    roles = {"scheduler": subprocess.Popen([sys.executable, "-m", "adtopk_ps.cluster.scheduler"],
                                           env={**env, "DMLC_ROLE": "scheduler"}, **quiet)}
    for i in range(args.servers):
        roles[f"server {i}"] = subprocess.Popen([sys.executable, "-m", "server"],
                                                env={**env, "DMLC_ROLE": "server"}, **quiet)
    for i in range(args.workers):
        roles[f"worker {i}"] = subprocess.Popen(
            [sys.executable, "-m", "worker.selfcheck", "--compressor", args.compressor, "--ratio",
             str(args.ratio), "--ef", "--rounds", str(args.rounds), "--shapes", *SHAPES,
             "--every", str(max(1, args.rounds // 4)), "--report", str(reports / f"{i}.json")],
            env={**env, "DMLC_ROLE": "worker", "DMLC_WORKER_ID": str(i)}, cwd=ROOT,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    return roles


def watch(roles: dict[str, subprocess.Popen], timeout: float) -> dict[str, list[tuple[float, int]]]:
    """RSS samples of every role, once a second, until every role has exited."""
    samples: dict[str, list[tuple[float, int]]] = {name: [] for name in roles}
    began = time.monotonic()
    while any(p.poll() is None for p in roles.values()):
        if time.monotonic() - began > timeout:
            raise TimeoutError(f"soak run still going after {timeout:.0f} s")
        for name, proc in roles.items():
            rss = rss_bytes(proc.pid) if proc.poll() is None else None
            if rss is not None:
                samples[name].append((time.monotonic() - began, rss))
        time.sleep(1.0)
    return samples


def growth(series: list[tuple[float, int]]) -> tuple[int, int, int, bool]:
    """Median RSS of each third of a role's life, and whether the last third kept growing
    past the middle one (the first third is start-up: imports, first allocations)."""
    values = [rss for _, rss in series]
    third = max(1, len(values) // 3)
    first, middle, last = (int(statistics.median(values[i * third:(i + 1) * third] or values[-1:]))
                           for i in range(3))
    grew = len(values) >= 6 and last > middle * (1 + GROWTH_SLACK_SHARE) + GROWTH_SLACK_BYTES
    return first, middle, last, grew


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--servers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3000)
    ap.add_argument("--compressor", default="adtopk")
    ap.add_argument("--ratio", type=float, default=0.05)
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--out", default=str(ROOT / "docs"), help="where soak.md and soak.json go")
    args = ap.parse_args()
    samples, failed, worker_reports = soak(args)
    if failed:
        for name, (code, output) in failed.items():
            print(f"--- {name} exited with {code}\n{output}", file=sys.stderr)
        print(f"soak FAILED: {dict((name, code) for name, (code, _) in failed.items())}")
        return 1
    summary, rows = summarise(args, samples, worker_reports)
    text = render(args, summary, rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "soak.md").write_text(text)
    (out / "soak.json").write_text(json.dumps({**summary, "rss": samples}, indent=1))
    print(text)
    if summary["grew"]:
        print(f"soak FAILED: memory kept growing in {summary['grew']}")
        return 1
    return 0


def soak(args: argparse.Namespace) -> tuple[dict, dict[str, tuple[int, str]], list[dict]]:
    """Run every role to its end: their RSS samples, the roles that failed (name -> exit status
    and the end of their output) and each worker's report."""
    with tempfile.TemporaryDirectory() as tmp:
        reports = Path(tmp)
        roles = start_roles(args, reports)
        try:
            samples = watch(roles, args.timeout)
        finally:
            for proc in roles.values():
                if proc.poll() is None:
                    proc.kill()
                proc.wait()
        failed = {name: p.returncode for name, p in roles.items() if p.returncode != 0}
        outputs = {name: p.stdout.read() for name, p in roles.items() if name.startswith("worker")}
        errors = {name: p.stderr.read()[-2000:] for name, p in roles.items() if p.stderr}
        worker_reports = [json.loads(f.read_text()) for f in sorted(reports.glob("*.json"))]
    return samples, {name: (code, f"{(outputs.get(name) or '')[-2000:]}{errors.get(name, '')}")
                     for name, code in failed.items()}, worker_reports


def summarise(args: argparse.Namespace, samples: dict, worker_reports: list[dict]) -> tuple[dict, list[str]]:
    """The run's figures, and a table row of each role's RSS over its life."""
    latencies = sorted(s for r in worker_reports for s in r["latencies_s"])
    wall = max(r["wall_s"] for r in worker_reports)
    rows, grown = [], []
    for name, series in samples.items():
        if not series:
            continue
        first, middle, last, grew = growth(series)
        rows.append(f"| {name} | {first / 2**20:.1f} | {middle / 2**20:.1f} | {last / 2**20:.1f} | "
                    f"{'grows' if grew else 'flat'} |")
        if grew:
            grown.append(name)
    summary = {
        "workers": args.workers, "servers": args.servers, "rounds": args.rounds,
        "keys_per_round": len(SHAPES), "rounds_per_s": args.rounds / wall,
        "latency_p50_ms": 1000 * latencies[len(latencies) // 2],
        "latency_p99_ms": 1000 * latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))],
        "latency_max_ms": 1000 * latencies[-1], "every_aggregate_exact": True, "grew": grown,
    }
    return summary, rows


def render(args: argparse.Namespace, summary: dict, rows: list[str]) -> str:
    """soak.md: the run's figures and the RSS table."""
    return "\n".join([
        f"#### Soak: {args.workers} workers x {args.servers} servers, {args.rounds} rounds of "
        f"{len(SHAPES)} keys ({args.compressor} {args.ratio} with error feedback on the 2-D ones, "
        f"dense on the rest), one host", "",
        f"{summary['rounds_per_s']:.1f} rounds/s; round latency p50 {summary['latency_p50_ms']:.1f} ms, "
        f"p99 {summary['latency_p99_ms']:.1f} ms, max {summary['latency_max_ms']:.1f} ms; every "
        f"aggregate of every worker exact.", "",
        "| role | RSS (MiB), first third of the run | middle third | last third | trend |",
        "|---|---:|---:|---:|---|", *rows, ""])


if __name__ == "__main__":
    sys.exit(main())
