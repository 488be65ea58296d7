"""Convergence at equal bytes, over several seeds: every compressor trains the same jobs on a
4-worker x 2-server cluster.

Two tasks: Fashion-MNIST with a small CNN (test accuracy) and a byte-level Transformer on
Python's standard library (test loss, bits per byte). For each density, ADTopk runs at that
density and every other sparsifier at the density that makes its payloads for the task's
sparsified layers as large as ADTopk's, so runs compare at equal bytes. The sizes are those
of real payloads on real gradients: the task's model trained with plain SGD to steps 0, 300
and 1500, a few gradients at each (benchmarks/union_density.py's), every compressor
compressing each twice (ADTopk-I alternates); a bisection finds the matching density.
ADTopk's payloads leave out the rows that selected only zeros, which real gradients have
(units that gave no gradient) and random ones do not. ADTopk with refill
(``adtopk+refill``) runs at the density itself: it gives the entries dead rows free to the
live rows, so it sends about the density's bytes, more than plain ADTopk; its report line
names what it pushed. ADTopk with re-sparsified answers pushes what plain ADTopk does, and
the servers answer with the top-k of each key's sum (``BYTEPS_SERVER_COMPRESSOR``, with the
servers' error feedback) instead of the workers' union: at the density
(``adtopk+server-topk``), or twice or four times as wide as the workers' pushes
(``adtopk+server-2x``, ``adtopk+server-4x``).
Layers the policy keeps dense are the same in every run; dense training is the reference.

Every run is stored as one JSON file (summary and curve) in ``--results`` as soon as it ends,
and runs already there are skipped: stop it at any time and run the same command again to go
on. ``--shard I/N`` runs every N-th pending run, so N machines (or N sittings) split the study;
``--report`` only draws the tables and charts from what is stored.

    python benchmarks/convergence.py                          # run what is missing, then report
    python benchmarks/convergence.py --tasks fashion --seeds 0 --compressors adtopk topk
    python benchmarks/convergence.py --shard 1/2              # half of the pending runs
    python benchmarks/convergence.py --report                 # tables and charts only
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from adtopk_ps.compression import create
from adtopk_ps.deathsig import guarded
from adtopk_ps.wire import payload_nbytes
from worker.models import build

sys.path.insert(0, str(Path(__file__).resolve().parent))
from union_density import sparsified, trained_gradients  # noqa: E402  (its real gradients)

ROOT = Path(__file__).resolve().parents[1]

TASKS = {"fashion": ROOT / "configs" / "fashion-cnn.yaml",
         "pysource": ROOT / "configs" / "pysource-transformer.yaml"}
# every seed, every density
MAIN = ["topk", "adtopk", "adtopk-i", "adtopk+refill", "adtopk+server-topk", "adtopk+server-2x",
        "adtopk+server-4x"]
# a method's job flags beyond --compressor
FLAGS = {"adtopk+refill": ["--set", "compression.refill=true"]}
# a method's environment for every role, {density} filled in
ENV = {"adtopk+server-topk": {"BYTEPS_SERVER_COMPRESSOR": "topk:{density}"},
       "adtopk+server-2x": {"BYTEPS_SERVER_COMPRESSOR": "topk:2x"},
       "adtopk+server-4x": {"BYTEPS_SERVER_COMPRESSOR": "topk:4x"}}
# ADTopk's variants: each runs at the density itself (not at a density matched to ADTopk's
# bytes) and is compared with plain ADTopk
VARIANTS = (*FLAGS, *ENV)
# training steps at which the matching takes its real gradients, and how many at each
MATCH_AT, MATCH_BATCHES = [0, 300, 1500], 4
OTHERS = ["threshold", "randomk", "dgc", "gaussiank"]  # the first seed, the first density


@dataclass(frozen=True)
class Run:
    task: str
    compressor: str  # "none" for dense
    density: float | None  # the ADTopk density it is matched to; None for dense
    seed: int

    @property
    def tag(self) -> str:
        kind = "dense" if self.density is None else f"{self.compressor}-d{self.density:g}"
        return f"{self.task}-{kind}-s{self.seed}"


def plan(tasks: list[str], densities: list[float], seeds: list[int], compressors: list[str]) -> list[Run]:
    """Seed by seed, so that a study stopped half way has every method at its first seeds."""
    runs = []
    for seed in seeds:
        for task in tasks:
            if "none" in compressors:
                runs.append(Run(task, "none", None, seed))
            for d in densities:
                runs += [Run(task, c, d, seed) for c in MAIN if c in compressors]
                if seed == seeds[0] and d == densities[0]:
                    runs += [Run(task, c, d, seed) for c in OTHERS if c in compressors]
    return runs


def shard(runs: list[Run], pending: list[Run], index: int, count: int) -> list[Run]:
    """The pending runs of shard ``index`` of ``count``: split over the whole plan, so that every
    sitting of a shard takes the same share whatever the others have done meanwhile."""
    return [r for r in runs[index - 1::count] if r in pending]


def real_gradients(task: str) -> list[dict[str, torch.Tensor]]:
    """The task's gradients the matching compresses: MATCH_BATCHES at each of MATCH_AT."""
    return [g for _, grads in trained_gradients(TASKS[task], MATCH_AT, MATCH_BATCHES, 0) for g in grads]


def sparsified_shapes(config: Path) -> list[tuple[int, ...]]:
    cfg = yaml.safe_load(config.read_text())
    model = build(cfg["model"], cfg.get("model_args", {}))
    params = dict(model.named_parameters())
    return [tuple(params[n].shape) for n in sparsified(cfg, model)]


def sparse_bytes(name: str, ratio: float, grads: list[dict[str, torch.Tensor]]) -> float:
    """Mean payload bytes per step of ``name`` at ``ratio`` over the sparsified layers of each
    gradient set (two calls each: ADTopk-I alternates)."""
    total = 0
    for g in grads:
        comp = create(name, ratio=ratio)
        total += sum(payload_nbytes(comp.compress(t, n, step)) for n, t in g.items() for step in range(2))
    return total / (2 * len(grads))


def matching_ratio(name: str, density: float, grads: list[dict[str, torch.Tensor]]) -> float:
    """The density at which ``name``'s payloads weigh what ADTopk's do at ``density`` on
    ``grads``; ADTopk itself, with refill or with re-sparsified answers, runs at ``density``."""
    if name == "adtopk" or name in VARIANTS:
        return density
    target = sparse_bytes("adtopk", density, grads)
    lo, hi = math.log(1e-5), 0.0
    for _ in range(40):
        mid = (lo + hi) / 2
        if sparse_bytes(name, math.exp(mid), grads) < target:
            lo = mid
        else:
            hi = mid
    return math.exp((lo + hi) / 2)


def execute(run: Run, ratio: float | None, args: argparse.Namespace, results: Path) -> dict:
    metrics = results / f"{run.tag}.jsonl"
    summary = results / f"{run.tag}.summary.json"
    metrics.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "adtopk_ps.launcher", "--local", "--num-workers", str(args.workers),
           "--num-servers", str(args.servers), "--timeout", str(args.run_timeout), "--",
           sys.executable, "-m", "worker", "--config", str(TASKS[run.task]), "--compressor",
           run.compressor.split("+")[0], "--seed", str(run.seed), "--metrics", str(metrics),
           "--metrics-out", str(summary), "--set", "progress=false", *FLAGS.get(run.compressor, [])]
    if ratio is not None:
        cmd += ["--ratio", repr(ratio)]
    if args.device:
        cmd += ["--set", f"device={args.device}"]
    for item in args.set:
        cmd += ["--set", item]
    env = {**os.environ,
           **{k: v.format(density=run.density) for k, v in ENV.get(run.compressor, {}).items()}}
    began = time.time()
    out = subprocess.run(guarded(cmd), capture_output=True, text=True, timeout=args.run_timeout + 60,
                         cwd=ROOT, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"{run.tag} failed ({out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    record = {"task": run.task, "compressor": run.compressor, "density": run.density,
              "seed": run.seed, "ratio": ratio, "summary": json.loads(summary.read_text()),
              "curve": [json.loads(line) for line in metrics.read_text().splitlines()],
              "elapsed_s": time.time() - began, "settings": settings(run.task, args)}
    metrics.unlink()
    summary.unlink()
    return record


def settings(task: str, args: argparse.Namespace) -> dict:
    """What else decides a run's result: runs stored with other settings are not this study's."""
    config = hashlib.sha256(TASKS[task].read_bytes()).hexdigest()[:16]
    return {"config_sha256": config, "workers": args.workers, "servers": args.servers,
            "device": args.device, "set": list(args.set), "matched_on": "real gradients"}


def store(path: Path, record: dict) -> None:
    """Whole or not at all: a study stopped while writing leaves no half record."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(record) + "\n")
    os.replace(partial, path)


def stored(path: Path) -> dict | None:
    """The record at ``path``, or None (naming the file) where it cannot be read."""
    try:
        record = json.loads(path.read_text())
        if not isinstance(record, dict) or not {"task", "summary", "curve", "settings"} <= set(record):
            raise ValueError("not a run record")
        return record
    except (OSError, ValueError) as exc:
        print(f"{path}: unreadable ({exc}); the run counts as not done", file=sys.stderr, flush=True)
        return None


# ---- the report ---------------------------------------------------------------------------

def score(task: str, point: dict) -> float:
    """What is compared: test accuracy in % (higher is better), or the LM's test loss in bits
    per byte (lower is better)."""
    return 100 * point["accuracy"] if task == "fashion" else point["test_loss"] / math.log(2)


def higher_is_better(task: str) -> bool:
    return task == "fashion"


def spread(values: list[float]) -> tuple[float, float, float, float]:
    """Mean, sample standard deviation (0 for one value), min and max."""
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return statistics.mean(values), sd, min(values), max(values)


def welch(a: list[float], b: list[float]) -> tuple[float, float] | None:
    """Mean difference a - b and the half-width of its 95% interval (Welch), or None where a
    side has fewer than two seeds."""
    if len(a) < 2 or len(b) < 2:
        return None
    from scipy import stats
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    diff = statistics.mean(a) - statistics.mean(b)
    if va + vb == 0:
        return diff, 0.0
    dof = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
    return diff, stats.t.ppf(0.975, dof) * math.sqrt(va + vb)


def load_results(results: Path) -> list[dict]:
    found = (stored(p) for p in sorted(results.glob("*.json")) if not p.name.endswith(".summary.json"))
    return [r for r in found if r is not None]


def groups(records: list[dict], task: str, density: float) -> dict[str, list[dict]]:
    """Runs of one task at one density, by method (dense in every density's table)."""
    out: dict[str, list[dict]] = {}
    for r in records:
        if r["task"] == task and (r["density"] is None or r["density"] == density):
            out.setdefault("dense" if r["density"] is None else r["compressor"], []).append(r)
    order = ["dense", *MAIN, *OTHERS]
    return {k: out[k] for k in order if k in out}


def best_of(task: str, r: dict) -> float:
    values = [score(task, p) for p in r["curve"]]
    return max(values) if higher_is_better(task) else min(values)


def final_of(task: str, r: dict) -> float:
    s = r["summary"]
    return score(task, {"accuracy": s["accuracy"], "test_loss": s["loss"]})


def table(task: str, density: float, by_method: dict[str, list[dict]]) -> list[str]:
    what = "test accuracy (%)" if higher_is_better(task) else "test loss (bits per byte)"
    lines = [f"### {task}, density {density:g}: {what}", "",
             "| method | seeds | ratio used | final: mean ± sd [min, max] | best: mean ± sd "
             "| MiB pushed per worker | MiB pulled | wall s |", "|---|---:|---:|---|---|---:|---:|---:|"]
    for method, runs in by_method.items():
        final = spread([final_of(task, r) for r in runs])
        best = spread([best_of(task, r) for r in runs])
        ratio = "-" if runs[0]["ratio"] is None else f"{runs[0]['ratio']:.5f}"
        mib = statistics.mean(r["summary"]["bytes_pushed"] for r in runs) / 2**20
        pulled = statistics.mean(r["summary"]["bytes_pulled"] for r in runs) / 2**20
        wall = statistics.mean(r["summary"]["wall_s"] for r in runs)
        lines.append(f"| {method} | {len(runs)} | {ratio} | {final[0]:.3f} ± {final[1]:.3f} "
                     f"[{final[2]:.3f}, {final[3]:.3f}] | {best[0]:.3f} ± {best[1]:.3f} "
                     f"| {mib:.1f} | {pulled:.1f} | {wall:.0f} |")
    return lines + [""]


def verdicts(task: str, density: float, by_method: dict[str, list[dict]]) -> list[str]:
    """Which differences in final score are larger than the seeds' spread: the 95% interval of
    the difference in means (Welch) excludes zero."""
    finals = {m: [final_of(task, r) for r in runs] for m, runs in by_method.items()}
    pairs = [(m, "dense") for m in finals if m != "dense"] + \
        [("adtopk", "topk"), ("adtopk-i", "topk"), *((m, "adtopk") for m in VARIANTS)]
    higher = higher_is_better(task)
    lines = []
    for a, b in pairs:
        if a not in finals or b not in finals:
            continue
        found = welch(finals[a], finals[b])
        if found is None:
            lines.append(f"- {a} vs {b}: {statistics.mean(finals[a]) - statistics.mean(finals[b]):+.3f} "
                         "with one seed on a side: no spread to judge it by.")
            continue
        diff, half = found
        plain = "not larger than the spread"
        if abs(diff) > half:
            plain = f"larger than the spread: {a} is {'better' if (diff > 0) == higher else 'worse'}"
        lines.append(f"- {a} vs {b}: {diff:+.3f} ± {half:.3f} (95%): {plain}.")
    return lines + [""] if lines else []


def chart(task: str, density: float, by_method: dict[str, list[dict]], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (by_step, by_bytes) = plt.subplots(1, 2, figsize=(12, 4.5))
    for method, runs in by_method.items():
        steps = sorted({p["step"] for r in runs for p in r["curve"]})
        common = [s for s in steps if all(any(p["step"] == s for p in r["curve"]) for r in runs)]
        values = [[score(task, next(p for p in r["curve"] if p["step"] == s)) for r in runs] for s in common]
        mean = [statistics.mean(v) for v in values]
        lo, hi = [min(v) for v in values], [max(v) for v in values]
        mib = [statistics.mean(next(p for p in r["curve"] if p["step"] == s)["bytes_pushed"]
                               for r in runs) / 2**20 for s in common]
        width = 2.5 if method.startswith("adtopk") else 1.2
        for ax, x in ((by_step, common), (by_bytes, mib)):
            line, = ax.plot(x, mean, lw=width, label=f"{method} ({len(runs)} seed{'s' * (len(runs) > 1)})")
            if len(runs) > 1:
                ax.fill_between(x, lo, hi, color=line.get_color(), alpha=0.18, lw=0)
    ylabel = "test accuracy (%)" if higher_is_better(task) else "test loss (bits per byte)"
    by_step.set(xlabel="step", ylabel=ylabel, title=f"{task}, density {density:g}: mean, band min..max over seeds")
    by_bytes.set(xlabel="MiB pushed per worker", ylabel=ylabel, xscale="log", title="against bytes sent")
    for ax in (by_step, by_bytes):
        ax.grid(alpha=0.3)
    by_bytes.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(records: list[dict], args: argparse.Namespace) -> str:
    clusters = sorted({(r["settings"]["workers"], r["settings"]["servers"]) for r in records})
    lines = ["# Convergence at equal bytes", "",
             f"Made by `python benchmarks/convergence.py` ({len(records)} runs of "
             f"{' and '.join(f'{w} workers x {s} servers' for w, s in clusters)} stored in "
             f"`{Path(args.results).relative_to(ROOT) if Path(args.results).is_relative_to(ROOT) else args.results}`). "
             "Final = at the last step; best = the best evaluation along the way. The band in each "
             "chart runs from the lowest to the highest seed.", ""]
    for task in args.tasks:
        shapes = sparsified_shapes(TASKS[task])
        lines += [f"## {task} (`{TASKS[task].name}`); sparsified layers: {shapes}", ""]
        for density in args.densities:
            by_method = groups(records, task, density)
            if not by_method:
                continue
            name = f"convergence-{task}-{density:g}.png"
            chart(task, density, by_method, Path(args.out) / name)
            lines += table(task, density, by_method) + verdicts(task, density, by_method)
            lines += [f"![{task} at density {density:g}]({name})", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tasks", nargs="*", default=list(TASKS), choices=list(TASKS))
    ap.add_argument("--densities", nargs="*", type=float, default=[0.01, 0.001])
    ap.add_argument("--seeds", nargs="*", type=int, default=[0, 1, 2])
    ap.add_argument("--compressors", nargs="*", default=["none", *MAIN, *OTHERS],
                    choices=["none", *MAIN, *OTHERS])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--servers", type=int, default=2)
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"],
                    help="the job config's device (default: the config's own)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="passed on to every run's job (a smoke test's short runs, say)")
    ap.add_argument("--run-timeout", type=int, default=3600, dest="run_timeout",
                    help="seconds one training run may take")
    ap.add_argument("--shard", default="1/1", help="I/N: run every N-th pending run, starting at the I-th")
    ap.add_argument("--results", default=str(ROOT / "docs" / "convergence-runs"))
    ap.add_argument("--out", default=str(ROOT / "docs"))
    ap.add_argument("--report", action="store_true", help="only report what is stored")
    args = ap.parse_args()
    index, _, count = args.shard.partition("/")
    if not (index.isdigit() and count.isdigit() and 1 <= int(index) <= int(count)):
        ap.error(f"--shard {args.shard!r}: must be I/N with 1 <= I <= N")
    results = Path(args.results)
    if args.report and not results.is_dir():
        ap.error(f"--results {results}: no such folder")
    results.mkdir(parents=True, exist_ok=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)  # (the report comes after hours of runs)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that the run in flight is stopped
    if not args.report:
        runs = plan(args.tasks, args.densities, args.seeds, args.compressors)
        records = {r: stored(results / f"{r.tag}.json") for r in runs if (results / f"{r.tag}.json").exists()}
        for run, record in records.items():  # a record of other settings is not this study's
            if record is not None and record["settings"] != settings(run.task, args):
                ap.error(f"{results / (run.tag + '.json')} was made with other settings "
                         f"({record['settings']}, now {settings(run.task, args)}): use another --results folder")
        pending = [r for r in runs if records.get(r) is None]
        mine = shard(runs, pending, int(index), int(count))
        print(f"{len(pending)} run(s) pending; this shard runs {len(mine)}", flush=True)
        ratios: dict[tuple[str, str, float], float] = {}
        grads: dict[str, list] = {}
        for i, run in enumerate(mine, 1):
            ratio = None
            if run.density is not None:
                key = (run.task, run.compressor, run.density)
                if key not in ratios:
                    if run.task not in grads:
                        grads[run.task] = real_gradients(run.task)
                    ratios[key] = matching_ratio(run.compressor, run.density, grads[run.task])
                ratio = ratios[key]
            record = execute(run, ratio, args, results)
            store(results / f"{run.tag}.json", record)
            s = record["summary"]
            print(f"[{i}/{len(mine)}] {run.tag}: accuracy {s['accuracy']:.4f} loss {s['loss']:.4f} "
                  f"in {record['elapsed_s']:.0f} s", flush=True)
    records = load_results(results)
    if not records:
        ap.error(f"--results {results}: no runs stored")
    text = report(records, args)
    Path(args.out, "convergence.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
