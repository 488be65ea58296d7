"""The step model (benchmarks/step_model.py) projected to VGG-16, ResNet-50 and BERT-base on
8-256 GPU workers, and checked against the load generator's real servers.

Each worker is a host with a GPU, and a server beside it (``bpslaunch --colocate-servers``,
S = W, as BytePS deploys without spare machines): a host's link carries its worker's
pushes and answers and its server's. With ``p_j`` of a worker's push and ``a_j`` of its
answer on server ``j``, host ``j`` sends ``p - p_j + (W-1) a_j`` and receives
``(W-1) p_j + a - a_j`` (dense, balanced: ``2 (W-1)/W M`` each way, the all-reduce's bytes:
BytePS OSDI'20). Where keys go is the placement code's own (``adtopk_ps.cluster.placement``:
``plan`` at S servers, ``assign``, ``loads``): the busiest server's share of the bytes, and
its keys.

The systems, each step against DDP's overlapped ring (step_model.ring_step):
* ADTopk, answers as wide as the workers' union (union.json's ADTopk curve at the density,
  from one worker's width, grown as the Fashion-MNIST CNN's union grows at step 1500);
* ADTopk with ``BYTEPS_SERVER_COMPRESSOR=topk:2x``: answers no wider than two pushes, the
  servers' top-k over their share paid at ``rho`` an element;
* a dense PS (BytePS-style, colocated): every tensor dense, pushed as backward produces it
  (overlapped as the ring), its servers' sums and its workers' copies of the answers taken
  as free (memory speed), only their costs a push and a key counted: a bound in its favour;
* ADTopk with servers apart: the fewest servers (powers of two) within NEAR_BEST of W of
  them, on machines of their own, fewer keys;
* ADTopk as it would be with one message a server a step (issue 41's item 3, not built):
  ``chi`` and ``mu`` paid per message instead of per key.

The sparse PS steps are not overlapped with backward (the measured runs were not, and the
model is fit on them): a bound against them. Per worker: compute is ``3 x 2 x`` the model's
multiply-adds a sample (layer_profile) times ``--gpu-batch`` over ``--gpu-tflops``;
ADTopk with error feedback on the GPU reads and writes the gradient and residual
(GPU_PASSES passes of 4 bytes an element at GPU_BYTES_PER_S) plus the host's GPU_HOST_PER_TENSOR
a tensor (docs/gpu.md); the rest (keys, decoding, the servers) is this CPU's, as fit.
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import layer_profile  # noqa: E402
from step_model import COO_BYTES, Constants, rate_of, ring_step  # noqa: E402

from adtopk_ps.cluster.membership import DEFAULT_PARTITION_BYTES  # noqa: E402
from adtopk_ps.cluster.placement import Item, loads, plan, push_bytes  # noqa: E402
from adtopk_ps.core.dtypes import index_dtype  # noqa: E402

MODELS = ("vgg16", "resnet50", "bert-base")
PROJECT_WORKERS = [8, 16, 32, 64, 128, 256]
PROJECT_LINKS_GBIT = [10, 25, 100]
PROJECTED_HOP_S = 25e-6  # one way through a datacenter switch, TCP, assumed
NEAR_BEST = 1.05  # "servers apart": the fewest within this of W servers
GPU_BYTES_PER_S = 2e12  # an H100-class GPU's memory, as its kernels reach it (assumed)
GPU_PASSES = 4  # ADTopk with feedback: read gradient and residual, write the residual, select
GPU_HOST_PER_TENSOR = 20e-6  # docs/gpu.md: the host's share a tensor, about 20 us
PLAIN, WIDER, DENSE, APART, BATCHED, RING = (
    "ADTopk", "ADTopk, topk:2x", "dense PS", "ADTopk, servers apart",
    "ADTopk, a message a server (not built)", "ring (overlapped)")
ASKED = [RING, PLAIN, WIDER, DENSE]  # what docs/scale.md compares


@dataclass(frozen=True)
class Workload:
    """One model's per-worker figures, as the projection needs them."""

    name: str
    compute: float
    compress: float
    push: int  # bytes a worker's ADTopk push moves (sparse tensors at the density, the rest dense)
    dense_bytes: int  # of which the tensors the policy sends dense
    sparse_elements: int
    push_width: float  # the push's share of the sparse tensors' elements
    params: int
    ratio: float


def workload(model: str, ratio: float, batch: int, flops: float) -> Workload:
    """A projected model's workload on a GPU worker (see the module's docstring).

    Example::

        workload("bert-base", 0.01, 32, 30e12).compute   # about 0.07 s
    """
    tensors = layer_profile.tensors(model)
    sparse = [i for i in items(model, ratio) if i.weight < 4 * math.prod(i.shape)]
    kept = sum(push_bytes(i.shape, 4, ratio) // (4 + index_dtype(i.shape[1]).itemsize) for i in sparse)
    elements = sum(math.prod(i.shape) for i in sparse)
    push = sum(i.weight for i in items(model, ratio))
    dense = push - sum(i.weight for i in sparse)
    compute = 3 * 2 * sum(t.macs for t in tensors) * batch / flops
    compress = GPU_PASSES * 4 * elements / GPU_BYTES_PER_S + GPU_HOST_PER_TENSOR * len(sparse)
    return Workload(model, compute, compress, push, dense, elements, kept / elements,
                    sum(t.numel for t in tensors), ratio)


@functools.cache
def items(model: str, ratio: float | None) -> tuple[Item, ...]:
    """A model's tensors as the placement weighs them: ADTopk at ``ratio`` for those the
    policy sparsifies (benchmarks/placement.py's ``items``), every one dense for None."""
    from placement import items as weighed
    shapes = [t.shape for t in layer_profile.tensors(model)]
    if ratio is None:
        return tuple(Item(i, s, 4, 4 * math.prod(s)) for i, s in enumerate(shapes))
    return tuple(weighed(shapes, ratio))


@functools.cache
def placed(model: str, ratio: float | None, servers: int) -> tuple[int, float, int]:
    """(keys, the busiest server's share of the bytes, its keys) of the balanced placement
    at ``servers`` (``ratio`` None: every tensor dense)."""
    return placement_of(list(items(model, ratio)), servers)


def placement_of(entries: list[Item], servers: int) -> tuple[int, float, int]:
    p = plan(entries, servers, DEFAULT_PARTITION_BYTES)
    where = p.assign(servers)
    per = loads(p.weights, where, servers)
    busiest = max(range(servers), key=lambda j: per[j])
    return len(p.weights), per[busiest] / sum(per), sum(1 for j in where.values() if j == busiest)


def answer_bytes(wl: Workload, width: float) -> float:
    """Sparse while the union is under half a tensor, dense (4 bytes an element) beyond."""
    return wl.dense_bytes + wl.sparse_elements * min(COO_BYTES * width, 4.0)


def width_at(wl: Workload, w: int, growth: dict[int, float], cap: float | None = None) -> float:
    """The answers' width at ``w`` workers: one push's, grown along ``growth`` (W -> union)
    from one worker, held to ``cap`` pushes where the servers re-sparsify."""
    width = wl.push_width * growth[w] / growth[1]
    return min(width, cap * wl.push_width) if cap else width


@dataclass(frozen=True)
class Step:
    """A projected step and its parts (seconds)."""

    total: float
    servers: int
    link: float
    worker_cpu: float  # keys and decoding, overlapping the link
    server: float
    width: float | None = None


def project_ps(wl: Workload, c: Constants, w: int, s: int, rate: float, width: float,
               resparsify: bool = False, batched: bool = False) -> Step:
    """A sparse PS step (step_model.ps_step's terms): colocated where ``s == w`` and not
    ``apart``-ed by the caller, else on servers of their own."""
    keys, share, busiest_keys = placed(wl.name, wl.ratio, s)
    p, a = wl.push, answer_bytes(wl, width)
    if s == w:  # a server beside every worker: host j's two directions
        link = max(p * (1 - share) + (w - 1) * a * share, (w - 1) * p * share + a * (1 - share))
    else:
        link = max(p, a, w * p * share, w * a * share)
    messages = min(keys, s) if batched else keys
    received = w * (1 if batched else busiest_keys)
    server = (c.sigma * w * (p + a) * share + c.mu * received +
              (c.rho * wl.sparse_elements * share if resparsify else 0.0))
    worker = c.chi * messages + c.kappa * a
    total = wl.compute + wl.compress + max(link / rate, worker) + 2 * PROJECTED_HOP_S + server + c.tau
    return Step(total, s, link / rate, worker, server, width)


def project_apart(wl: Workload, c: Constants, w: int, rate: float, width: float) -> Step:
    """ADTopk on servers of their own: the fewest (powers of two below W) within NEAR_BEST
    of W colocated ones' step."""
    best = project_ps(wl, c, w, w, rate, width).total
    s = 1
    while s < w and project_ps(wl, c, w, s, rate, width).total > NEAR_BEST * best:
        s *= 2
    return project_ps(wl, c, w, s, rate, width) if s < w else project_ps(wl, c, w, w, rate, width)


def project_dense(wl: Workload, c: Constants, w: int, rate: float) -> Step:
    """The dense PS, colocated: every tensor's bytes cross the busiest host's link as
    backward produces them (as the ring's buckets, with the host's share of the bytes in
    place of the ring's 2(W-1)/W), then its keys' costs; no server sums or copies (free)."""
    keys, share, busiest_keys = placed(wl.name, None, w)
    factor = (1 - share) + (w - 1) * share  # host bytes each way per byte of the model
    ring_factor = 2 * (w - 1) / w
    # ring_step sends 2(W-1)/W of each bucket: scale the rate so that it sends ``factor``
    end = ring_step(layer_profile.tensors(wl.name), wl.compute, w, rate * ring_factor / factor,
                    PROJECTED_HOP_S / (2 * (w - 1)) if w > 1 else 0.0)
    server = c.mu * w * busiest_keys
    worker = c.chi * keys
    total = max(end, wl.compute + worker) + server + c.tau
    return Step(total, w, end - wl.compute, worker, server)


def project_ring(wl: Workload, c: Constants, w: int, rate: float) -> Step:
    end = ring_step(layer_profile.tensors(wl.name), wl.compute, w, rate, PROJECTED_HOP_S)
    return Step(end + c.tau_ring, 0, end - wl.compute, 0.0, 0.0)


def project(wl: Workload, c: Constants, w: int, gbit: float, growth: dict[int, float]) -> dict[str, Step]:
    """Every system's projected step at ``w`` workers on links of ``gbit``."""
    rate = rate_of(f"{gbit}gbit")
    width = width_at(wl, w, growth)
    capped = width_at(wl, w, growth, cap=2.0)
    return {RING: project_ring(wl, c, w, rate),
            PLAIN: project_ps(wl, c, w, w, rate, width),
            WIDER: project_ps(wl, c, w, w, rate, capped, resparsify=w > 2),
            DENSE: project_dense(wl, c, w, rate),
            APART: project_apart(wl, c, w, rate, width),
            BATCHED: project_ps(wl, c, w, w, rate, width, batched=True)}


def load_growth(path: Path, density: float, compressor: str = "adtopk") -> dict[int, float]:
    """W -> ``compressor``'s union at ``density``, from union_density.py --json."""
    data = json.loads(path.read_text())
    if str(density) not in data:
        raise ValueError(f"{path}: no unions at density {density} (it has {sorted(data)})")
    return {int(w): u for w, u in data[str(density)][compressor].items()}


# ---- the report ---------------------------------------------------------------------------

def projection(c: Constants, args: argparse.Namespace) -> list[str]:
    if not Path(args.union).exists():
        return ["## Projected: VGG-16, ResNet-50 and BERT-base on GPU workers", "",
                f"No union curve ({Path(args.union).name}: `python benchmarks/union_density.py "
                f"--json {args.union}`): the answers' growth past the runs' W cannot be projected.", ""]
    growth = load_growth(Path(args.union), args.ratio)
    loads_ = {m: workload(m, args.ratio, args.gpu_batch, args.gpu_tflops) for m in MODELS}
    found = {(m, g, w): project(wl, c, w, g, growth) for m, wl in loads_.items()
             for g in PROJECT_LINKS_GBIT for w in PROJECT_WORKERS}
    lines = ["## Projected: VGG-16, ResNet-50 and BERT-base on GPU workers", "",
             f"A GPU worker a host, {PROJECTED_HOP_S * 1e6:.0f} µs one way per hop; a server beside "
             f"each (S = W) but in \"{APART}\". Batch {args.gpu_batch} a worker at "
             f"{args.gpu_tflops / 1e12:.0f} TFLOP/s (forward and backward: 6 x the multiply-adds); "
             f"ADTopk at density {args.ratio} on the GPU; keys placed by the placement code. Step in "
             "ms and against the ring (DDP, overlapped); servers in brackets where apart.", "",
             "| model | params M | compute ms | compress ms | push MB | keys at S=64 / 256 |",
             "|---|---:|---:|---:|---:|---|"]
    for m, wl in loads_.items():
        lines.append(f"| {m} | {wl.params / 1e6:.1f} | {1000 * wl.compute:.1f} | "
                     f"{1000 * wl.compress:.1f} | {wl.push / 1e6:.2f} | "
                     f"{placed(m, args.ratio, 64)[0]} / {placed(m, args.ratio, 256)[0]} |")
    systems = [PLAIN, WIDER, DENSE, APART, BATCHED]
    for m in MODELS:
        lines += ["", f"### {m}", "",
                  "| Gbit/s | W | answer width | " + " | ".join([RING, *systems]) + " | fastest of the four |",
                  "|---:|---:|---:|" + "---:|" * (1 + len(systems)) + "---|"]
        for g in PROJECT_LINKS_GBIT:
            for w in PROJECT_WORKERS:
                row = found[(m, g, w)]
                ring = row[RING].total
                cells = [f"{1000 * row[n].total:.0f}" + (f" (S={row[n].servers})" if n == APART else "")
                         + f" {ring / row[n].total:.2f}x" for n in systems]
                best = min(ASKED, key=lambda n: row[n].total)
                lines.append(f"| {g} | {w} | {row[PLAIN].width:.3f} | {1000 * ring:.0f} | "
                             + " | ".join(cells) + f" | {best} |")
    lines += ["", "Where the time goes, at 64 and 256 workers (ms: link, the worker's keys and "
              "decoding beside it, the busiest server's CPU):", "",
              "| model | Gbit/s | W | system | step | link | worker CPU | server CPU |",
              "|---|---:|---:|---|---:|---:|---:|---:|"]
    for m in MODELS:
        for g in (10, 25):
            for w in [w for w in (64, 256) if w in PROJECT_WORKERS]:
                for n in (PLAIN, WIDER, BATCHED):
                    st = found[(m, g, w)][n]
                    lines.append(f"| {m} | {g} | {w} | {n} | {1000 * st.total:.0f} | {1000 * st.link:.0f} | "
                                 f"{1000 * st.worker_cpu:.0f} | {1000 * st.server:.0f} |")
    chart(found, Path(args.out) / "scale-model.png")
    return lines + ["", "![projected steps](scale-model.png)", ""]


def chart(found: dict, path: Path) -> None:
    """Projected step against W, a panel per model and link; none (said so) without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        print(f"scale benchmark: no chart ({path.name}): matplotlib is not installed", flush=True)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    links = [g for g in PROJECT_LINKS_GBIT if g <= 25]
    fig, axes = plt.subplots(len(links), len(MODELS), figsize=(4 * len(MODELS), 3.4 * len(links)), squeeze=False)
    for r, g in enumerate(links):
        for col, m in enumerate(MODELS):
            ax = axes[r][col]
            for name in [*ASKED, BATCHED]:
                ax.plot(PROJECT_WORKERS, [1000 * found[(m, g, w)][name].total for w in PROJECT_WORKERS],
                        marker="o", label=name)
            ax.set(xscale="log", yscale="log", xlabel="workers", ylabel="step (ms)", title=f"{m}, {g} Gbit/s")
            ax.set_xticks(PROJECT_WORKERS, [str(w) for w in PROJECT_WORKERS])
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def loadgen_check(path: Path, c: Constants, union: Path, ratio: float) -> list[str]:
    """The load generator's balanced runs against the model's server side: the busiest
    server's bytes a round (placement and union growth, predicted from neither run), the
    answers' density, and the busiest server's CPU a round (sigma and mu, fit on these runs:
    a check of the form, not of the constants)."""
    if not path.exists():
        return ["## The load generator's servers against the model", "",
                f"No figures yet ({path.name}: `python benchmarks/loadgen.py --json {path}`).", ""]
    if not union.exists():
        return ["## The load generator's servers against the model", "",
                f"No union curve ({union.name}: `python benchmarks/union_density.py --json "
                f"{union}`): the answers' growth cannot be predicted.", ""]
    data = json.loads(path.read_text())
    growth = load_growth(union, data["ratio"])
    shapes = {n: tuple(s) for n, s in data["shapes"].items()}
    entries = [Item(i, s, 4, push_bytes(s, 4, data["ratio"])) for i, s in enumerate(shapes.values())]
    elements = sum(math.prod(s) for s in shapes.values())
    kept = sum(push_bytes(s, 4, data["ratio"]) // (4 + index_dtype(s[1]).itemsize) for s in shapes.values())
    push = sum(e.weight for e in entries)
    lines = ["## The load generator's servers against the model", "",
             f"`python benchmarks/loadgen.py --json {path.name}`: real servers under W synthetic "
             f"workers replaying ADTopk pushes of {', '.join(shapes)} (step {data['at']} of "
             f"{data['config']}), balanced placement. Model: the placement code's busiest share "
             "and keys, the answers as wide as union.json's union grown from one push, "
             "the CPU from sigma and mu. Medians over the repeats.", "",
             "| W | S | busiest MB a round | model | error | answer density | model | error "
             "| busiest CPU ms a round | model | error |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    errors = []
    for row in data["rows"]:
        if row["placement"] != "balanced":
            continue
        w, s = row["workers"], row["servers"]
        _, share, busiest_keys = placement_of(entries, s)
        width = kept / elements * growth[w] / growth[1]
        answer = elements * min(COO_BYTES * width, 4.0)
        model_bytes = w * (push + answer) * share
        model_cpu = c.sigma * model_bytes + c.mu * w * busiest_keys
        got_bytes = statistics.median(max(p["in"] + p["out"] for p in r["per_server"]) for r in row["runs"])
        got_cpu = statistics.median(max(p["cpu_s"] for p in r["per_server"]) for r in row["runs"])
        got_density = statistics.median(r["density"] for r in row["runs"])
        trio = [model_bytes / got_bytes - 1, width / got_density - 1, model_cpu / got_cpu - 1]
        errors += trio
        lines.append(f"| {w} | {s} | {got_bytes / 1e6:.2f} | {model_bytes / 1e6:.2f} | {trio[0]:+.0%} | "
                     f"{got_density:.4f} | {width:.4f} | {trio[1]:+.0%} | {1000 * got_cpu:.1f} | "
                     f"{1000 * model_cpu:.1f} | {trio[2]:+.0%} |")
    if errors:
        lines += ["", f"Within 15%: {sum(abs(e) <= 0.15 for e in errors)} of {len(errors)}; the "
                  f"largest error {max(errors, key=abs):+.0%}."]
    return lines + [""]
