"""A model of one training step, for the scale study (benchmarks/scale.py): fit on the W=2
runs, validated on every run, and projected to large clusters.

A PS step without overlap is compute, compression, then communication:

    step = compute + compress + max(push, answer) + server + decode + fixed

* push: each worker sends its ``p`` bytes, a share ``p_j`` to server ``j``; server ``j``
  receives ``W p_j``, so the busier of the worker's and the busiest server's link sets it:
  ``max(p, W max_j p_j) / rate``.
* answer: the same for what comes back, whose size ``a`` is the answers' width (the union of
  the workers' selections): ``max(a, W max_j a_j) / rate``. Pushes go into a server and
  answers out of it, the two directions of its link, and a server answers each key as soon
  as its pushes are in: with a step's several keys, the two overlap, and the longer one
  sets the pace.
* Where the links are shaped by tbf (kernels without netem), each direction of a link that
  idled through compute and compression sends a bucket's worth ``F = min(burst, rate
  (compute + compress))`` at once: every link term above, and the ring's, is less ``F``.
  netem has no bucket but a delay (``hop``, one way).
* server: the busiest server's CPU per byte it takes in and sends, ``sigma W max_j (p_j + a_j)``,
  and with ``BYTEPS_SERVER_COMPRESSOR`` its top-k over its share of the sparsified
  elements, ``rho N_j``.
* decode: the worker's CPU per byte of answer, ``kappa a``.
* fixed: per-step costs that do not grow with bytes (one round trip, Python, keys), ``tau``.

A DDP step (torch DDP on gloo, one ring all-reduce of ``B`` bytes) is

    step = compute + 2 (W-1)/W B / rate + 2 (W-1) hop + tau_ring

``rate`` is the link's rate less TCP/IP/Ethernet headers; ``hop`` a one-way latency, the
configured netem delay in the measurement. ``sigma``, ``kappa``, ``rho``, ``tau`` and
``tau_ring`` are fit (least squares, non-negative) on the W=2 runs only; every run is then predicted
and the error shown. Compute and compression are taken from each run itself: on the
measuring machine W+S processes share a few cores, which slows both, and that sharing is
not what a cluster with a machine per role would see.

The projection takes compute, compression, the push and the constants from the W=2, S=1
runs, spreads keys over the servers as evenly as they go (no server carries less than the
largest key; ps-adtopk with keys of FINER_PARTITION_BYTES, where run, is held out of the
fit, and what its W=2 runs take beyond the model is added to its projected steps), and
grows the answer with W along the union measured on real gradients
(``benchmarks/union_density.py --json``): the run's own width up to the largest W
measured, then that curve's growth. Where the union passes half a tensor, the server sends
it dense. With ``BYTEPS_SERVER_COMPRESSOR`` the answer grows as ADTopk's union does up to
the width the servers hold it to, as its runs show it at their largest W: the density
(``topk:0.01``), or twice the pushes' width (``topk:2x``, which cuts nothing at W=2). The
runs at the density are in the fit; those at twice the pushes' width are held out of it,
as the finer keys' are.
"""
from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from adtopk_ps.cluster.membership import DEFAULT_PARTITION_BYTES

# bytes on the wire per byte of payload: a 1448-byte TCP segment (timestamps on) travels
# with 52 bytes of TCP/IP header and 14 of Ethernet
WIRE_OVERHEAD = (1448 + 52 + 14) / 1448
# bytes a sparse answer carries per element: a float32 value and an int32 position
COO_BYTES = 8
NETEM_HOP_S = 2 * 0.2e-3  # netns.hosts' links: 0.2 ms at the host's port and at the switch's
TBF_BURST_BYTES = 256 << 10  # adtopk_ps.testing.netns's tbf bucket
PROJECTED_HOP_S = 25e-6  # one way through a datacenter switch, TCP, assumed
RESPARSIFIED = "ps-adtopk+server-topk"  # the servers' answers at the density
WIDER = "ps-adtopk+server-2x"  # ... at twice the pushes' width
WIDEST = "ps-adtopk+server-4x"  # ... at four times: not run, projected from WIDER's runs
# the servers' re-sparsified answers, in pushes: a width of n pushes cuts from W > n
CAPPED = {RESPARSIFIED: 1.0, WIDER: 2.0, WIDEST: 4.0}
SPARSE_SYSTEMS = ["ps-topk", "ps-adtopk", RESPARSIFIED]  # the fit's, with DDP
PROJECT_WORKERS = [8, 16, 32, 64, 128, 256]
PROJECT_LINKS_GBIT = [1, 10, 25, 100]
NEAR_BEST = 1.05  # "servers needed": the fewest within this of one server per worker
FINER_PARTITION_BYTES = 256 << 10  # the second key size (BYTEPS_PARTITION_BYTES)
FINE_KEYS = "ps-adtopk+256k-keys"  # ps-adtopk with keys of FINER_PARTITION_BYTES


def rate_of(link: str) -> float:
    """Payload bytes per second a tc rate ("1gbit", "500mbit") carries."""
    units = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3}
    for unit, scale in units.items():
        if link.endswith(unit):
            return float(link[:-len(unit)]) * scale / 8 / WIRE_OVERHEAD
    raise ValueError(f"link {link!r}: expected a tc rate such as 1gbit")


@dataclass(frozen=True)
class Run:
    """What one stored run says, as the model needs it (per step, worker 0's)."""

    system: str
    workers: int
    servers: int
    step: float
    compute: float
    compress: float
    push: float  # bytes this worker pushed
    answer: float  # bytes it pulled
    busiest: float  # the busiest server's push + answer bytes, to or from this worker
    push_max: float  # the most it pushed to one server
    answer_max: float
    width: float | None  # the answers' share of the sparsified tensors' elements
    params: int
    sparse_elements: int  # elements of the tensors the system sparsifies (DDP: none)
    shaper: str  # how the links were shaped: "netem" or "tbf"
    link: str  # their tc rate
    cores: int  # the measuring machine's
    model: str  # benchmarks' MODELS name

    @classmethod
    def of(cls, record: dict) -> "Run":
        pushed = {int(s): n for s, n in record.get("pushed_per_step", {}).items()}
        pulled = {int(s): n for s, n in record.get("pulled_per_step", {}).items()}
        servers = set(pushed) | set(pulled)
        dense_share = record["dense"][2] if "dense" in record else 1.0
        return cls(record["system"], record["workers"], record["servers"], record["step_s"],
                   record["compute_s"], record.get("compress_s", 0.0), sum(pushed.values()),
                   sum(pulled.values()),
                   max((pushed.get(s, 0) + pulled.get(s, 0) for s in servers), default=0.0),
                   max(pushed.values(), default=0.0), max(pulled.values(), default=0.0),
                   record.get("answer_density"), record["params"],
                   round(record["params"] * (1 - dense_share)), record["shaper"], record["link"],
                   record["cores"], record["model"])

    @property
    def rate(self) -> float:
        return rate_of(self.link)


@dataclass(frozen=True)
class Constants:
    sigma: float  # server seconds per byte it takes in and sends
    kappa: float  # worker seconds per byte of answer
    rho: float  # server seconds per element it re-sparsifies
    tau: float  # seconds per PS step that no byte count explains
    tau_ring: float  # the same for a DDP step


def ps_terms(r: Run) -> tuple[float, list[float]]:
    """(what the model knows of a PS step, the coefficients of sigma, kappa, rho and tau)."""
    w, free, rate = r.workers, bucket(r), r.rate
    link = max(0.0, r.push - free, w * r.push_max - free,
               r.answer - free, w * r.answer_max - free) / rate
    # the busiest server's share of the sparsified elements, taken as its share of the push
    resparsified = r.sparse_elements * r.push_max / r.push if resparsifies(r.system, w) else 0.0
    return r.compute + r.compress + link + 2 * hop(r), [w * r.busiest, r.answer, resparsified, 1.0]


def bucket(r: Run) -> float:
    """Bytes a tbf-shaped link direction sends at once after idling through the compute."""
    return min(TBF_BURST_BYTES, r.rate * (r.compute + r.compress)) if r.shaper == "tbf" else 0.0


def hop(r: Run) -> float:
    return NETEM_HOP_S if r.shaper == "netem" else 0.0


def resparsifies(system: str, workers: int) -> bool:
    """Whether the servers re-sparsify the answers of ``workers``: a width of n pushes cuts
    only where more than n push."""
    return system in CAPPED and CAPPED[system] < workers


def ring_terms(r: Run) -> float:
    """What the model knows of a DDP step (all but tau_ring)."""
    w = r.workers
    sent = 2 * (w - 1) / w * 4 * r.params
    return r.compute + max(0.0, sent - bucket(r)) / r.rate + 2 * (w - 1) * hop(r)


def fit(runs: list[Run]) -> Constants:
    """sigma, kappa, rho and tau by non-negative least squares on the W=2 PS runs (of every
    link: the faster ones show the CPU's costs, the slower ones the links'); tau_ring as the
    mean residual of the W=2 DDP runs on the fastest link (on a slow one, a 1% error in the
    rate alone outweighs it)."""
    from scipy.optimize import nnls
    # (finer keys are held out: what they cost beyond the default's keys is what they test)
    ps = [r for r in runs if r.system in SPARSE_SYSTEMS and r.workers == 2]
    rows = [ps_terms(r) for r in ps]
    a = np.array([coef for _, coef in rows])
    b = np.array([r.step - known for r, (known, _) in zip(ps, rows)])
    (sigma, kappa, rho, tau), _ = nnls(a, b)
    ddp = [r for r in runs if r.system == "ddp-dense" and r.workers == 2]
    fastest = max((r.rate for r in ddp), default=None)
    ring = [r.step - ring_terms(r) for r in ddp if r.rate == fastest]
    return Constants(sigma, kappa, rho, tau, max(0.0, statistics.mean(ring)) if ring else 0.0)


def predict(r: Run, c: Constants) -> float:
    if r.system == "ddp-dense":
        return ring_terms(r) + c.tau_ring
    known, (busy, answer, resparsified, one) = ps_terms(r)
    return known + c.sigma * busy + c.kappa * answer + c.rho * resparsified + c.tau * one


# ---- the projection -------------------------------------------------------------------------

@dataclass(frozen=True)
class Profile:
    """One system's per-worker figures from the W=2, S=1 runs, and how its answer grows."""

    system: str
    compute: float
    compress: float
    push: float
    answer_fixed: float  # answer bytes that are not the union's (dense tensors, headers)
    sparse_elements: int  # elements of the sparsified tensors
    widths: dict[int, float]  # W -> the answers' width, measured up to the largest W run
    # the largest key's share of the sparsified elements: no server carries less, however
    # many there are
    floor: float
    # seconds per step beyond what the model fit on the default keys says (held-out runs,
    # such as finer keys: what their extra keys cost)
    extra: float = 0.0
    # the width re-sparsifying servers hold the answers to (``widths`` is then the union)
    cap: float | None = None


def largest_key_share(model: str, partition_bytes: int) -> float:
    """The largest key's share of a model's sparsified elements, as the client partitions its
    tensors (benchmarks' MODELS, the e2e systems' partial-sparsification policy)."""
    from adtopk_ps.cluster.membership import partition_rows
    from adtopk_ps.compression import SparsificationPolicy
    from adtopk_ps.testing.systems import MODELS
    from worker.models import build
    arch, spec, _ = MODELS[model]
    net = build(arch, spec)
    routes = SparsificationPolicy(0.01).plan(net.named_parameters())
    keys = [length * (t.numel() // t.shape[0] if t.dim() >= 2 else 1)
            for name, t in net.named_parameters() if not routes[name].dense
            for _, length in partition_rows(tuple(t.shape), t.element_size(), partition_bytes)]
    return max(keys) / sum(keys)


def profile(runs: list[Run], system: str, floor: float) -> Profile:
    base = [r for r in runs if r.system == system and r.workers == 2 and r.servers == 1]
    mine = [r for r in runs if r.system == system]
    widths = {w: statistics.mean(r.width for r in mine if r.workers == w)
              for w in sorted({r.workers for r in mine})}
    # the answer's bytes are COO_BYTES per element of the union, and a fixed part
    fixed = statistics.mean(r.answer - COO_BYTES * r.width * r.sparse_elements for r in mine)
    return Profile(system, statistics.mean(r.compute for r in base),
                   statistics.mean(r.compress for r in base), statistics.mean(r.push for r in base),
                   max(0.0, fixed), mine[0].sparse_elements, widths, floor)


def width_at(p: Profile, w: int, growth: dict[int, float] | None) -> float:
    """The answers' width at ``w`` workers: measured where run, else grown along ``growth``
    (W -> union on real gradients) from the largest W run; no wider than ``p.cap``."""
    if p.cap is not None:
        return min(p.cap, width_at(replace(p, cap=None), w, growth))
    if w in p.widths:
        return p.widths[w]
    top = max(p.widths)
    if growth is None or w not in growth or top not in growth:
        raise ValueError(f"no union growth known from W={top} to W={w}: run "
                         "benchmarks/union_density.py --json (see --union)")
    return p.widths[top] * growth[w] / growth[top]


def answer_bytes(p: Profile, width: float) -> float:
    """Sparse while the union is under half a tensor, dense (4 bytes an element) beyond."""
    return p.answer_fixed + p.sparse_elements * min(COO_BYTES * width, 4.0)


def project_ps(p: Profile, c: Constants, w: int, s: int, rate: float, width: float) -> float:
    a = answer_bytes(p, width)
    share = max(1 / s, p.floor)  # the busiest server's, with keys placed as evenly as they can be
    link = max(p.push, w * p.push * share, a, w * a * share) / rate
    resparsified = p.sparse_elements * share if resparsifies(p.system, w) else 0.0
    return p.compute + p.compress + link + c.sigma * w * (p.push + a) * share + c.kappa * a + \
        c.rho * resparsified + c.tau + p.extra + 2 * PROJECTED_HOP_S


def project_ring(compute: float, params: int, c: Constants, w: int, rate: float) -> float:
    return compute + 2 * (w - 1) / w * 4 * params / rate + 2 * (w - 1) * PROJECTED_HOP_S + c.tau_ring


def servers_needed(p: Profile, c: Constants, w: int, rate: float, width: float) -> tuple[int, float]:
    """The fewest servers (powers of two up to W) whose step is within NEAR_BEST of W servers',
    and that step."""
    best = project_ps(p, c, w, w, rate, width)
    s = 1
    while project_ps(p, c, w, s, rate, width) > NEAR_BEST * best:
        s *= 2
    return s, project_ps(p, c, w, s, rate, width)


# ---- the report ---------------------------------------------------------------------------

def spread(values: list[float]) -> str:
    return f"{1000 * statistics.mean(values):.0f} ({1000 * min(values):.0f}-{1000 * max(values):.0f})"


def report(records: list[dict], args: argparse.Namespace) -> str:
    runs = [Run.of(r) for r in records]
    c = fit(runs)
    params = runs[0].params
    links = sorted({r.link for r in runs}, key=rate_of)
    lines = ["# Scale: the step model, measured and projected", "",
             f"Made by `sudo python benchmarks/scale.py --link L` for L = {', '.join(links)}, then "
             f"`python benchmarks/scale.py --report` ({len(runs)} runs stored in "
             f"`{Path(args.results).name}`; {args.model}, {params / 1e6:.1f} M parameters, batch "
             f"{args.batch} per worker, density {args.ratio}). The model is "
             "benchmarks/step_model.py's. Times in ms: mean over the trials (lowest-highest).", "",
             "## Measured against the model", "",
             f"Fit on the W=2 runs of every link: server {c.sigma * 1e9:.2f} ns per byte, worker "
             f"{c.kappa * 1e9:.2f} ns per byte of answer, server re-sparsification "
             f"{c.rho * 1e9:.2f} ns per element, {1000 * c.tau:.2f} ms per PS step, "
             f"{1000 * c.tau_ring:.2f} ms per DDP step. \"per core\": the run's processes "
             "(workers, servers and the scheduler) over the measuring machine's cores.", ""]
    for link in links:
        lines += validation(link, [r for r in runs if r.link == link], c)
    lines += projection(runs, c, args)
    return "\n".join(lines)


def validation(link: str, runs: list[Run], c: Constants) -> list[str]:
    """The measured points of one link against the model, and how many it has within 15%."""
    lines = [f"### Links of {link} ({runs[0].shaper})", "",
             "| W | S | per core | system | step | model | error | compute | compress | push MB "
             "| answer MB | answer width | busiest server MB in+out |",
             "|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    errors = []
    for w, s, system in sorted({(r.workers, r.servers, r.system) for r in runs}):
        mine = [r for r in runs if (r.workers, r.servers, r.system) == (w, s, system)]
        steps = [r.step for r in mine]
        model = statistics.mean(predict(r, c) for r in mine)
        error = model / statistics.mean(steps) - 1
        errors.append(error)
        sparse = system != "ddp-dense"
        processes = w + (s + 1 if sparse else 0)
        lines.append(
            f"| {w} | {s if sparse else '-'} | {processes / mine[0].cores:.1f} | {system} | "
            f"{spread(steps)} | {1000 * model:.0f} | {error:+.0%} | {spread([r.compute for r in mine])} | "
            + (f"{1000 * statistics.mean(r.compress for r in mine):.0f} | "
               f"{statistics.mean(r.push for r in mine) / 1e6:.3f} | "
               f"{statistics.mean(r.answer for r in mine) / 1e6:.3f} | "
               f"{statistics.mean(r.width for r in mine):.4f} | "
               f"{w * statistics.mean(r.busiest for r in mine) / 1e6:.2f} |" if sparse
               else "- | - | - | - | - |"))
    within = sum(abs(e) <= 0.15 for e in errors)
    worst = max(errors, key=abs)
    return lines + ["", f"Within 15%: {within} of {len(errors)} points; the largest error {worst:+.0%}.", ""]


def profiles_of(runs: list[Run], c: Constants) -> dict[str, Profile]:
    """The projected systems: each sparse system measured, its keys the client's default
    partitions (re-sparsified answers held to the width their runs show at their largest W,
    and below it as wide as ps-adtopk's union; at four pushes' width, not run, held to twice
    the width of the 2x runs), and ps-adtopk again with
    FINER_PARTITION_BYTES (no server carries less than its largest key)."""
    model = runs[0].model
    default = largest_key_share(model, DEFAULT_PARTITION_BYTES)
    out = {s: profile(runs, s, default) for s in [*SPARSE_SYSTEMS, WIDER]
           if any(r.system == s for r in runs)}
    for name in set(CAPPED) & set(out):
        p = out[name]
        union = out["ps-adtopk"].widths if "ps-adtopk" in out else p.widths
        out[name] = replace(p, cap=p.widths[max(p.widths)], widths=union)
    if WIDER in out:  # twice as wide again: its answers' bytes are what the model knows of it
        p = out[WIDER]
        out[WIDEST] = replace(p, system=WIDEST, cap=p.cap * CAPPED[WIDEST] / CAPPED[WIDER])
    finer = largest_key_share(model, FINER_PARTITION_BYTES)
    measured = FINE_KEYS if any(r.system == FINE_KEYS and r.workers == 2 and r.servers == 1
                                for r in runs) else "ps-adtopk"
    if any(r.system == measured for r in runs):
        fine = profile(runs, measured, finer)
        held_out = [r.step - predict(r, c) for r in runs if r.system == FINE_KEYS and r.workers == 2]
        if held_out:
            fine = replace(fine, extra=statistics.mean(held_out))
        out[f"ps-adtopk, {FINER_PARTITION_BYTES >> 10} KiB keys"] = fine
    return out


def projected(runs: list[Run], c: Constants, profiles: dict[str, Profile], args: argparse.Namespace) -> dict:
    """(Gbit/s, W) -> system -> (step, servers, answer width), for every system the runs
    allow (a sparse system with no union curve beyond the W it ran, only up to there)."""
    growth = load_growth(Path(args.union), args.ratio) if Path(args.union).exists() else None
    params = runs[0].params
    compute = statistics.mean(r.compute for r in runs if r.workers == 2 and r.servers == 1)
    out: dict = {}
    for gbit in PROJECT_LINKS_GBIT:
        rate = rate_of(f"{gbit}gbit")
        for w in PROJECT_WORKERS:
            row = out[(gbit, w)] = {"ring all-reduce": (project_ring(compute, params, c, w, rate), None, None)}
            for name, p in profiles.items():
                try:
                    width = width_at(p, w, growth.get(p.system.split("+")[0]) if growth else None)
                except ValueError:
                    continue
                s, step = servers_needed(p, c, w, rate, width)
                row[name] = (step, s, width)
    return out


def projection(runs: list[Run], c: Constants, args: argparse.Namespace) -> list[str]:
    profiles = profiles_of(runs, c)
    found = projected(runs, c, profiles, args)
    systems = list(profiles)
    lines = ["## Projected", "",
             f"Each role on a machine of its own, links of 1-100 Gbit/s, {PROJECTED_HOP_S * 1e6:.0f} µs "
             "one way per hop. Every PS system has the servers it needs (the fewest, in powers "
             f"of two, within {NEAR_BEST - 1:.0%} of one server per worker; in brackets), with its keys "
             "placed as evenly as they go: no server carries less than the largest key "
             f"({', '.join(f'{n}: {p.floor:.0%}' for n, p in profiles.items())} of the sparsified "
             "elements). Step in ms, and against the ring all-reduce (DDP dense).", "",
             "| Gbit/s | W | ring all-reduce | " + " | ".join(systems) + " | fastest |",
             "|---:|---:|---:|" + "---:|" * len(systems) + "---|"]
    for (gbit, w), row in found.items():
        ring = row["ring all-reduce"][0]
        cells = [f"{1000 * row[n][0]:.0f} (S={row[n][1]}) {ring / row[n][0]:.2f}x" if n in row else "-"
                 for n in systems]
        best = min(row, key=lambda n: row[n][0])
        lines.append(f"| {gbit} | {w} | {1000 * ring:.0f} | " + " | ".join(cells) + f" | {best} |")
    lines += ["", "What the answer's growth costs: each sparse system's projected step with its "
              "answer as wide as the union at W, against the same step with the answer as wide "
              "as at W=2 (its servers as above).", "",
              "| Gbit/s | W | system | answer width | step | with W=2's width | growth costs |",
              "|---:|---:|---|---:|---:|---:|---:|"]
    for (gbit, w), row in found.items():
        for name in systems:
            p = profiles[name]
            if name not in row or p.cap is not None or 2 not in p.widths:
                continue
            step, s, width = row[name]
            narrow = project_ps(p, c, w, s, rate_of(f"{gbit}gbit"), p.widths[2])
            lines.append(f"| {gbit} | {w} | {name} | {width:.4f} | {1000 * step:.0f} | "
                         f"{1000 * narrow:.0f} | {step / narrow - 1:+.0%} |")
    chart(found, systems, Path(args.out) / "scale-model.png")
    return lines + ["", "![projected steps](scale-model.png)", ""]


def chart(found: dict, systems: list[str], path: Path) -> None:
    """Projected step against W, one panel per link; none (said so) without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        print(f"scale benchmark: no chart ({path.name}): matplotlib is not installed", flush=True)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    links = sorted({g for g, _ in found})
    fig, axes = plt.subplots(1, len(links), figsize=(4 * len(links), 3.8), sharey=False)
    for ax, gbit in zip(axes, links):
        for name in ["ring all-reduce", *systems]:
            points = [(w, row[name][0]) for (g, w), row in found.items() if g == gbit and name in row]
            if points:
                ax.plot([w for w, _ in points], [1000 * t for _, t in points], marker="o", label=name)
        ax.set(xscale="log", xlabel="workers", ylabel="step (ms)", title=f"{gbit} Gbit/s")
        ax.set_xticks(PROJECT_WORKERS, [str(w) for w in PROJECT_WORKERS])
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def load_growth(path: Path, density: float) -> dict[str, dict[int, float]]:
    """system ("ps-topk", "ps-adtopk") -> W -> union at ``density``, from union_density.py
    --json."""
    data = json.loads(path.read_text())
    if str(density) not in data:
        raise ValueError(f"{path}: no unions at density {density} (it has {sorted(data)})")
    return {f"ps-{name}": {int(w): u for w, u in curve.items()}
            for name, curve in data[str(density)].items()}

