"""Compression cost per layer shape, side by side in one run.

For every shape and density it times each compressor and three references
measured in the same run: reading the tensor once (``x.sum()``), one
elementwise pass that writes |x| (``x.abs()``, where every |g|-based
selection starts), and a global ``torch.topk`` over |x|. Ratios are against
those, so the noise of a shared machine mostly cancels.

    python benchmarks/compression.py                 # the full table
    python benchmarks/compression.py --shapes 256x256 --densities 0.01
    python benchmarks/compression.py --device cuda   # whole gradient sets on a device
    python benchmarks/compression.py --in-job vgg     # ADTopk against top-k as the job sees them

``--in-job MODEL`` compares ADTopk with global top-k, both with error
feedback, on the tensors the training job actually compresses: the model of
benchmarks/e2e.py of that name, its real gradients, the sparsification
policy's routes and the client's server partitions (each partition with its
own residual, as the engine keeps them). Every repeat is one training step's
gradients, compressed by both in turns whose order alternates.
"""
from __future__ import annotations

import argparse
import math
import statistics
import time

import torch

from adtopk_ps.compression import SparsificationPolicy, create, fibre_triton
from adtopk_ps.wire import payload_nbytes
from adtopk_ps.compression.staging import Stage
from adtopk_ps.wire.frames import payload_buffers

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
        nbytes = sum(payload_nbytes(comp.compress(x, "layer", next(step))) for _ in range(2)) // 2
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


# ---- whole gradient sets on a device (--device) ----

def _resnet50_shapes() -> list[tuple[int, ...]]:
    """ResNet-50's weight shapes, written out (torchvision's model where it is installed)."""
    shapes = [(64, 3, 7, 7)]
    inplanes = 64
    for planes, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for b in range(blocks):
            shapes += [(planes, inplanes, 1, 1), (planes, planes, 3, 3), (planes * 4, planes, 1, 1)]
            if b == 0:
                shapes.append((planes * 4, inplanes, 1, 1))
            inplanes = planes * 4
    return shapes + [(1000, 2048)]


def _vgg16_shapes() -> list[tuple[int, ...]]:
    shapes, cin = [], 3
    for cout in (64, 64, 128, 128, 256, 256, 256, 512, 512, 512, 512, 512, 512):
        shapes.append((cout, cin, 3, 3))
        cin = cout
    return shapes + [(4096, 25088), (4096, 4096), (1000, 4096)]


def _bert_base_shapes() -> list[tuple[int, ...]]:
    """BERT-base's matrices (the biases and norms are 1-D: the policy sends them dense)."""
    layer = [(768, 768)] * 4 + [(3072, 768), (768, 3072)]
    return [(30522, 768), (512, 768), (2, 768)] + layer * 12 + [(768, 768)]


def _torchvision_shapes(name: str) -> list[tuple[int, ...]] | None:
    try:
        import torchvision
    except ImportError:
        return None
    with torch.device("meta"):
        model = getattr(torchvision.models, name)()
    return [tuple(p.shape) for p in model.parameters()]


GRADIENT_SETS = {
    "resnet50": lambda: _torchvision_shapes("resnet50") or _resnet50_shapes(),
    "vgg16": lambda: _torchvision_shapes("vgg16") or _vgg16_shapes(),
    "bert-base": _bert_base_shapes,
    "tiny": lambda: [(64, 32, 3, 3), (128, 300), (96, 5000)],
    # benchmarks/gpu_check.sh --cpu-dry-run: small enough for Triton's interpreter
    "dry": lambda: [(256, 64), (64, 16, 4, 4)],
}


def sparsified(shapes: list[tuple[int, ...]], dtype: torch.dtype) -> list[tuple[int, ...]]:
    """The shapes the default policy sends sparse."""
    policy = SparsificationPolicy()
    return [s for s in shapes if not policy.is_dense(s, dtype)]


def _timed_on(device: torch.device, fn, budget_s: float) -> float:
    """Seconds per call with the device's queue drained before and after."""
    def call():
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return timed(call, budget_s, min_runs=2)


def references(grads: list[torch.Tensor], density: float) -> tuple[torch.Tensor, dict]:
    """What a gradient set's compression is measured against: reading its tensors once (one
    sum over their concatenation) and one global ``torch.topk`` of |x| over all of them at
    ``density``; the concatenation (made here, once, untimed) and the two calls.

    Example::

        flat, refs = references(grads, 0.01)
        refs["read"](); refs["topk"]()
    """
    flat = torch.cat([g.reshape(-1) for g in grads])
    k = max(1, math.floor(flat.numel() * density))
    return flat, {"read": lambda: flat.sum(), "topk": lambda: flat.abs().topk(k, sorted=False)}


def bench_set(name: str, device: torch.device, dtype: torch.dtype, density: float,
              budget_s: float) -> dict:
    """The references and ADTopk's costs over one gradient set, one run."""
    shapes = sparsified(GRADIENT_SETS[name](), dtype)
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(s, generator=gen).to(device, dtype) for s in shapes]
    flat, refs = references(grads, density)
    row = {"set": name, "numel": flat.numel(), "tensors": len(shapes),
           "read": _timed_on(device, refs["read"], budget_s),
           "topk": _timed_on(device, refs["topk"], budget_s)}
    plain = create("adtopk", ratio=density)
    row["compress"] = _timed_on(
        device, lambda: [plain.compress(g, f"t{i}") for i, g in enumerate(grads)], budget_s)
    ef = create({"compressor": "adtopk", "k": density, "ef": "vanilla"})

    def with_feedback():  # the bytes for the wire, in host memory
        for i, g in enumerate(grads):
            payload_buffers(ef.compress(g, f"t{i}"))
    row["ef_host"] = _timed_on(device, with_feedback, budget_s)
    row["batch"] = None
    if fibre_triton.applies(grads[0]):
        residuals = [torch.zeros_like(g) for g in grads]
        stage = Stage(device)
        ks = [max(1, math.floor(g.shape[1] * density)) for g in grads]
        items = [fibre_triton.Item(r, g, kk) for r, g, kk in zip(residuals, grads, ks)]
        row["batch"] = _timed_on(device, lambda: fibre_triton.select(items, stage), budget_s)
    return row


def set_table(rows: list[dict], device: torch.device, dtype: torch.dtype, density: float) -> str:
    out = [f"### Gradient sets on {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}), "
           f"{dtype}, density {density}, ms", "",
           "| gradient set | tensors | read once | global topk | ADTopk compress "
           "| ADTopk compress + EF + host bytes (per tensor) | / topk (goal <= 0.5) "
           "| / read (goal <= 10) | one fused call, + EF + host bytes (batched) | / topk | / read |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:  # the per-tensor and the batched path each against the goals, never mixed
        batch = ["-"] * 3 if r["batch"] is None else \
            [f"{r['batch'] * 1e3:.3f}", f"{r['batch'] / r['topk']:.2f}", f"{r['batch'] / r['read']:.1f}"]
        out.append(f"| {r['set']} ({r['numel'] / 1e6:.1f} M) | {r['tensors']} | {r['read'] * 1e3:.3f} "
                   f"| {r['topk'] * 1e3:.3f} | {r['compress'] * 1e3:.3f} | {r['ef_host'] * 1e3:.3f} "
                   f"| {r['ef_host'] / r['topk']:.2f} | {r['ef_host'] / r['read']:.1f} | "
                   + " | ".join(batch) + " |")
    return "\n".join(out)


def main_sets(device: torch.device, sets: list[str], dtype: torch.dtype, density: float,
              budget_s: float) -> None:
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible")
    kernel = "triton kernel" if fibre_triton.applies(torch.empty(1, 1, device=device)) else \
        "no triton kernel (select.py)"
    print(f"torch {torch.__version__}, {kernel}; mean time per call\n")
    rows = [bench_set(name, device, dtype, density, budget_s) for name in sets]
    print(set_table(rows, device, dtype, density), flush=True)


IN_JOB = ("adtopk", "topk")


def job_partitions(model: torch.nn.Module, ratio: float) -> list[tuple[str, str, slice, float]]:
    """What the job compresses each step: (layer, partition name, its rows, density) for every
    partition of every tensor the policy sends sparse, split as the client splits them."""
    from adtopk_ps.cluster.membership import DEFAULT_PARTITION_BYTES, part_name, partition_rows
    from adtopk_ps.core.env import env_int
    # the job's own setting, read as ClusterConfig reads it
    partition_bytes = env_int("BYTEPS_PARTITION_BYTES", DEFAULT_PARTITION_BYTES, minimum=1)
    routes = SparsificationPolicy(ratio).plan(model.named_parameters())
    parts = []
    for name, p in model.named_parameters():
        if routes[name].dense:
            continue
        for i, (start, rows) in enumerate(partition_rows(tuple(p.shape), p.element_size(),
                                                         partition_bytes)):
            parts.append((name, part_name(name, i), slice(start, start + rows), routes[name].ratio))
    return parts


def in_job(model_name: str, ratio: float, repeats: int, batch: int, clock=time.perf_counter) -> dict:
    """Seconds per step for each layer and compressor (one list entry per repeat), on real
    gradients of ``model_name`` (one SGD step between repeats, so the residuals evolve);
    ``clock`` is wall time or, on a loaded machine, this thread's CPU time."""
    from adtopk_ps.testing.systems import MODELS  # the e2e benchmark's, built as its workers build them
    from worker.models import build
    images = sorted(name for name, (_, _, inputs) in MODELS.items() if inputs == "images")
    if model_name not in images:
        raise SystemExit(f"--in-job takes one of benchmarks/e2e.py's image models {images}, "
                         f"got {model_name!r}")
    arch, spec, _ = MODELS[model_name]
    torch.manual_seed(0)
    model = build(arch, spec)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(batch, 3, 32, 32, generator=gen)
    y = torch.randint(0, 10, (batch,), generator=gen)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    parts = job_partitions(model, ratio)
    params = dict(model.named_parameters())
    comps = {c: create({"compressor": c, "k": ratio, "ef": "vanilla"}) for c in IN_JOB}
    times = {c: {layer: [] for layer, *_ in parts} for c in IN_JOB}
    sent = {c: {layer: [] for layer, *_ in parts} for c in IN_JOB}  # wire bytes per step
    for rep in range(repeats + 1):  # the first creates every residual, untimed
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        for c in IN_JOB if rep % 2 else IN_JOB[::-1]:
            spent = dict.fromkeys(times[c], 0.0)
            nbytes = dict.fromkeys(times[c], 0)
            for layer, part, rows, density in parts:
                grad = params[layer].grad[rows]
                started = clock()
                payload = comps[c].compress(grad, part, rep, density)
                spent[layer] += clock() - started
                nbytes[layer] += payload_nbytes(payload)
            if rep:
                for layer, s in spent.items():
                    times[c][layer].append(s)
                    sent[c][layer].append(nbytes[layer])
        opt.step()
    shapes = {layer: (tuple(params[layer].shape),
                      sorted({tuple(params[layer][rows].shape) for name, part, rows, _ in parts
                              if name == layer}))
              for layer, *_ in parts}
    return {"times": times, "sent": sent, "shapes": shapes, "partitions": len(parts)}


def spread(values: list[float]) -> str:
    """Median and range in ms."""
    return (f"{statistics.median(values) * 1e3:.2f} "
            f"({min(values) * 1e3:.2f}-{max(values) * 1e3:.2f})")


def in_job_table(model_name: str, ratio: float, found: dict, what: str) -> str:
    times, sent, shapes = found["times"], found["sent"], found["shapes"]
    a, t = IN_JOB
    out = [f"### In the job: {model_name}, density {ratio}, {found['partitions']} partitions, "
           f"{len(next(iter(times[a].values())))} steps", "",
           f"{what} ms per step, median (range); error feedback on; each partition keeps its "
           f"own residual; bytes are the payloads' wire bytes per step, mean over the steps",
           "", f"| layer | shape | partitions | {a} ms | {t} ms | {t} / {a} | {a} bytes | {t} bytes |",
           "|---|---|---|---:|---:|---:|---:|---:|"]
    for layer, (shape, seen) in shapes.items():
        ta, tt = times[a][layer], times[t][layer]
        out.append(f"| {layer} | {shape} | {', '.join(map(str, seen))} | {spread(ta)} | {spread(tt)} "
                   f"| {statistics.median(tt) / statistics.median(ta):.2f} "
                   f"| {statistics.mean(sent[a][layer]):,.0f} | {statistics.mean(sent[t][layer]):,.0f} |")
    total = {c: [sum(step) for step in zip(*times[c].values())] for c in IN_JOB}
    total_sent = {c: statistics.mean(sum(step) for step in zip(*sent[c].values())) for c in IN_JOB}
    ratios = [b / x for x, b in zip(total[a], total[t])]
    out.append(f"| total | | | {spread(total[a])} | {spread(total[t])} | "
               f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}) "
               f"| {total_sent[a]:,.0f} | {total_sent[t]:,.0f} |")
    out += ["", f"The total's ratio is per step ({t} over {a} on the same gradients), median (range)."]
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
    ap.add_argument("--device", help="time whole gradient sets on this device (cpu, cuda) instead")
    ap.add_argument("--sets", nargs="*", choices=sorted(GRADIENT_SETS),
                    default=["resnet50", "vgg16", "bert-base"], help="gradient sets for --device")
    ap.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32",
                    help="gradient dtype for --device")
    ap.add_argument("--in-job", metavar="MODEL",
                    help="instead: ADTopk against top-k on the partitions the job sends for this "
                         "model of benchmarks/e2e.py (vgg, vgg-2048, vgg-1024, resnet18)")
    ap.add_argument("--repeats", type=int, default=10, help="--in-job: steps timed")
    ap.add_argument("--batch", type=int, default=32, help="--in-job: batch size of the gradients")
    ap.add_argument("--cpu-time", action="store_true",
                    help="--in-job: time the thread's CPU seconds, not wall seconds (a loaded machine)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.device:
        main_sets(torch.device(args.device), args.sets, getattr(torch, args.dtype),
                  args.densities[0], args.budget)
        return
    if args.in_job:
        print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s)\n")
        for density in args.densities:
            clock = time.thread_time if args.cpu_time else time.perf_counter
            found = in_job(args.in_job, density, args.repeats, args.batch, clock)
            print(in_job_table(args.in_job, density, found, "CPU" if args.cpu_time else "wall"),
                  "\n", flush=True)
        return
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
