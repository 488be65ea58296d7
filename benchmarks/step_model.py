"""A model of one training step, for the scale study (benchmarks/scale.py): fit on the W=2
runs, checked on every run and on the load generator's servers, and projected to large
clusters (benchmarks/scale_projection.py).

A PS step without overlap is compute, compression, then communication:

    step = compute + compress + max(link, keys chi + kappa a) + server + fixed

* link: each worker sends its ``p`` bytes, a share ``p_j`` to server ``j``; server ``j``
  receives ``W p_j``, so the busier of the worker's and the busiest server's link sets it,
  ``max(p, W max_j p_j)``; the same for the answers, of ``a`` bytes (the answers' width is
  the union of the workers' selections). Pushes go into a server and answers out of it, the
  two directions of its link, and a server answers each key as soon as its pushes are in:
  the longer direction sets the pace. Over ``rate``, plus one hop each way.
* the worker's own work while its bytes travel: the engine's Python for each key (``chi``)
  and decoding the answers (``kappa`` per byte). It runs while the link carries the other
  keys, so the longer of the two sets the pace (with the sum, the finer keys' runs at
  100 Mbit/s were 30-40% high: their extra keys' Python hides behind the link there).
* server: the busiest server's CPU, ``sigma`` per byte it takes in and sends and ``mu`` per
  push it receives, and with ``BYTEPS_SERVER_COMPRESSOR`` its top-k over its share of the
  sparsified elements, ``rho`` each. ``sigma`` and ``mu`` come from the load generator's
  real servers under 16-64 workers (benchmarks/loadgen.py --json), where it has run;
  otherwise ``sigma`` is fit with the rest and ``mu`` is 0.
* Where the links are shaped by tbf (kernels without netem), each direction of a link that
  idled through compute and compression sends a bucket's worth ``F = min(burst, rate
  (compute + compress))`` at once: every link term is less ``F``. netem has no bucket but a
  delay (``hop``, one way).
* fixed: per-step costs that do not grow with bytes or keys, ``tau``.

A DDP step (torch DDP on gloo) all-reduces its gradient in buckets (1 MiB first, then
25 MiB, in reverse parameter order), each starting once backward has produced it and the
bucket before it is done; backward is taken as two thirds of compute, its time spent on
each weight in proportion to that weight's multiply-adds (benchmarks/layer_profile.py), so a
bucket of a model's last layers goes out while the first ones are still differentiated. A
bucket takes ``2 (W-1)/W B / rate + 2 (W-1) hop``; the step ends when both backward and the
last bucket are done, plus ``tau_ring``.

``rate`` is the link's rate less TCP/IP/Ethernet headers. ``kappa``, ``rho``, ``tau``, ``chi``
(and ``sigma`` without the load generator) are fit (least squares on the relative errors,
non-negative) on the W=2 runs only, the finer keys' included (they are what shows ``chi``);
``tau_ring`` on the W=2 DDP runs of the fastest link. Every run is then predicted and the
error shown. Compute and compression are taken from each run itself: on the measuring
machine W+S processes share two cores, which slows both; a point whose workers' compute ran
more than SATURATED times as long as in its link's W=2, S=1 runs had its CPU saturated, and
the report says so beside it (its CPU work waited for cores that a cluster's would not).
"""
from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from adtopk_ps.cluster.membership import DEFAULT_PARTITION_BYTES

# bytes on the wire per byte of payload: a 1448-byte TCP segment (timestamps on) travels
# with 52 bytes of TCP/IP header and 14 of Ethernet
WIRE_OVERHEAD = (1448 + 52 + 14) / 1448
# bytes a sparse answer carries per element: a float32 value and an int32 position
COO_BYTES = 8
NETEM_HOP_S = 2 * 0.2e-3  # netns.hosts' links: 0.2 ms at the host's port and at the switch's
TBF_BURST_BYTES = 256 << 10  # adtopk_ps.testing.netns's tbf bucket
RESPARSIFIED = "ps-adtopk+server-topk"  # the servers' answers at the density
WIDER = "ps-adtopk+server-2x"  # ... at twice the pushes' width
# the servers' re-sparsified answers, in pushes: a width of n pushes cuts from W > n
CAPPED = {RESPARSIFIED: 1.0, WIDER: 2.0}
SPARSE_SYSTEMS = ["ps-topk", "ps-adtopk", RESPARSIFIED]
FINER_PARTITION_BYTES = 256 << 10  # the second key size (BYTEPS_PARTITION_BYTES)
FINE_KEYS = "ps-adtopk+256k-keys"  # ps-adtopk with keys of FINER_PARTITION_BYTES
FITTED = [*SPARSE_SYSTEMS, FINE_KEYS]  # the fit's PS systems (WIDER is held out)
SATURATED = 1.3  # a run's compute over its link's W=2, S=1 compute past which its CPU was
DDP_FIRST_BUCKET = 1 << 20  # torch DDP's first bucket, and the rest's cap (bucket_cap_mb=25)
DDP_BUCKET = 25 << 20
BACKWARD_SHARE = 2 / 3  # of forward + backward


def rate_of(link: str) -> float:
    """Payload bytes per second a tc rate ("1gbit", "500mbit") carries."""
    units = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3}
    for unit, scale in units.items():
        if link.endswith(unit):
            return float(link[:-len(unit)]) * scale / 8 / WIRE_OVERHEAD
    raise ValueError(f"link {link!r}: expected a tc rate such as 1gbit")


@functools.cache
def key_count(model: str, partition_bytes: int) -> int:
    """The keys a worker pushed each step in the stored runs: every parameter in byteps'
    partitions of ``partition_bytes`` (the runs predate the balanced placement)."""
    from adtopk_ps.cluster.membership import partition_rows
    from adtopk_ps.testing.systems import MODELS
    from worker.models import build
    arch, spec, _ = MODELS[model]
    return sum(len(partition_rows(tuple(t.shape), t.element_size(), partition_bytes))
               for t in build(arch, spec).parameters())


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
    keys: int  # keys this worker pushed a step

    @classmethod
    def of(cls, record: dict) -> "Run":
        pushed = {int(s): n for s, n in record.get("pushed_per_step", {}).items()}
        pulled = {int(s): n for s, n in record.get("pulled_per_step", {}).items()}
        servers = set(pushed) | set(pulled)
        dense_share = record["dense"][2] if "dense" in record else 1.0
        keys = record.get("keys")
        if keys is None and record["system"] != "ddp-dense":
            keys = key_count(record["model"], FINER_PARTITION_BYTES if record["system"] == FINE_KEYS
                             else DEFAULT_PARTITION_BYTES)
        return cls(record["system"], record["workers"], record["servers"], record["step_s"],
                   record["compute_s"], record.get("compress_s", 0.0), sum(pushed.values()),
                   sum(pulled.values()),
                   max((pushed.get(s, 0) + pulled.get(s, 0) for s in servers), default=0.0),
                   max(pushed.values(), default=0.0), max(pulled.values(), default=0.0),
                   record.get("answer_density"), record["params"],
                   round(record["params"] * (1 - dense_share)), record["shaper"], record["link"],
                   record["cores"], record["model"], keys or 0)

    @property
    def rate(self) -> float:
        return rate_of(self.link)


@dataclass(frozen=True)
class Constants:
    sigma: float  # server seconds per byte it takes in and sends
    mu: float  # server seconds per push it receives
    kappa: float  # worker seconds per byte of answer
    rho: float  # server seconds per element it re-sparsifies
    tau: float  # seconds per PS step that no byte or key count explains
    chi: float  # worker seconds per key a step
    tau_ring: float  # the same as tau for a DDP step
    server_from: str = "fit"  # where sigma and mu came from


@dataclass(frozen=True)
class ServerCost:
    """sigma and mu as the load generator measured them (benchmarks/loadgen.py --json)."""

    sigma: float
    mu: float
    source: str

    @classmethod
    def load(cls, path: Path) -> "ServerCost | None":
        if not path.exists():
            return None
        data = json.loads(path.read_text())
        if "fit" in data:
            fitted = data["fit"]
        else:  # the load generator's own fit over every server of every run stored
            from loadgen import fit as server_fit
            fitted = server_fit([p for row in data["rows"] for r in row["runs"] for p in r["per_server"]])
        return cls(fitted["sigma_s_per_byte"], fitted["mu_s_per_push"], path.name)


def link_seconds(r: Run) -> float:
    """The busier direction of the busier link, less a tbf bucket, over the rate."""
    w, free = r.workers, bucket(r)
    return max(0.0, r.push - free, w * r.push_max - free,
               r.answer - free, w * r.answer_max - free) / r.rate


def bucket(r: Run) -> float:
    """Bytes a tbf-shaped link direction sends at once after idling through the compute."""
    return min(TBF_BURST_BYTES, r.rate * (r.compute + r.compress)) if r.shaper == "tbf" else 0.0


def hop(r: Run) -> float:
    return NETEM_HOP_S if r.shaper == "netem" else 0.0


def resparsifies(system: str, workers: int) -> bool:
    """Whether the servers re-sparsify the answers of ``workers``: a width of n pushes cuts
    only where more than n push."""
    return system in CAPPED and CAPPED[system] < workers


def ps_step(r: Run, c: Constants) -> float:
    """The model's PS step for a measured run (see the module's docstring)."""
    share = r.push_max / r.push if r.push else 1.0  # the busiest server's, keys and elements
    resparsified = r.sparse_elements * share if resparsifies(r.system, r.workers) else 0.0
    server = c.sigma * r.workers * r.busiest + c.mu * r.workers * r.keys * share + c.rho * resparsified
    return (r.compute + r.compress + max(link_seconds(r), c.chi * r.keys + c.kappa * r.answer)
            + 2 * hop(r) + server + c.tau)


def ring_step(tensors: list, compute: float, w: int, rate: float, hop_s: float,
              free: float = 0.0) -> float:
    """Forward, then backward with DDP's buckets all-reduced as they become ready (see the
    module's docstring), less ``free`` bytes a tbf bucket sends at once; ``tensors`` are
    layer_profile.Tensor in forward order. Without tau_ring.

    Example::

        ring_step(layer_profile.tensors("vgg16"), 0.1, 64, rate_of("10gbit"), 25e-6)
    """
    forward = compute * (1 - BACKWARD_SHARE)
    backward = compute - forward
    total = sum(t.macs for t in tensors) or 1.0
    clock, buckets, size, cap = forward, [], 0, DDP_FIRST_BUCKET
    for t in reversed(tensors):
        clock += backward * t.macs / total
        size += 4 * t.numel
        if size >= cap:
            buckets.append((clock, size))
            size, cap = 0, DDP_BUCKET
    if size:
        buckets.append((clock, size))
    end = forward
    for ready, nbytes in buckets:
        sent = max(0.0, 2 * (w - 1) / w * nbytes - free)
        free = max(0.0, free - 2 * (w - 1) / w * nbytes)
        end = max(ready, end) + sent / rate + 2 * (w - 1) * hop_s
    return max(end, forward + backward)


@functools.cache
def measured_tensors(model: str) -> list:
    from layer_profile import measured
    return measured(model)


def ddp_step(r: Run) -> float:
    return ring_step(measured_tensors(r.model), r.compute, r.workers, r.rate, hop(r), bucket(r))


def predict(r: Run, c: Constants) -> float:
    return ddp_step(r) + c.tau_ring if r.system == "ddp-dense" else ps_step(r, c)


def fit(runs: list[Run], server: ServerCost | None = None) -> Constants:
    """kappa, rho, tau and chi (and sigma without ``server``) by least squares on the relative
    errors of the W=2 PS runs of every link (the faster ones show the CPU's costs, the slower
    ones the links'), non-negative; tau_ring as the mean residual of the W=2 DDP runs on the
    fastest link (on a slow one, a 1% error in the rate alone outweighs it)."""
    from scipy.optimize import least_squares
    ps = [r for r in runs if r.system in FITTED and r.workers == 2]
    scale = np.array([1e-9, 1e-9, 1e-3, 1e-4, 1e-9])

    def constants(x: np.ndarray) -> Constants:
        kappa, rho, tau, chi, sigma = x * scale
        if server:
            return Constants(server.sigma, server.mu, kappa, rho, tau, chi, 0.0, server.source)
        return Constants(sigma, 0.0, kappa, rho, tau, chi, 0.0)

    x0 = np.array([2.0, 1.0, 5.0, 3.0, 0.5])
    solved = least_squares(lambda x: [ps_step(r, constants(x)) / r.step - 1 for r in ps], x0,
                           bounds=(0, np.inf), xtol=1e-12, ftol=1e-12, gtol=1e-12)
    c = constants(solved.x)
    ddp = [r for r in runs if r.system == "ddp-dense" and r.workers == 2]
    fastest = max((r.rate for r in ddp), default=None)
    ring = [r.step - ddp_step(r) for r in ddp if r.rate == fastest]
    return Constants(**{**c.__dict__, "tau_ring": max(0.0, statistics.mean(ring)) if ring else 0.0})


# ---- the report ---------------------------------------------------------------------------

def spread(values: list[float]) -> str:
    return f"{1000 * statistics.mean(values):.0f} ({1000 * min(values):.0f}-{1000 * max(values):.0f})"


def report(records: list[dict], args: argparse.Namespace) -> str:
    """The whole report: the fit, every measured point against it, the load generator's
    servers against it, and the projection (scale_projection.py)."""
    import scale_projection
    runs = [Run.of(r) for r in records]
    server = ServerCost.load(Path(args.loadgen))
    c = fit(runs, server)
    params = runs[0].params
    links = sorted({r.link for r in runs}, key=rate_of)
    origin = (f"from the load generator ({c.server_from}, `python benchmarks/loadgen.py --json "
              f"docs/loadgen.json`)" if server else "fit with the rest (no load generator figures)")
    lines = ["# Scale: the step model, measured and projected", "",
             f"Made by `sudo python benchmarks/scale.py --link L` for L = {', '.join(links)}, then "
             f"`python benchmarks/scale.py --report` ({len(runs)} runs stored in "
             f"`{Path(args.results).name}`; {args.model}, {params / 1e6:.1f} M parameters, batch "
             f"{args.batch} per worker, density {args.ratio}). The model is "
             "benchmarks/step_model.py's, its projection benchmarks/scale_projection.py's. Times "
             "in ms: mean over the trials (lowest-highest).", "",
             "## Measured against the model", "",
             f"Server CPU {origin}: {c.sigma * 1e9:.2f} ns per byte in and out and "
             f"{c.mu * 1e6:.1f} µs per push received. Fit on the W=2 runs of every link: worker "
             f"{c.kappa * 1e9:.2f} ns per byte of answer, {c.chi * 1e3:.3f} ms per key, server "
             f"re-sparsification {c.rho * 1e9:.2f} ns per element, {1000 * c.tau:.2f} ms per PS "
             f"step, {1000 * c.tau_ring:.2f} ms per DDP step. \"per core\": the run's processes "
             "(workers, servers and the scheduler) over the measuring machine's cores; "
             f"\"slowed\": its compute over its link's W=2, S=1 compute, and \"saturated\" past "
             f"{SATURATED}x: the workers' own forward and backward waited for cores, and so did "
             "every other CPU term.", ""]
    for link in links:
        lines += validation(link, [r for r in runs if r.link == link], runs, c)
    lines += scale_projection.loadgen_check(Path(args.loadgen), c, Path(args.union), args.ratio)
    lines += scale_projection.projection(c, args)
    return "\n".join(lines)


def slowdown(points: list[Run], runs: list[Run]) -> float:
    """A point's compute over the W=2, S=1 compute of its link (every system's)."""
    alone = [r.compute for r in runs if r.link == points[0].link and r.workers == 2 and r.servers == 1]
    return statistics.mean(r.compute for r in points) / statistics.mean(alone)


def validation(link: str, mine: list[Run], runs: list[Run], c: Constants) -> list[str]:
    """The measured points of one link against the model, and how many it has within 15%
    where the CPU was not saturated, and where it was."""
    lines = [f"### Links of {link} ({mine[0].shaper})", "",
             "| W | S | per core | slowed | system | step | model | error | compute | compress "
             "| push MB | answer MB | answer width | busiest server MB in+out |",
             "|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    errors = {True: [], False: []}
    for w, s, system in sorted({(r.workers, r.servers, r.system) for r in mine}):
        points = [r for r in mine if (r.workers, r.servers, r.system) == (w, s, system)]
        steps = [r.step for r in points]
        model = statistics.mean(predict(r, c) for r in points)
        error = model / statistics.mean(steps) - 1
        slowed = slowdown(points, runs)
        errors[slowed > SATURATED].append(error)
        sparse = system != "ddp-dense"
        processes = w + (s + 1 if sparse else 0)
        lines.append(
            f"| {w} | {s if sparse else '-'} | {processes / points[0].cores:.1f} | {slowed:.1f}x"
            f"{' saturated' if slowed > SATURATED else ''} | {system} | {spread(steps)} | "
            f"{1000 * model:.0f} | {error:+.0%} | {spread([r.compute for r in points])} | "
            + (f"{1000 * statistics.mean(r.compress for r in points):.0f} | "
               f"{statistics.mean(r.push for r in points) / 1e6:.3f} | "
               f"{statistics.mean(r.answer for r in points) / 1e6:.3f} | "
               f"{statistics.mean(r.width for r in points):.4f} | "
               f"{w * statistics.mean(r.busiest for r in points) / 1e6:.2f} |" if sparse
               else "- | - | - | - | - |"))
    lines.append("")
    for saturated, found in errors.items():
        if found:
            worst = max(found, key=abs)
            lines.append(f"{'Saturated' if saturated else 'Not saturated'}: within 15% at "
                         f"{sum(abs(e) <= 0.15 for e in found)} of {len(found)} points; the "
                         f"largest error {worst:+.0%}.")
    return lines + [""]
