"""The scale study: step time, bytes, the answers' width and each server's load measured at
W = 2, 4 and 8 workers and S = 1, 2 and 4 servers on shaped links, a model of the step
(benchmarks/step_model.py) validated against every measured point and the load generator's
servers, and its projection (benchmarks/scale_projection.py) to VGG-16, ResNet-50 and
BERT-base on 8-256 GPU workers and 10-100 Gbit/s links.

    sudo python benchmarks/scale.py --link 100mbit   # run what is missing, then report
    sudo python benchmarks/scale.py --link 1gbit     # the same on faster links
    sudo python benchmarks/scale.py --report         # the model and the report only

The model is fit on the W=2 runs of every link stored, with the servers' CPU from the load
generator's figures (--loadgen), and the report covers them all.

Every role is a host of its own (a network namespace; adtopk_ps/testing/netns.py), every
link shaped to --link by tc. Each point is one run of the e2e benchmark's worker
(benchmarks/e2e.py, --overlap off: the step is compute, compression, then communication,
which is what the model describes): every worker trains --model on a batch of its own
(--batch), so the workers' selections differ as data-parallel workers' do. Systems: DDP
dense (torch DDP on gloo, a ring all-reduce), ps-topk and ps-adtopk (partial sparsification,
density --ratio, error feedback), ps-adtopk with the servers re-sparsifying their answers
to top-k at the same density (``BYTEPS_SERVER_COMPRESSOR``) or at twice the pushes' width
(``topk:2x``), and ps-adtopk with keys of 256 KiB (``BYTEPS_PARTITION_BYTES``), which spread
over more servers. Each run is stored in
--results as soon as it ends, and runs already there are skipped: stop it at any time and
run it again to go on. A run's figures are worker 0's: its step, its forward + backward
alone (timed in turns with the step, in the same rounds), its compression, its bytes to and
from each server and the width of the servers' answers.

The machine this runs on has few cores: with W workers and S servers on it, compute and
compression slow down as the processes share them. The model takes those two terms from
the run itself (measured, not predicted), and predicts what scale changes: the pushes, the
servers' sums and the answers. The projection takes compute and compression from a GPU
worker (--gpu-batch, --gpu-tflops) and the rest from the fit.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import e2e  # noqa: E402  (the e2e benchmark's worker and runner)
import step_model  # noqa: E402
from convergence import store  # noqa: E402  (a run's record, whole or not at all)

from adtopk_ps.testing import netns  # noqa: E402
from adtopk_ps.testing.roles import role_names  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# scale's name -> (the e2e system it runs, the roles' environment, {ratio} filled in)
SYSTEMS = {"ddp-dense": ("ddp-dense", {}),
           "ps-topk": ("ps-topk", {}),
           "ps-adtopk": ("ps-adtopk", {}),
           "ps-adtopk+server-topk": ("ps-adtopk", {"BYTEPS_SERVER_COMPRESSOR": "topk:{ratio}"}),
           "ps-adtopk+server-2x": ("ps-adtopk", {"BYTEPS_SERVER_COMPRESSOR": "topk:2x"}),
           step_model.FINE_KEYS: ("ps-adtopk", {"BYTEPS_PARTITION_BYTES": str(step_model.FINER_PARTITION_BYTES)})}


def points(workers: list[int], servers: list[int]) -> list[tuple[int, int, str]]:
    """(W, S, system) in the order they run: DDP once per W (it has no servers), the server
    compressor at S=1 (where the answers weigh most), then ADTopk with finer keys at every
    point and answers at twice the pushes' width at S=1 (last: the study ran without them
    first)."""
    out = []
    for w in workers:
        out.append((w, servers[0], "ddp-dense"))
        for s in servers:
            out += [(w, s, "ps-topk"), (w, s, "ps-adtopk")]
        out.append((w, servers[0], "ps-adtopk+server-topk"))
    return out + [(w, s, step_model.FINE_KEYS) for w in workers for s in servers] + \
        [(w, servers[0], "ps-adtopk+server-2x") for w in workers]


def tag(link: str, w: int, s: int, system: str, trial: int) -> str:
    return f"{link}-W{w}-S{s}-{system}-t{trial}"


def run_point(net: dict, w: int, s: int, system: str, args: argparse.Namespace) -> dict:
    """One run: worker 0's RESULT, with the point's settings added."""
    base, env = SYSTEMS[system]
    run_args = argparse.Namespace(servers=s, workers=w, batch=args.batch, steps=args.steps,
                                  warmup=args.warmup, ratio=args.ratio, credit=0, paired=False,
                                  device="cpu", overlap="off")
    env = {name: value.format(ratio=args.ratio) for name, value in env.items()}
    result = e2e.run_system(net, base, args.model, run_args, env)
    return {**result, "workers": w, "servers": s, "system": system, "link": args.link,
            "model": args.model, "batch": args.batch, "ratio": args.ratio,
            "shaper": netns.shaper(net["worker0"][0]), "cores": os.cpu_count()}


def measure(args: argparse.Namespace, results: Path) -> int:
    """Every point's missing trials, grouped by (W, S) so that one set of hosts serves each;
    returns how many failed (each is said as it fails, and a later call runs it again)."""
    why = netns.unavailable()
    if why:
        sys.exit(f"scale benchmark: {why}")
    todo = [(w, s, system, t) for t in range(args.trials)
            for w, s, system in points(args.workers, args.servers)
            if not (results / f"{tag(args.link, w, s, system, t)}.json").exists()]
    print(f"{len(todo)} run(s) to go", flush=True)
    groups: dict[tuple[int, int], list] = {}
    failed = 0
    for w, s, system, t in todo:
        groups.setdefault((w, s), []).append((system, t))
    for (w, s), runs in groups.items():
        with netns.hosts(role_names("ps", s, w), rate=args.link) as net:
            for system, t in runs:
                try:
                    record = run_point(net, w, s, system, args)
                except (RuntimeError, OSError) as exc:
                    print(f"W={w} S={s} {system} trial {t} failed:\n{str(exc)[-3000:]}", flush=True)
                    failed += 1
                    continue
                store(results / f"{tag(args.link, w, s, system, t)}.json", record)
                print(f"W={w} S={s} {system} trial {t}: step {1000 * record['step_s']:.0f} ms, "
                      f"compute {1000 * record['compute_s']:.0f} ms", flush=True)
    return failed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--workers", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--servers", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--link", default="1gbit", help="tc rate of every link")
    ap.add_argument("--model", default="vgg-1024", choices=sorted(e2e.MODELS))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--ratio", type=float, default=0.01)
    ap.add_argument("--steps", type=int, default=10, help="timed rounds")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--trials", type=int, default=2)
    ap.add_argument("--results", default=str(ROOT / "docs" / "scale-runs"))
    ap.add_argument("--union", default=str(ROOT / "docs" / "scale-runs" / "union.json"),
                    help="benchmarks/union_density.py --json's unions, to grow answers beyond W=8")
    ap.add_argument("--loadgen", default=str(ROOT / "docs" / "loadgen.json"),
                    help="benchmarks/loadgen.py --json's figures: the servers' CPU a byte and a push")
    ap.add_argument("--gpu-batch", type=int, default=32, help="projected: samples a GPU worker's step")
    ap.add_argument("--gpu-tflops", type=float, default=30.0,
                    help="projected: a GPU worker's forward and backward rate, TFLOP/s")
    ap.add_argument("--out", default=str(ROOT / "docs"))
    ap.add_argument("--report", action="store_true", help="only model and report what is stored")
    args = ap.parse_args()
    args.gpu_tflops *= 1e12
    results = Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the namespaces are deleted
    failed = 0 if args.report else measure(args, results)
    runs = [json.loads(p.read_text()) for p in sorted(results.glob("*-W*.json"))]
    if not runs:
        sys.exit(f"scale benchmark: no runs stored in {results}")
    text = step_model.report(runs, args)
    (Path(args.out) / "scale-model.md").write_text(text + "\n")
    print(text)
    if failed:
        sys.exit(f"scale benchmark: {failed} run(s) failed (see above); the report leaves them "
                 "out, and running the same command again runs them")


if __name__ == "__main__":
    main()
