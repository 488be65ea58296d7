"""Time to accuracy on shaped links: every system trains the same VGG-style classifier on
Fashion-MNIST until the same test accuracy, every role on its own network-namespace host
(the e2e benchmark's, adtopk_ps/testing/netns.py) with links shaped by tc.

    sudo python benchmarks/time_to_accuracy.py                 # the default systems, 1 Gbit/s
    sudo python benchmarks/time_to_accuracy.py --systems ps-adtopk ddp-dense --target 0.75

Every system starts from the same weights (one init seed, then broadcast from worker 0) and
sees the same data in the same order (each worker's shard of the training set and its batch
for each step are the same for every system). Worker 0 evaluates on the first --test-limit
test images every --eval-every steps, and at the start; the others wait, and the clock stops
while it does, so evaluation is the same for every system and no system's time includes it.
The clock starts once every worker is up, before the distributed optimizer (or DDP) is built:
a system's set-up (the cost model's calibration, the step trial of overlap="auto", the first
broadcast) is part of its time to accuracy. A system stops at the first evaluation that reaches
--target, or when its clock passes --cap (then "not reached in X s"), or at --max-steps.
Bytes sent are what each worker's network interface sent (TCP/IP headers included, the
handful of bytes of the evaluations' stop-or-go messages too), for every system alike.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from adtopk_ps.testing.roles import (kill_all, master_address, require_gpu, role_env, role_names,
                                     spawn_role)
from adtopk_ps.testing.systems import SYSTEMS, ddp_model, ps_compression

ROOT = Path(__file__).resolve().parents[1]
# crossing the barrier leaves each step's updates to the next forward pass: not a plain loop
RUNNABLE = [s for s in SYSTEMS if not SYSTEMS[s].get("crossbarrier")]
DEFAULT_SYSTEMS = ["ddp-dense", "ddp-powersgd", "ps-dense", "ps-topk", "ps-adtopk", "ps-adtopk-i",
                   "ps-adtopk+hybrid"]
BASELINE = "ddp-dense"
# seconds a system may take beyond its training clock's cap: start-up, evaluations, shut-down
GRACE_S = 120


# --- one worker ------------------------------------------------------------------------

def pick_device(choice: str, rank: int):
    """``auto``: a GPU where torch sees one, else the CPU. The namespace hosts share one
    machine, so worker ``rank`` takes GPU ``rank % device_count``."""
    import torch
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no GPU here; use --device cpu or auto")
    return torch.device("cuda", rank % torch.cuda.device_count())


def tx_bytes(dev: str = "eth0") -> int:
    """Bytes this host's ``dev`` has sent (/proc/net/dev is this network namespace's)."""
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, fields = line.partition(":")
        if name.strip() == dev:
            return int(fields.split()[8])
    raise RuntimeError(f"no interface {dev} in /proc/net/dev")


class Clock:
    """Seconds of training: runs only between start() and stop()."""

    def __init__(self):
        self.seconds, self._since = 0.0, None

    def start(self) -> None:
        self._since = time.perf_counter()

    def stop(self) -> None:
        self.seconds += time.perf_counter() - self._since
        self._since = None


def worker(args: argparse.Namespace) -> None:
    """One worker of one system's run: trains until the target, the cap or the step limit;
    worker 0's figures in a RESULT line from every worker."""
    import torch

    from worker.models import VGG
    torch.set_num_threads(1)
    system = SYSTEMS[args.system]
    device = pick_device(args.device, int(os.environ["DMLC_WORKER_ID"]))
    rank = join(system, args)
    data = load_shard(args, rank, device)
    torch.manual_seed(args.seed)
    model = VGG(channels=1, hidden=args.hidden, width=args.width).to(device)
    curve = [{"step": 0, "wall_s": 0.0, "accuracy": evaluate(model, data) if rank == 0 else None}]
    barrier(system)
    clock, began, sent0 = Clock(), time.monotonic(), tx_bytes()
    clock.start()
    net, opt, share = distributed(system, model, args)
    step, decision = 0, None
    while decision is None:
        step = train_until_evaluation(net, opt, data, step, rank, args)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        clock.stop()
        point = {"step": step, "wall_s": clock.seconds, "sent": tx_bytes() - sent0, "accuracy": None}
        if rank == 0:
            point["accuracy"] = evaluate(model, data)
            decision = stop_or_go(point, time.monotonic() - began, args)
        curve.append(point)
        decision = share(decision)
        clock.start()
    leave(system)
    print("RESULT " + json.dumps({"rank": rank, "end": decision, "curve": curve,
                                  "params": sum(p.numel() for p in model.parameters()),
                                  "device": str(device)}), flush=True)


def join(system: dict, args: argparse.Namespace) -> int:
    """Join the system's cluster (the PS, or gloo's process group): this worker's rank."""
    if system["kind"] == "ps":
        import adtopk_ps.torch as bps
        bps.init()
        return bps.rank()  # the PS numbers its workers itself
    import torch.distributed as dist
    rank = int(os.environ["DMLC_WORKER_ID"])
    dist.init_process_group("gloo", init_method=f"tcp://{args.master}", rank=rank, world_size=args.workers)
    return rank


def barrier(system: dict) -> None:
    """Wait until every worker of the system's cluster is here."""
    if system["kind"] == "ps":
        import adtopk_ps.torch as bps
        bps.barrier()
    else:
        import torch.distributed as dist
        dist.barrier()


def leave(system: dict) -> None:
    """Leave the cluster once every worker has its last decision."""
    if system["kind"] == "ps":
        import adtopk_ps.torch as bps
        bps.shutdown()
        return
    import torch.distributed as dist
    # both past the last broadcast before either closes its connections (gloo aborts a
    # process whose peer hangs up under a collective in flight)
    dist.barrier()
    dist.destroy_process_group()


def load_shard(args: argparse.Namespace, rank: int, device):
    """This worker's shard of Fashion-MNIST, and the test images, on ``device``."""
    from worker.data import Dataset, fashion_mnist
    data = fashion_mnist(side=32, train_limit=args.train_limit, test_limit=args.test_limit) \
        .shard(rank, args.workers)
    return Dataset(data.x_train.to(device), data.y_train.to(device), data.x_test.to(device),
                   data.y_test.to(device), data.task)


def evaluate(model, data) -> float:
    """Accuracy on the test images."""
    import torch
    model.eval()
    with torch.no_grad():
        right = sum(int((model(x).argmax(-1) == y).sum())
                    for x, y in zip(data.x_test.split(500), data.y_test.split(500)))
    model.train()
    return right / len(data.y_test)


def distributed(system: dict, model, args: argparse.Namespace):
    """The model to train (``model``, or DDP's wrapper of it), its optimizer, and how worker 0's
    stop-or-go decision reaches every worker."""
    import torch
    sgd = dict(lr=args.lr, momentum=args.momentum)
    if system["kind"] == "ps":
        import adtopk_ps.torch as bps
        opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), **sgd), model.named_parameters(),
                                       ps_compression(system, args.ratio))  # overlap="auto"
        bps.broadcast_parameters(model.state_dict(), root_rank=0)

        def share(decision):
            return bps.broadcast_object(decision, root_rank=0, name="tta.decision")
        return model, opt, share
    import torch.distributed as dist
    net = ddp_model(model, system["hook"], args.ratio)

    def share(decision):
        box = [decision]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    return net, torch.optim.SGD(net.parameters(), **sgd), share


def train_until_evaluation(net, opt, data, step: int, rank: int, args: argparse.Namespace) -> int:
    """Steps from ``step`` on until the next evaluation (every --eval-every, or --max-steps):
    the step reached."""
    import torch.nn.functional as F
    while True:
        x, y = data.batch(step, args.batch, args.seed * 1000 + rank)
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        opt.step()
        step += 1
        if not step % args.eval_every or step >= args.max_steps:
            return step


def stop_or_go(point: dict, elapsed: float, args: argparse.Namespace) -> str | None:
    """Worker 0's decision at an evaluation: why the run ends there, or None to go on."""
    if point["accuracy"] >= args.target:
        return "reached"
    if point["wall_s"] >= args.cap or elapsed >= args.cap + GRACE_S / 2:
        return "cap"
    if point["step"] >= args.max_steps:
        return "max-steps"
    return None


# --- the driver ------------------------------------------------------------------------

def run_system(net: dict, system: str, args: argparse.Namespace) -> dict:
    """One system's run; a dict with "error" where it failed or overran its time limit."""
    kind = SYSTEMS[system]["kind"]
    roles = role_names(kind, args.servers, args.workers)
    env = role_env(net, args.servers, args.workers)
    job = [sys.executable, __file__, "--worker", "--system", system, "--master", master_address(net),
           *(f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k in WORKER_ARGS)]
    limit = args.cap + GRACE_S
    procs, logs, codes = [], [], None
    with tempfile.TemporaryDirectory(prefix="tta-") as tmp:
        try:
            for role in roles:
                logs.append(open(Path(tmp) / f"{role}.log", "w+"))  # files: no pipe can fill and stall a role
                procs.append(spawn_role(net, role, kind, env, job, logs[-1]))
            codes = wait_all(procs, limit)
        finally:
            kill_all(procs)
            outputs = []
            for log in logs:
                log.seek(0)
                outputs.append(log.read())
                log.close()
    results = [json.loads(line.split("RESULT ", 1)[1]) for out in outputs
               for line in out.splitlines() if "RESULT " in line]  # bpslaunch prefixes its roles' lines
    tail = "\n".join(f"--- {role}\n{out[-1500:]}" for role, out in zip(roles, outputs))
    if codes is None:
        return {"error": f"killed after {limit} s without finishing", "log": tail}
    # the roles that ended badly by themselves, before the rest were stopped
    failed = [f"{role} exited with {code}" for role, code in zip(roles, codes) if code]
    if failed or len(results) != args.workers:
        error = next((ln.strip() for out in outputs for ln in reversed(out.splitlines()) if "Error" in ln),
                     ", ".join(failed) or f"{len(results)} of {args.workers} workers reported")
        return {"error": error, "log": tail}
    lead = next(r for r in results if r["rank"] == 0)
    sent = [[point["sent"] for point in r["curve"][1:]] for r in results]
    for i, point in enumerate(lead["curve"][1:], 1):
        point["sent"] = sum(s[i - 1] for s in sent) / len(sent)  # mean over the workers
    return lead


def wait_all(procs: list[subprocess.Popen], limit: float) -> list[int | None] | None:
    """Wait until every process has ended or one has failed (a failed role would leave the
    others waiting for it until their own time-outs): their exit codes then, None for those
    still running; None where ``limit`` seconds passed first."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes) or any(codes):
            return codes
        time.sleep(0.2)
    return None


WORKER_ARGS = ("workers", "seed", "hidden", "width", "batch", "lr", "momentum", "ratio", "target",
               "eval_every", "cap", "max_steps", "train_limit", "test_limit", "device")


def to_target(r: dict) -> dict | None:
    """The evaluation that first reached the target, or None."""
    return r["curve"][-1] if r.get("end") == "reached" else None


def report(results: dict, args: argparse.Namespace, command: str) -> str:
    params = next((r["params"] for r in results.values() if "params" in r), 0)
    device = next((r["device"] for r in results.values() if "device" in r), args.device)
    base = to_target(results.get(BASELINE, {}))
    out = [f"# Time to {args.target:.0%} test accuracy on Fashion-MNIST, {args.link} links", "",
           f"    {command}", "",
           f"VGG-style (width {args.width}, hidden {args.hidden}: {params / 1e6:.2f} M parameters) on "
           f"Fashion-MNIST padded to 32x32, {args.workers} workers x {args.servers} servers (PS systems) on "
           f"network-namespace hosts, every link {args.link}; batch {args.batch} per worker, SGD lr {args.lr} "
           f"momentum {args.momentum}, density {args.ratio} for the sparsifiers (with error feedback), "
           f"device {device}. Same initial weights (seed {args.seed}, broadcast) and the same batches in "
           f"the same order for every system. Worker 0 evaluates on the first {args.test_limit} test "
           f"images every {args.eval_every} steps; **evaluation time is excluded from the wall clock** "
           f"(the clock stops on every worker while worker 0 evaluates). The clock includes each "
           f"system's set-up once its processes are up. Each system is capped at {args.cap:.0f} s of "
           f"training and {args.max_steps} steps. MiB sent: bytes each worker's network interface sent "
           f"up to the evaluation that reached the target (TCP/IP headers included), mean over the "
           f"workers.", ""]
    if args.note:
        out += [f"**Note:** {args.note}", ""]
    out += [f"| system | wall s to target | steps to target | MiB sent per worker to target | "
            f"final accuracy | s per step | time vs {BASELINE} |", "|---|---:|---:|---:|---:|---:|---:|"]
    for system, r in results.items():
        if "error" in r:
            out.append(f"| {system} | failed: {r['error']} ||||||")
            continue
        last, hit = r["curve"][-1], to_target(r)
        per_step = f"{last['wall_s'] / last['step']:.3f}" if last["step"] else "-"
        if hit is None:
            why = "the step cap" if r["end"] == "max-steps" else f"{last['wall_s']:.0f} s"
            out.append(f"| {system} | not reached in {why} | not reached in {last['step']} steps | "
                       f"- | {last['accuracy']:.3f} | {per_step} | - |")
            continue
        ratio = f"{base['wall_s'] / hit['wall_s']:.2f}x sooner" if base else "-"
        out.append(f"| {system} | {hit['wall_s']:.1f} | {hit['step']} | {hit['sent'] / 2**20:.1f} | "
                   f"{hit['accuracy']:.3f} | {per_step} | {ratio} |")
    out += ["", f"![test accuracy against wall-clock seconds]({args.stem}.png)", ""]
    return "\n".join(out)


def chart(results: dict, args: argparse.Namespace, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 5))
    for system, r in results.items():
        if "curve" not in r:
            continue
        line, = ax.plot([p["wall_s"] for p in r["curve"]], [p["accuracy"] for p in r["curve"]],
                        marker=".", label=system)
        hit = to_target(r)
        if hit:
            ax.plot([hit["wall_s"]], [hit["accuracy"]], "o", ms=9, mfc="none", color=line.get_color())
    ax.axhline(args.target, color="k", ls="--", lw=0.8, label=f"target {args.target:.0%}")
    ax.set_xlabel("wall-clock seconds of training (evaluation excluded)")
    ax.set_ylabel(f"test accuracy (first {args.test_limit} test images)")
    ax.set_title(f"Fashion-MNIST, VGG hidden {args.hidden}, {args.workers} workers, {args.link}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_args() -> argparse.Namespace:
    """The options, every numeric one checked (a bad one named, exit 2)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--systems", nargs="*", default=DEFAULT_SYSTEMS, choices=RUNNABLE)
    ap.add_argument("--link", default="1gbit", help="tc rate of every link")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--servers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=2048, help="VGG's classifier width")
    ap.add_argument("--width", type=int, default=16, help="VGG's first convolution's channels")
    ap.add_argument("--batch", type=int, default=32, help="per worker")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--ratio", type=float, default=0.01, help="density of the sparsifiers")
    ap.add_argument("--target", type=float, default=0.78, help="test accuracy to reach")
    ap.add_argument("--eval-every", type=int, default=20, help="steps between evaluations")
    ap.add_argument("--cap", type=float, default=300.0, help="seconds of training per system at most")
    ap.add_argument("--max-steps", type=int, default=5000)
    ap.add_argument("--train-limit", type=int, default=60000, help="training images used")
    ap.add_argument("--test-limit", type=int, default=2000, help="test images evaluated")
    ap.add_argument("--seed", type=int, default=0, help="initial weights and batch order")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                    help="where workers train; workers share GPUs by rank modulo their count")
    ap.add_argument("--note", default="", help="a line for the report (the conditions of the run, say)")
    ap.add_argument("--out", default=str(ROOT / "docs"))
    ap.add_argument("--stem", default="time-to-accuracy", help="file name of the report and chart")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--system", help=argparse.SUPPRESS)
    ap.add_argument("--master", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return args
    for name in ("workers", "servers", "hidden", "width", "batch", "eval_every", "max_steps",
                 "train_limit", "test_limit"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    for name in ("target", "ratio"):
        if not 0 < getattr(args, name) <= 1:
            ap.error(f"--{name} must lie in (0, 1], got {getattr(args, name)}")
    for name in ("cap", "lr"):
        if getattr(args, name) <= 0:
            ap.error(f"--{name} must be above 0, got {getattr(args, name)}")
    return args


def main() -> None:
    args = parse_args()
    if args.worker:
        return worker(args)
    require_gpu(args.device, "time to accuracy")
    from adtopk_ps.testing import netns
    from worker.data import fashion_files
    fashion_files()  # a missing dataset is named before any namespace is made
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the namespaces are deleted
    why = netns.unavailable()
    if why:
        sys.exit(f"time to accuracy: {why}")
    command = "sudo python benchmarks/time_to_accuracy.py " + shlex.join(sys.argv[1:])
    began = time.monotonic()
    results = run_all(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    text = report(results, args, command)
    (out / f"{args.stem}.md").write_text(text + f"\nThe whole run took {time.monotonic() - began:.0f} s.\n")
    chart(results, args, out / f"{args.stem}.png")
    print(text)


def run_all(args: argparse.Namespace) -> dict:
    """Every system's run, one after the other on the same namespace hosts: system -> its result."""
    from adtopk_ps.testing import netns
    results: dict = {}
    with netns.hosts(role_names("ps", args.servers, args.workers), rate=args.link) as net:
        for system in args.systems:
            started = time.monotonic()
            results[system] = r = run_system(net, system, args)
            if "error" in r:
                print(r.pop("log"), file=sys.stderr, flush=True)
            summary = {k: v for k, v in r.items() if k != "curve"}
            if "curve" in r:
                summary.update(last=r["curve"][-1])
            print(f"{system} ({time.monotonic() - started:.0f} s): {summary}", flush=True)
    return results


if __name__ == "__main__":
    main()
