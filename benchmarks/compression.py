"""Compression cost per layer shape, side by side in one run.

For every shape and density it times each compressor and three references
measured in the same run: reading the tensor once (``x.sum()``), one
elementwise pass that writes |x| (``x.abs()``, where every |g|-based
selection starts), and a global ``torch.topk`` over |x|. Ratios are against
those, so the noise of a shared machine mostly cancels.

    python benchmarks/compression.py                 # the full table
    python benchmarks/compression.py --shapes 256x256 --densities 0.01
"""
from __future__ import annotations

import argparse
import math
import time

import torch

from adtopk_ps.compression import create

SHAPES = {
    "spec": [(4096, 4096), (512, 512, 3, 3)],  # (512, 512, 3, 3) is also ResNet-50's layer4
    "resnet50": [(64, 3, 7, 7), (64, 64, 3, 3), (256, 64, 1, 1), (256, 256, 3, 3),
                 (1024, 256, 1, 1), (2048, 512, 1, 1), (1000, 2048)],
    "bert-base": [(30522, 768), (768, 768), (3072, 768), (768, 3072)],
}
ROWS = [("none", {}), ("topk", {}), ("threshold", {"warmup": 0}), ("adtopk", {}),
        ("adtopk", {"layout": "rows"}), ("adtopk-i", {}), ("randomk", {}), ("dgc", {}),
        ("gaussiank", {})]


def timed(fn, budget_s: float, min_runs: int = 4) -> float:
    """Mean seconds per call over an even number of calls, after one warm-up call.

    A mean, not a median: ADTopk-I and the threshold compressor alternate
    cheap and costly calls, and their cost per call is the average.
    """
    fn()
    runs = 0
    start = time.perf_counter()
    while runs < min_runs or runs % 2 or (time.perf_counter() - start < budget_s and runs < 50):
        fn()
        runs += 1
    return (time.perf_counter() - start) / runs


def bench_shape(shape: tuple[int, ...], density: float, budget_s: float) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen)
    flat = x.view(-1)
    k = max(1, math.floor(flat.numel() * density))
    read = timed(lambda: x.sum(), budget_s)
    apass = timed(lambda: x.abs(), budget_s)
    gtopk = timed(lambda: flat.abs().topk(k, sorted=False), budget_s)
    rows = [{"name": "read once (sum)", "s": read, "bytes": None},
            {"name": "|x| pass (abs)", "s": apass, "bytes": None},
            {"name": "torch.topk global", "s": gtopk, "bytes": None}]
    for name, params in ROWS:
        comp = create(name, **params) if name == "none" else create(name, ratio=density, **params)
        label = name + (f" ({params['layout']})" if "layout" in params else "")
        step = iter(range(10**9))
        s = timed(lambda: comp.compress(x, "layer", next(step)), budget_s)
        # two calls: ADTopk-I alternates codecs, so its bytes are the mean of a pair
        nbytes = sum(comp.compress(x, "layer", next(step)).nbytes for _ in range(2)) // 2
        rows.append({"name": label, "s": s, "bytes": nbytes})
    for row in rows:
        row.update(x_read=row["s"] / read, x_pass=row["s"] / apass, speedup=gtopk / row["s"])
    return rows


def table(shape: tuple[int, ...], density: float, rows: list[dict]) -> str:
    numel = math.prod(shape)
    out = [f"### {tuple(shape)} ({numel / 1e6:.2f} M elements), density {density}", "",
           "| compressor | ms/call | x read | x pass | speedup vs topk | bytes sent |",
           "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        nbytes = "" if r["bytes"] is None else f"{r['bytes']:,}"
        out.append(f"| {r['name']} | {r['s'] * 1e3:.2f} | {r['x_read']:.1f} | {r['x_pass']:.2f} "
                   f"| {r['speedup']:.2f} | {nbytes} |")
    return "\n".join(out)


def parse_shape(text: str) -> tuple[int, ...]:
    return tuple(int(d) for d in text.lower().split("x"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--shapes", nargs="*", type=parse_shape,
                    help="shapes like 4096x4096 (default: SPEC, ResNet-50 and BERT-base layers)")
    ap.add_argument("--densities", nargs="*", type=float, default=[0.01, 0.001])
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    ap.add_argument("--budget", type=float, default=0.5, help="seconds of repeats per measurement")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    shapes = args.shapes or [s for group in SHAPES.values() for s in group]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s); mean time per call\n")
    summary = []
    for density in args.densities:
        for shape in shapes:
            rows = bench_shape(shape, density, args.budget)
            print(table(shape, density, rows), "\n", flush=True)
            summary.append((shape, density, {r["name"]: r for r in rows}))
    print("### Summary: ADTopk (axis layout) against the references\n")
    print("| shape | density | ms/call | x read | x pass | speedup vs topk | bytes | topk bytes |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for shape, density, by in summary:
        a = by["adtopk"]
        print(f"| {tuple(shape)} | {density} | {a['s'] * 1e3:.2f} | {a['x_read']:.1f} | "
              f"{a['x_pass']:.2f} | {a['speedup']:.2f} | {a['bytes']:,} | {by['topk']['bytes']:,} |")
    big = [(shape, by["adtopk"]) for shape, density, by in summary
           if density == 0.01 and math.prod(shape) >= 1_000_000]
    if big:
        print("\n### Targets at density 0.01, layers of 1M+ elements\n")
        print("| shape | x pass (target <= 3) | speedup vs topk (target >= 3) |")
        print("|---|---:|---:|")
        for shape, a in big:
            print(f"| {tuple(shape)} | {a['x_pass']:.2f} {'ok' if a['x_pass'] <= 3 else 'missed'} "
                  f"| {a['speedup']:.2f} {'ok' if a['speedup'] >= 3 else 'missed'} |")

if __name__ == "__main__":
    main()
