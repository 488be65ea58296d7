"""Convergence at equal bytes: every compressor trains the same job on a 4-worker cluster.

For each density, ADTopk runs at that density, and every other sparsifier
runs at the density that makes its payloads for the model's sparsified
layers as large as ADTopk's (found by bisection on the real payload sizes),
so the comparison is at equal bytes sent. Layers the partial-sparsification
policy keeps dense are the same for every run. Dense training is the
reference.

    python benchmarks/convergence.py                  # writes docs/convergence*.png and .md
    python benchmarks/convergence.py --densities 0.01 --compressors adtopk topk
"""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import yaml

from adtopk_ps.compression import SparsificationPolicy, create
from worker.models import build

ROOT = Path(__file__).resolve().parents[1]

SPARSIFIERS = ["topk", "adtopk", "adtopk-i", "threshold", "randomk", "dgc", "gaussiank"]


def sparse_bytes(name: str, ratio: float, shapes: list[tuple[int, ...]]) -> float:
    """Mean payload bytes per step over the sparsified layers (two calls: ADTopk-I alternates)."""
    comp = create(name, ratio=ratio)
    gen = torch.Generator().manual_seed(0)
    total = 0
    for i, shape in enumerate(shapes):
        g = torch.randn(shape, generator=gen)
        total += sum(comp.compress(g, f"p{i}", step).nbytes for step in range(2))
    return total / 2


def matching_ratio(name: str, target: float, shapes: list[tuple[int, ...]]) -> float:
    lo, hi = math.log(1e-5), 0.0
    for _ in range(40):
        mid = (lo + hi) / 2
        if sparse_bytes(name, math.exp(mid), shapes) < target:
            lo = mid
        else:
            hi = mid
    return math.exp((lo + hi) / 2)


def run(config: Path, compressor: str, ratio: float | None, workers: int, servers: int,
        workdir: Path) -> dict:
    tag = compressor if ratio is None else f"{compressor}-{ratio:.6f}"
    metrics, summary = workdir / f"{tag}.jsonl", workdir / f"{tag}.json"
    cmd = [sys.executable, "-m", "adtopk_ps.launcher", "--local", "--num-workers", str(workers),
           "--num-servers", str(servers), "--timeout", "1800", "--", sys.executable, "-m", "worker",
           "--config", str(config), "--compressor", compressor, "--metrics", str(metrics),
           "--metrics-out", str(summary), "--set", "eval_every=10", "--set", "progress=false"]
    if ratio is not None:
        cmd += ["--ratio", repr(ratio)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1900, cwd=ROOT)
    if out.returncode != 0:
        raise RuntimeError(f"{tag} failed ({out.returncode}):\n{out.stdout[-3000:]}")
    curve = [json.loads(line) for line in metrics.read_text().splitlines()]
    result = json.loads(summary.read_text())
    result.update(curve=curve, best=max(r["accuracy"] for r in curve), ratio=ratio)
    return result


def plot(results: dict, density: float, out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (by_step, by_bytes) = plt.subplots(1, 2, figsize=(12, 4.5))
    for label, r in results.items():
        steps = [c["step"] for c in r["curve"]]
        acc = [100 * c["accuracy"] for c in r["curve"]]
        by_step.plot(steps, acc, label=label, lw=2.5 if label.startswith("adtopk") else 1.2)
        by_bytes.plot([c["bytes_pushed"] / 2**20 for c in r["curve"]], acc, label=label,
                      lw=2.5 if label.startswith("adtopk") else 1.2)
    by_step.set(xlabel="step", ylabel="test accuracy (%)", title=f"accuracy vs step, density {density}")
    by_bytes.set(xlabel="MiB pushed per worker", ylabel="test accuracy (%)", xscale="log",
                 title=f"accuracy vs bytes, density {density}")
    for ax in (by_step, by_bytes):
        ax.set_ylim(0, 100)
        ax.grid(alpha=0.3)
    by_bytes.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "configs" / "digits-cnn.yaml"))
    ap.add_argument("--densities", nargs="*", type=float, default=[0.01, 0.001])
    ap.add_argument("--compressors", nargs="*", default=SPARSIFIERS)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--servers", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "docs"))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = yaml.safe_load(Path(args.config).read_text())
    model = build(cfg["model"], cfg.get("model_args", {}))
    policy = SparsificationPolicy(0.01, min_compress_bytes=cfg.get("min_compress_bytes", 65536))
    routes = policy.plan(model.named_parameters())
    shapes = [tuple(p.shape) for n, p in model.named_parameters() if not routes[n].dense]
    lines = [f"Config `{Path(args.config).name}`, {args.workers} workers x {args.servers} servers, "
             f"seed {cfg.get('seed', 0)}; sparsified layers: {shapes}", ""]
    with tempfile.TemporaryDirectory() as tmp:
        dense = run(Path(args.config), "none", None, args.workers, args.servers, Path(tmp))
        for density in args.densities:
            target = sparse_bytes("adtopk", density, shapes)
            results = {"dense": dense}
            for name in args.compressors:
                ratio = density if name == "adtopk" else matching_ratio(name, target, shapes)
                results[f"{name}"] = run(Path(args.config), name, ratio, args.workers, args.servers,
                                         Path(tmp))
                print(f"density {density}: {name} done", flush=True)
            plot(results, density, out / f"convergence-{density}.png")
            lines += [f"#### Density {density} (ADTopk's sparse payloads: {target:,.0f} bytes per step)",
                      "", "| compressor | ratio used | final acc. | best acc. | vs dense (final) "
                      "| MiB pushed per worker | wall s |", "|---|---:|---:|---:|---:|---:|---:|"]
            for label, r in results.items():
                ratio = "-" if r["ratio"] is None else f"{r['ratio']:.5f}"
                lines.append(f"| {label} | {ratio} | {100 * r['accuracy']:.2f} | {100 * r['best']:.2f} "
                             f"| {100 * (r['accuracy'] - dense['accuracy']):+.2f} "
                             f"| {r['bytes_pushed'] / 2**20:.2f} | {r['wall_s']:.1f} |")
            lines.append("")
    text = "\n".join(lines)
    (out / "convergence.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
