"""End to end, side by side: our PS (dense, top-k, ADTopk, ADTopk with the cost model and with
hybrid communication, ADTopk-I) against torch DDP on gloo (dense, PowerSGD, our ADTopk hook),
every role on its own host in a network namespace,
links shaped with tc, all in one invocation. Every sparse PS system uses partial
sparsification: biases, norms and tensors under BYTEPS_MIN_COMPRESS_BYTES travel dense.

    sudo python benchmarks/e2e.py                           # VGG-style, 1 and 10 Gbit/s
    sudo python benchmarks/e2e.py --models vgg resnet18 transformer --links 1gbit
    sudo python benchmarks/e2e.py --scaling --links 1gbit   # model size and W
    sudo python benchmarks/e2e.py --paired --models resnet18 transformer --links 10gbit \
        --systems ps-adtopk+cost ddp-dense                  # PS and DDP step for step

Every PS system runs with the optimizer's default overlap="auto" (--overlap on or
off fixes it): its trial chooses in steps of their own before the timed rounds (timing
OVERLAP_TRIAL_STEPS steps each way; with the cost model, its routes and every
tensor dense too), and each PS row says which way it chose.
Each worker's timed rounds then take turns, in an order that rotates every
round: a forward+backward alone
(compute, on a copy of the model that no optimizer or DDP hooks), a step of
the system and, for ps-adtopk, the same step the other way (overlap on or
off, set between steps); so the machine's drift slows each alike, and the
exposed communication (step - compute) is measured under the same conditions
as the step. Every worker, ours and DDP's, runs with the allocator settings
bpslaunch gives its roles (adtopk_ps/allocator.py). Every system runs
--trials times, in alternating order; the table keeps each system's fastest
run (this machine is shared, and a slow run says more about its neighbours
than about the system), and a second table sets every trial against DDP
dense's trial of the same pass. Reported per step: the whole step, the CPU
time of worker 0's process (all its threads: where our PS and DDP differ in
overhead), compute, compression (PS), the wait for answers after backward
(PS), and what is left (communication not hidden by the backward pass).
"hidden" is the share of ADTopk's compression and communication that
overlap hides: 1 - (overlapped step - compute) / (step without overlap - compute).
ps-adtopk+crossbarrier crosses the step barrier (adtopk_ps.torch.cross_barrier:
each layer waits for its own update in the next forward pass), with the pushes
as they come and, in runs of their own, ordered by need behind a --credit window
(adtopk_ps/client/credit.py); its rounds also time, on a copy of the model, the
plain optimizer with overlap (at the barrier) and without, and it reports what
crossing hides by the same formula and what overlap at the barrier hides. A cross-barrier step's communication lands
during whatever runs next, so that system's kinds are timed in runs of
CROSSBARRIER_RUN steps, the cross-barrier run ending by waiting for its last
updates (which it then counts as exposed: the figure is a lower bound).

Where the margin between two systems is smaller than this machine's drift
between runs (on a fast link, with small models), --paired gives each PS
worker a second copy of the model under DDP dense on gloo: every round then
times a PS step and a DDP step back to back in the same processes on the
same links, and the report adds their ratio round by round.

--device cuda puts every worker's model and batches on a GPU (worker i on
cuda:<i mod the GPUs visible>, so several workers may share one), and every
timed step waits for the GPU's queued work before it is timed.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from adtopk_ps.testing.roles import (kill_all, master_address, require_gpu, role_env, role_names,
                                     spawn_role)
from adtopk_ps.testing.stats import interval, speed_of
from adtopk_ps.testing.systems import MODELS, SYSTEMS, ddp_model, ps_compression

ROOT = Path(__file__).resolve().parents[1]
# a cross-barrier step leaves its communication to the next forward pass: its system's kinds
# are timed in runs of this many consecutive steps, the cross-barrier run ending by waiting for
# its last updates (see worker())
CROSSBARRIER_RUN = 4
# steps the overlap="auto" trial times each way (jobs default to 8; PS_OVERLAP_TRIAL_STEPS overrides)
OVERLAP_TRIAL_STEPS = 4
SCALING_SYSTEMS = ["ps-dense", "ps-adtopk", "ddp-dense", "ddp-powersgd"]
# --overlap: the PS optimizer's overlap argument
OVERLAP = {"auto": "auto", "on": True, "off": False}
# --- one worker ------------------------------------------------------------------------

# name -> (prepare, step): prepare runs untimed before each timed step
Kinds = dict[str, tuple[Callable[[], object], Callable[[], object]]]


def worker(args: argparse.Namespace) -> None:
    """One worker of one system's run: its timed rounds, then worker 0 prints the RESULT line."""
    import torch
    torch.set_num_threads(1)
    system = SYSTEMS[args.system]
    work = Workload(args)
    # (crossing the barrier compares itself with the plain optimizer in its own rounds instead)
    paired = args.paired and system["kind"] == "ps" and not system.get("crossbarrier")
    ddp_twin = copy.deepcopy(work.model) if paired else None  # DDP's copy: the same weights
    if system["kind"] == "ps":
        import adtopk_ps.torch as bps
        bps.init()
    gloo = system["kind"] == "ddp" or paired
    if gloo:
        import torch.distributed as dist
        dist.init_process_group("gloo", init_method=f"tcp://{args.master}",
                                rank=int(os.environ["DMLC_WORKER_ID"]), world_size=args.workers)
    result = {"params": sum(p.numel() for p in work.model.parameters())}
    if system["kind"] == "ps":
        rank, timed = ps_worker(args, system, work, ddp_twin)
    else:
        rank, timed = dist.get_rank(), ddp_rounds(args, system, work)
    result.update(timed)
    if gloo:  # both past their last collective before either closes (gloo aborts otherwise)
        dist.barrier()
        dist.destroy_process_group()
    if rank == 0:
        print("RESULT " + json.dumps(result), flush=True)


def worker_device(args: argparse.Namespace):
    """Every worker is a host of its own here (local rank 0): GPUs go round-robin by worker."""
    import torch
    if args.device != "cuda":
        return torch.device("cpu")
    device = torch.device("cuda", int(os.environ["DMLC_WORKER_ID"]) % torch.cuda.device_count())
    torch.cuda.set_device(device)  # Triton's kernels and the CUDA context follow it
    return device


class Workload:
    """A worker's model, a twin of it for compute alone (no optimizer hooks, no DDP reducer on
    it) and the one batch every step trains on, all on the worker's device. The weights are
    every worker's; the batch is this worker's own, as data-parallel workers' are (so their
    sparse selections differ, and a server's answer is their union)."""

    def __init__(self, args: argparse.Namespace):
        import torch

        from worker.models import build
        arch, spec, inputs = MODELS[args.model]
        self.device = worker_device(args)
        torch.manual_seed(0)
        self.model = build(arch, spec).to(self.device)
        self.twin = copy.deepcopy(self.model)
        gen = torch.Generator().manual_seed(1 + int(os.environ.get("DMLC_WORKER_ID", "0")))
        if inputs == "images":
            x = torch.randn(args.batch, 3, 32, 32, generator=gen)
            y = torch.randint(0, 10, (args.batch,), generator=gen)
        else:
            x = torch.randint(0, 256, (args.batch, 64), generator=gen)
            y = torch.randint(0, 256, (args.batch, 64), generator=gen)
        self.x, self.y = x.to(self.device), y.to(self.device)
        self._cross_entropy = torch.nn.functional.cross_entropy

    def loss(self, net):
        """``net``'s cross-entropy on the batch (tokens flattened for the transformer)."""
        out = net(self.x)
        return self._cross_entropy(out.reshape(-1, out.shape[-1]), self.y.reshape(-1))

    def compute(self) -> None:
        """A forward + backward alone, on the twin."""
        self.twin.zero_grad()
        self.loss(self.twin).backward()


def nothing() -> None:
    """A kind's preparation where it needs none."""


def interleaved(kinds: Kinds, rounds: int, device) -> dict[str, tuple[float, float, list[float]]]:
    """Wall and CPU seconds (every thread of this worker) per step of each kind, and each
    round's wall seconds, the kinds taking turns, so that this machine's drift slows them
    alike; the order rotates every round, so that each kind follows each other kind as
    often (whatever the one before leaves behind, caches or allocator state, falls on no
    kind alone). ``kinds``: name -> (prepare, step); prepare is not timed."""
    from adtopk_ps.core.timing import wait_for_device
    wall = {name: [] for name in kinds}
    cpu = dict.fromkeys(kinds, 0.0)
    names = list(kinds)
    for turn in range(rounds):
        for name in names[turn % len(names):] + names[:turn % len(names)]:
            prepare, fn = kinds[name]
            prepare()
            wait_for_device(device)
            started, cpu_started = time.perf_counter(), time.process_time()
            fn()
            wait_for_device(device)  # a GPU step ends when its queued kernels have run
            wall[name].append(time.perf_counter() - started)
            cpu[name] += time.process_time() - cpu_started
    return {name: (sum(wall[name]) / rounds, cpu[name] / rounds, wall[name]) for name in kinds}


def timing(times: dict, waits: dict[str, list[float]], kind: str, rounds: int, run: int = 1) -> dict:
    """Seconds per step of ``kind`` (timed in runs of ``run`` steps) and of compute alone, and
    its mean wait for answers after backward over the timed rounds."""
    steps = rounds * run
    return {"compute_s": times["compute"][0] / run, "step_s": times[kind][0] / run,
            "cpu_s": times[kind][1] / run, "wait_s": sum(waits[kind][-steps:]) / steps}


class Traffic:
    """What the PS client compressed and what moved (pushed, pulled and, given the optimizer,
    all-reduced) since this was made."""

    def __init__(self, client, opt=None):
        self.client, self.opt = client, opt
        self.compress_s, self.bytes = client.compress_seconds, self.moved()
        self.tally = client.ledger.snapshot()

    def moved(self) -> int:
        """Bytes moved so far, all told."""
        return self.client.bytes_pushed + self.client.bytes_pulled + \
            (self.opt.allreduce_bytes if self.opt is not None else 0)

    def per_push(self, pushes: int) -> dict:
        """Compression seconds and bytes moved since this was made, per PS step of ``pushes``;
        this worker's bytes to and from each server, and the answers' width (the union of the
        workers' selections, over the sparsified tensors' elements)."""
        tally = self.client.ledger.snapshot().since(self.tally)
        return {"compress_s": (self.client.compress_seconds - self.compress_s) / pushes,
                "bytes_per_step": (self.moved() - self.bytes) / pushes,
                "pushed_per_step": {str(s): n / pushes for s, n in tally.pushed.items()},
                "pulled_per_step": {str(s): n / pushes for s, n in tally.pulled.items()},
                "answer_density": tally.answer_density}


# --- a DDP system's worker --------------------------------------------------------------

def ddp_step(net, hook: str, ratio: float, work: Workload):
    """One training step of ``net`` under torch DDP (:func:`ddp_model`)."""
    import torch
    ddp = ddp_model(net, hook, ratio)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)

    def step():
        opt.zero_grad()
        work.loss(ddp).backward()
        opt.step()
    return step


def ddp_rounds(args: argparse.Namespace, system: dict, work: Workload) -> dict:
    """A DDP system's rounds: forward + backward alone and its step, taking turns."""
    kinds = {"compute": (nothing, work.compute),
             "step": (nothing, ddp_step(work.model, system["hook"], args.ratio, work))}
    interleaved(kinds, args.warmup, work.device)
    times = interleaved(kinds, args.steps, work.device)
    return {"compute_s": times["compute"][0], "step_s": times["step"][0], "cpu_s": times["step"][1]}


# --- a PS system's worker ---------------------------------------------------------------

def ps_worker(args: argparse.Namespace, system: dict, work: Workload, ddp_twin) -> tuple[int, dict]:
    """A PS system's rounds, then this worker's rank and its figures; the PS is shut down."""
    import adtopk_ps.torch as bps
    compression = ps_compression(system, args.ratio)
    client = bps.client()
    if system.get("crossbarrier"):
        result = crossbarrier(args, work, compression, client)
    else:
        result = ps_rounds(args, system, work, compression, client, ddp_twin)
    rank = bps.rank()
    bps.shutdown()
    return rank, result


def ps_step(opt, work: Workload, waits: list[float], net=None):
    """One step of the PS optimizer ``opt`` on ``net`` (the worker's model by default), its wait
    for the answers after backward appended to ``waits``."""
    net = work.model if net is None else net

    def step():
        opt.zero_grad()
        work.loss(net).backward()
        began = time.perf_counter()
        opt.synchronize()
        waits.append(time.perf_counter() - began)
        with opt.skip_synchronize():
            opt.step()
    return step


def ps_rounds(args: argparse.Namespace, system: dict, work: Workload, compression, client,
              ddp_twin) -> dict:
    """A PS system's rounds: forward + backward alone, its step and, where the system measures
    overlap, its step the other way; with ``ddp_twin`` (--paired) a DDP dense step too."""
    import torch

    import adtopk_ps.torch as bps
    opt = bps.DistributedOptimizer(torch.optim.SGD(work.model.parameters(), lr=0.01),
                                   work.model.named_parameters(), compression,
                                   overlap=OVERLAP[args.overlap])
    waits: dict[str, list[float]] = {"step": [], "other": []}
    # the step trial (overlap, and with the cost model its routes against every tensor
    # dense) chooses in steps of its own, then every kind warms up; every worker chooses
    # at the same step
    while opt.choosing:
        interleaved({"step": (nothing, ps_step(opt, work, waits["step"]))}, 1, work.device)
    chose = opt.overlap
    kinds = ps_kinds(args, system, work, opt, waits, chose, ddp_twin)
    interleaved(kinds, args.warmup, work.device)
    traffic = Traffic(client, opt)
    times = interleaved(kinds, args.steps, work.device)
    pushes = args.steps * len(set(kinds) - {"compute", "ddp"})  # both kinds of PS step push the same

    def summary(kind: str) -> dict:
        return {**timing(times, waits, kind, args.steps), **traffic.per_push(pushes)}

    result = {**summary("step"), "overlap": chose}
    if ddp_twin is not None:
        result["paired"] = {"ddp_cpu_s": times["ddp"][1],
                            "rounds": list(zip(times["step"][2], times["ddp"][2]))}
    result.update(routes_taken(work.model, compression))
    if "other" in times:
        result["other"] = summary("other")
    return result


def ps_kinds(args: argparse.Namespace, system: dict, work: Workload, opt, waits: dict,
             chose: bool, ddp_twin) -> Kinds:
    """What a PS system's rounds time: compute alone, the step the way the trial ``chose`` and,
    where the system measures overlap, the step the other way, to measure what overlap hides;
    with ``ddp_twin``, a DDP dense step, every kind starting with the workers in step."""
    kinds = {"compute": (nothing, work.compute), "step": (nothing, ps_step(opt, work, waits["step"]))}
    if system.get("measure_overlap"):
        kinds["step"] = (lambda: opt.set_overlap(chose), kinds["step"][1])
        kinds["other"] = (lambda: opt.set_overlap(not chose), ps_step(opt, work, waits["other"]))
    if ddp_twin is None:
        return kinds
    import torch.distributed as dist
    kinds["ddp"] = (nothing, ddp_step(ddp_twin, "none", args.ratio, work))
    # every kind starts with the workers in step: the lead one worker gains in a kind that
    # does not synchronise (compute alone) is otherwise waited out by whichever step comes
    # next, and with three kinds in rotation that is not each step as often
    return {name: (lambda prepare=prepare: (dist.barrier(), prepare()), fn)
            for name, (prepare, fn) in kinds.items()}


def routes_taken(model, compression) -> dict:
    """How many tensors went dense (and their share of the parameters), and what the cost
    model measured where it ran."""
    sizes = {name: p.numel() for name, p in model.named_parameters()}
    dense = [name for name, route in compression.routes.items() if route.dense]
    out = {"dense": [len(dense), len(sizes), sum(sizes[n] for n in dense) / sum(sizes.values())]}
    cost = compression.costs
    if cost is not None:
        out["cost"] = {"bytes_per_s": cost.bytes_per_s, "s_per_element": cost.compress_s_per_element,
                       "key_s": cost.key_s, "allreduce_bytes_per_s": compression.allreduce_bytes_per_s,
                       "allreduce": compression.allreduce}
    return out


def crossbarrier(args: argparse.Namespace, work: Workload, compression, client) -> dict:
    """ps-adtopk+crossbarrier's rounds: forward + backward alone, the cross-barrier step, and
    on a copy of the model the plain optimizer with overlap and without, each kind a run of
    CROSSBARRIER_RUN consecutive steps (the cross-barrier run ending by waiting for its last
    updates, so that none of its communication lands during another kind's turn)."""
    import torch

    import adtopk_ps.torch as bps
    from adtopk_ps.torch.cross_barrier import CrossBarrier
    model, run = work.model, CROSSBARRIER_RUN
    base = copy.deepcopy(model)
    cb = CrossBarrier(model, torch.optim.SGD(model.parameters(), lr=0.01),
                      named_parameters=model.named_parameters(), compression=compression)
    plain = bps.DistributedOptimizer(
        torch.optim.SGD(base.parameters(), lr=0.01), base.named_parameters(),
        ps_compression(SYSTEMS["ps-adtopk"], args.ratio), overlap=True, key_prefix="barrier.")
    waits: dict[str, list[float]] = {"step": [], "ordered": [], "barrier": [], "other": []}

    def credit(window: int, then=nothing):
        def prepare():
            client.credit = window
            then()
        return prepare
    kinds = {"compute": (nothing, repeated(work.compute, run)),
             "step": (credit(0), crossing_run(cb, work, waits["step"], run)),
             "ordered": (credit(args.credit), crossing_run(cb, work, waits["ordered"], run)),
             "barrier": (credit(0, lambda: plain.set_overlap(True)),
                         repeated(ps_step(plain, work, waits["barrier"], base), run)),
             "other": (credit(0, lambda: plain.set_overlap(False)),
                       repeated(ps_step(plain, work, waits["other"], base), run))}
    interleaved(kinds, args.warmup, work.device)
    traffic = Traffic(client)
    times = interleaved(kinds, args.steps, work.device)
    pushes = args.steps * run * 4  # the four PS kinds push the same

    def summary(kind: str) -> dict:
        return {**timing(times, waits, kind, args.steps, run), **traffic.per_push(pushes)}

    # (the routes are named by the cross-barrier's server keys, in the model's order)
    sizes = [p.numel() for p in model.parameters()]
    dense = [n for n, route in zip(sizes, compression.routes.values()) if route.dense]
    return {**summary("step"), "ordered": summary("ordered"), "barrier": summary("barrier"),
            "other": summary("other"), "run": run, "credit": args.credit,
            "dense": [len(dense), len(sizes), sum(dense) / sum(sizes)]}


def repeated(step, times: int):
    """``step`` ``times`` times over, as one timed turn."""
    def run():
        for _ in range(times):
            step()
    return run


def crossing_run(cb, work: Workload, waits: list[float], run: int):
    """``run`` steps of the cross-barrier optimizer ``cb``, then a wait for the run's last
    updates, counted as exposed (added to the last step's wait)."""
    def go():
        for _ in range(run):
            cb.zero_grad()
            work.loss(work.model).backward()
            began = time.perf_counter()
            cb.step()
            waits.append(time.perf_counter() - began)
        began = time.perf_counter()
        cb.synchronize()
        waits[-1] += time.perf_counter() - began
    return go


def hidden_share(overlapped: dict, without: dict) -> str:
    """1 - (overlapped step - compute) / (step without overlap - compute), or "-" where noise
    leaves nothing exposed without overlap."""
    exposed = without["step_s"] - without["compute_s"]
    return "-" if exposed <= 0 else \
        f"{1 - max(0.0, overlapped['step_s'] - overlapped['compute_s']) / exposed:.0%}"


# --- the driver ------------------------------------------------------------------------

def run_system(net: dict, system: str, model: str, args: argparse.Namespace,
               extra_env: dict[str, str] | None = None) -> dict:
    """One run of ``system`` on ``model`` (every role's environment with ``extra_env`` added):
    worker 0's RESULT; raises where a role failed."""
    kind = SYSTEMS[system]["kind"]
    env = {**role_env(net, args.servers, args.workers), **(extra_env or {})}
    env.setdefault("PS_OVERLAP_TRIAL_STEPS", str(OVERLAP_TRIAL_STEPS))
    job = [sys.executable, __file__, "--worker", "--system", system, "--model", model,
           "--batch", str(args.batch), "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--ratio", str(args.ratio), "--credit", str(args.credit), "--workers", str(args.workers),
           "--master", master_address(net), "--overlap", args.overlap,
           "--device", args.device] + \
        (["--paired"] if args.paired else [])
    procs = []
    try:
        for role in role_names(kind, args.servers, args.workers):
            procs.append(spawn_role(net, role, kind, env, job, subprocess.PIPE))
        outputs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        kill_all(procs)
    lines = [line for out in outputs for line in out.splitlines() if "RESULT " in line]
    if any(p.returncode for p in procs) or not lines:
        raise RuntimeError(f"{system} on {model} failed:\n" + "\n".join(o[-2000:] for o in outputs))
    return json.loads(lines[0].split("RESULT ", 1)[1])


def speedup(base: dict | None, r: dict) -> str:
    return "-" if base is None or "step_s" not in base else f"{base['step_s'] / r['step_s']:.2f}x"


def fastest(trials: list[dict]) -> dict:
    """The trial a system's row shows: its fastest (a failed one only if all failed)."""
    ran = [r for r in trials if "step_s" in r]
    return min(ran, key=lambda r: r["step_s"]) if ran else (trials[0] if trials else {})


def best_of(results: dict) -> dict:
    return {group: {system: fastest(trials) for system, trials in by_system.items()}
            for group, by_system in results.items()}


def trial_by_trial(by_system: dict) -> list[str]:
    """Every trial against DDP dense's trial of the same pass: the step ratio, and the ratio
    of each side's step to its own compute (forward + backward in the same rounds), which
    cancels the machine's drift between the two runs."""
    ddp = by_system.get("ddp-dense", [])
    out = []
    for system, trials in by_system.items():
        if system == "ddp-dense":
            continue
        pairs = [(d, r) for d, r in zip(ddp, trials) if "step_s" in d and "step_s" in r]
        if not pairs:
            continue
        raw = [d["step_s"] / r["step_s"] for d, r in pairs]
        same = [(d["step_s"] / d["compute_s"]) / (r["step_s"] / r["compute_s"]) for d, r in pairs]
        cells = " | ".join(f"{a:.2f}x ({b:.2f}x)" for a, b in zip(raw, same))
        out.append(f"| {system} | {cells} | {min(same):.2f}x | {sum(v > 1 for v in same)} of {len(same)} |")
    if not out:
        return []
    n = max(len(t) for t in by_system.values())
    return ["", "Against DDP dense trial by trial: step ratio (in brackets, with each side's step taken "
            "over its own compute: the same comparison without the drift between runs)", "",
            "| system | " + " | ".join(f"trial {i + 1}" for i in range(n)) + " | lowest (same compute) "
            "| faster (same compute) |", "|---|" + "---:|" * (n + 2), *out]


def pooled(trials: list[dict]) -> list:
    """--paired: one system's (PS step, DDP step) rounds, every trial's pooled."""
    return [pair for r in trials if "paired" in r for pair in r["paired"]["rounds"]]


def paired_speed(trials: list[dict]) -> float | None:
    """--paired: DDP dense's mean step over the PS system's, every trial's rounds pooled."""
    pairs = pooled(trials)
    return speed_of(pairs) if pairs else None


def paired_rounds(by_system: dict) -> dict[str, list]:
    """--paired: the pooled rounds of every system that has any."""
    rounds = {system: pooled(trials) for system, trials in by_system.items()}
    return {system: pairs for system, pairs in rounds.items() if pairs}


def versus(by_system: dict) -> list[str]:
    """--paired, every two PS systems: how many times as fast the first one's step is as the
    second's, each system's step taken over DDP dense's in its own rounds, so that the drift
    between the two systems' runs cancels."""
    rounds = paired_rounds(by_system)
    names = list(rounds)
    out = []
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            low, high = interval(rounds[a], rounds[b])
            out.append(f"| {a} | {b} | {speed_of(rounds[a]) / speed_of(rounds[b]):.2f}x "
                       f"[{low:.2f}, {high:.2f}] | {len(rounds[a])} + {len(rounds[b])} |")
    if not out:
        return []
    return ["", "PS systems against each other: (DDP dense / A) over (DDP dense / B), ratios of means "
            "over all rounds; above 1, A's step is the shorter", "",
            "| A | B | A's speed over B's [90% bootstrap interval] | rounds |", "|---|---|---|---:|",
            *out]


def paired(by_system: dict) -> list[str]:
    """--paired: each PS system against DDP dense timed in the same processes, round by round."""
    out = []
    for system, pairs in paired_rounds(by_system).items():
        trials = by_system[system]
        ran = [r["paired"] for r in trials if "paired" in r]
        rounds = [ddp / ps for ps, ddp in pairs]
        low, high = interval(pairs)
        by_trial = ", ".join(f"{speed_of(r['rounds']):.2f}x" for r in ran)
        ratios = f"{speed_of(pairs):.2f}x [{low:.2f}, {high:.2f}] ({by_trial})"
        ms = [1000 * statistics.mean(v) for v in ((ps for ps, _ in pairs), (ddp for _, ddp in pairs),
                                                  (r["cpu_s"] for r in trials if "paired" in r),
                                                  (r["ddp_cpu_s"] for r in ran))]
        out.append(f"| {system} | " + " | ".join(f"{v:.0f}" for v in ms) + f" | {ratios} | "
                   f"{statistics.median(rounds):.2f}x | {sum(v > 1 for v in rounds)} of {len(rounds)} |")
    if not out:
        return []
    return ["", "Paired with DDP dense in the same processes: every round times a step of the PS system "
            "and a step of DDP dense (gloo, on a copy of the model) back to back on the same links, so "
            "the machine's drift cannot fall on one side; ratio = DDP step / PS step", "",
            "| system | PS step ms | DDP dense step ms | PS worker CPU ms | DDP worker CPU ms | ratio of "
            "means: all rounds [90% bootstrap interval] (by trial) | median round ratio | rounds PS faster |", "|---|---:|---:|---:|---:|---|---:|---:|",
            *out]


def report(trials: dict, results: dict, args: argparse.Namespace) -> str:
    """``trials``: every run of every system; ``results``: the fastest of each (best_of)."""
    out = []
    for (model, link, workers), by_system in results.items():
        params = next((r["params"] for r in by_system.values() if "params" in r), 0)
        out += [f"#### {model} ({params / 1e6:.1f} M params), {link}, {workers} workers x {args.servers} "
                f"servers, batch {args.batch}", ""]
        out += system_table(by_system, workers * args.batch)
        out += hidden_notes(by_system)
        out += cost_notes(by_system)
        out += trial_by_trial(trials[(model, link, workers)])
        out += paired(trials[(model, link, workers)])
        out += versus(trials[(model, link, workers)])
        out.append("")
    if args.scaling:
        out += scaling_table(results)
    return "\n".join(out)


def system_table(by_system: dict, samples_per_step: int) -> list[str]:
    """A row of each system's fastest run (and of its step the other way, where it has one)."""
    ddp, ps = by_system.get("ddp-dense"), by_system.get("ps-dense")
    out = ["| system | samples/s | step ms | worker CPU ms | compute | compress | wait after backward "
           "| exposed comm | MB per step | vs DDP dense | vs PS dense |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    rows = []
    for system, r in by_system.items():
        # every tensor went dense: the step trial kept that plan, or the cost model chose it
        every = "cost" in r and r["dense"][0] == r["dense"][1]
        rows.append((system + (f" (chose {mode(r['overlap'])}{', every tensor dense' if every else ''})"
                               if "overlap" in r else ""), r))
        if "barrier" in r:  # crossing the barrier, against the plain optimizer at it
            rows += [(f"{system}, ordered by need ({r['credit'] >> 10} KiB credit)", r["ordered"]),
                     (f"{system}, at the barrier with overlap", r["barrier"]),
                     (f"{system}, at the barrier without overlap", r["other"])]
        elif "other" in r:
            rows.append((f"{system}, {mode(not r['overlap'])}", r["other"]))
    for system, r in rows:
        if "error" in r:
            out.append(f"| {system} | failed: {r['error']} ||||||||||")
            continue
        ms = lambda v: "-" if v is None else f"{1000 * v:.0f}"  # noqa: E731
        mb = "-" if "bytes_per_step" not in r else f"{r['bytes_per_step'] / 1e6:.2f}"
        out.append(f"| {system} | {samples_per_step / r['step_s']:.1f} | {ms(r['step_s'])} | "
                   f"{ms(r.get('cpu_s'))} | {ms(r['compute_s'])} | {ms(r.get('compress_s'))} | "
                   f"{ms(r.get('wait_s'))} | "
                   f"{ms(max(0.0, r['step_s'] - r['compute_s']))} | {mb} | "
                   f"{speedup(ddp, r)} | {speedup(ps, r)} |")
    return out


def hidden_notes(by_system: dict) -> list[str]:
    """What overlap hides of ps-adtopk's communication, and what crossing the barrier hides."""
    out = []
    chosen = by_system.get("ps-adtopk", {})
    if "other" in chosen:
        ov, no = (chosen, chosen["other"]) if chosen["overlap"] else (chosen["other"], chosen)
        out.append(f"\nADTopk compression + communication hidden by the backward pass: {hidden_share(ov, no)} "
                   f"(step {1000 * ov['step_s']:.0f} ms with overlap, {1000 * no['step_s']:.0f} ms "
                   f"without, forward + backward alone {1000 * ov['compute_s']:.0f} ms: the three "
                   f"taking turns in one run)")
    crossing = by_system.get("ps-adtopk+crossbarrier", {})
    if "barrier" in crossing:
        at, no, ordered = crossing["barrier"], crossing["other"], crossing["ordered"]
        out.append(f"\nCrossing the barrier (ps-adtopk+crossbarrier): ADTopk compression + communication "
                   f"hidden by the backward and the next forward pass: {hidden_share(crossing, no)} with "
                   f"the pushes as they come, {hidden_share(ordered, no)} with them ordered by need "
                   f"behind a {crossing['credit'] >> 10} KiB credit window; by the backward pass alone, "
                   f"at the barrier: {hidden_share(at, no)} (step {1000 * crossing['step_s']:.0f} ms "
                   f"crossing the barrier, {1000 * ordered['step_s']:.0f} ms crossing it ordered, "
                   f"{1000 * at['step_s']:.0f} ms with overlap at the barrier, {1000 * no['step_s']:.0f} ms "
                   f"without, forward + backward alone {1000 * crossing['compute_s']:.0f} ms: the five "
                   f"taking turns in one run, in runs of {crossing['run']} steps, each run crossing the "
                   f"barrier ending by waiting for its last updates); crossing ordered against the "
                   f"barrier with overlap: {at['step_s'] / ordered['step_s']:.2f}x")
    return out


def cost_notes(by_system: dict) -> list[str]:
    """What the cost model measured and chose, for every system that ran it."""
    out = []
    partial = by_system.get("ps-adtopk", {}).get("dense")
    for system, r in by_system.items():
        if "cost" not in r:
            continue
        (n, total, share), cost = r["dense"], r["cost"]
        ring = f", all-reduced among the workers at {cost['allreduce_bytes_per_s'] / 1e6:.0f} MB/s" \
            if cost["allreduce_bytes_per_s"] else ""
        out.append(f"\nCost model ({system}): dense push + pull measured at "
                   f"{cost['bytes_per_s'] / 1e6:.0f} MB/s through the servers{ring}, ADTopk at "
                   f"{1e9 * cost['s_per_element']:.1f} ns per element, one more key at "
                   f"{1000 * cost['key_s']:.2f} ms; dense tensors went "
                   f"{'by all-reduce' if cost['allreduce'] else 'through the servers'}; it sent "
                   f"{n} of {total} tensors dense ({share:.1%} of the parameters)" +
                   (f", where partial sparsification alone sends {partial[0]} ({partial[2]:.1%})"
                    if partial else ""))
    return out


def scaling_table(results: dict) -> list[str]:
    """--scaling: every system's step against model size and workers."""
    systems = list(next(iter(results.values())))
    out = ["#### Step time (ms) against model size and workers", "",
           "| model | params (M) | workers | " + " | ".join(systems) + " |",
           "|---|---:|---:|" + "---:|" * len(systems)]
    for (model, _, workers), by_system in results.items():
        params = next((r["params"] for r in by_system.values() if "params" in r), 0)
        steps = [f"{1000 * by_system[s]['step_s']:.0f}" if "step_s" in by_system.get(s, {}) else "-"
                 for s in systems]
        out.append(f"| {model} | {params / 1e6:.1f} | {workers} | " + " | ".join(steps) + " |")
    out.append("")
    return out


def mode(overlap: bool) -> str:
    return "overlap" if overlap else "no overlap"


def chart(results: dict, trials: dict, path: Path) -> None:
    """Bars of step speed against DDP dense: --paired's ratio where a system has one, else
    against DDP dense's own run; none, said so, without matplotlib (the report is written)."""
    try:
        import matplotlib
    except ImportError:
        print(f"e2e benchmark: no chart ({path.name}): matplotlib is not installed", flush=True)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    speeds = {}
    for group, by_system in results.items():
        ddp = by_system.get("ddp-dense", {}).get("step_s")
        speeds[group] = {system: paired_speed(trials[group][system])
                         or (ddp / r["step_s"] if ddp and "step_s" in r else 0.0)
                         for system, r in by_system.items()}
    groups = [g for g in speeds if any(speeds[g].values())]
    if not groups:
        return
    systems = list(results[groups[0]])
    fig, ax = plt.subplots(figsize=(max(6, 2.5 * len(groups)), 4.5))
    width = 0.8 / len(systems)
    for i, system in enumerate(systems):
        ax.bar([j + i * width for j in range(len(groups))], [speeds[g].get(system, 0.0) for g in groups],
               width, label=system)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(groups))],
                  [f"{m}\n{link}, W={w}" for m, link, w in groups])
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_ylabel("step speed vs DDP dense (x)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plan(args: argparse.Namespace) -> list[tuple[str, int, list[str], list[str]]]:
    """(link, workers, models, systems) to run; --scaling: model size at W=2, then W=1, 2, 4."""
    if not args.scaling:
        return [(link, args.workers, args.models, args.systems) for link in args.links]
    link = args.links[0]
    return [(link, 2, ["vgg-1024", "vgg-2048", "vgg"], SCALING_SYSTEMS),
            (link, 1, ["vgg"], SCALING_SYSTEMS), (link, 4, ["vgg"], SCALING_SYSTEMS)]


def parse_args() -> argparse.Namespace:
    """The command line (see the module's docstring); --worker and the options after it are
    the driver's to its workers."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--models", nargs="*", default=["vgg"], choices=sorted(MODELS))
    ap.add_argument("--links", nargs="*", default=["1gbit", "10gbit"],
                    help="tc rates (1gbit, 25gbit, ...), or loopback: every role on this machine, unshaped")
    ap.add_argument("--systems", nargs="*", default=list(SYSTEMS), choices=list(SYSTEMS))
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--servers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=10, help="timed rounds")
    ap.add_argument("--trials", type=int, default=2,
                    help="runs of every system; the report keeps each system's fastest")
    ap.add_argument("--warmup", type=int, default=3, help="untimed rounds first")
    ap.add_argument("--ratio", type=float, default=0.01)
    ap.add_argument("--credit", type=int, default=256 << 10,
                    help="ps-adtopk+crossbarrier's credit window when ordered by need, bytes")
    ap.add_argument("--overlap", default="auto", choices=list(OVERLAP),
                    help="the PS systems' overlap (auto: the step trial chooses)")
    ap.add_argument("--scaling", action="store_true",
                    help="step time against model size (3 VGG sizes) and workers (1, 2, 4), first link only")
    ap.add_argument("--paired", action="store_true",
                    help="PS workers also step a copy of the model under DDP dense, round by round")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="where the workers train: cuda puts worker i on GPU i mod the GPUs visible")
    ap.add_argument("--out", default=str(ROOT / "docs"))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--system", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--master", help=argparse.SUPPRESS)
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    if args.worker:
        return worker(args)
    from adtopk_ps.testing import netns
    require_gpu(args.device, "e2e benchmark")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the namespaces are deleted
    why = netns.unavailable()
    if why and set(args.links) != {"loopback"}:
        sys.exit(f"e2e benchmark: {why} (--links loopback runs every role on this machine, unshaped)")
    results = run_plan(args)
    write_report(results, args)
    if all("error" in r for trials in results.values() for runs in trials.values() for r in runs):
        sys.exit("e2e benchmark: every run failed (see above)")


def run_plan(args: argparse.Namespace) -> dict:
    """Every run of the plan: (model, link, workers) -> system -> its trials (a failed one is
    {"error": its last error line}), the order flipping each trial so drift hits all alike."""
    from adtopk_ps.testing import netns
    results: dict = {}
    for link, workers, models, systems in plan(args):
        names = role_names("ps", args.servers, workers)
        args.workers = workers
        with netns.loopback(names) if link == "loopback" else netns.hosts(names, rate=link) as net:
            for model in models:
                by_system = results.setdefault((model, link, workers), {s: [] for s in systems})
                for trial in range(args.trials):
                    for system in systems if trial % 2 == 0 else systems[::-1]:
                        result = run_or_error(net, system, model, args)
                        print(f"{model} {link} W={workers} {system} trial {trial}: {result}", flush=True)
                        by_system[system].append(result)
    return results


def run_or_error(net: dict, system: str, model: str, args: argparse.Namespace) -> dict:
    """:func:`run_system`'s result, or {"error": the failure's last error line}."""
    try:
        return run_system(net, system, model, args)
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        lines = str(exc).splitlines()
        print(str(exc)[-3000:], file=sys.stderr, flush=True)
        return {"error": next((ln.strip() for ln in reversed(lines) if "Error: " in ln), lines[0])}


def write_report(results: dict, args: argparse.Namespace) -> None:
    """The report and its chart under --out, named for the run; the report printed too."""
    best = best_of(results)
    text = report(results, best, args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "e2e-scaling" if args.scaling else "-".join(["e2e", *args.models]) if args.models != ["vgg"] else "e2e"
    stem += "-paired" if args.paired else ""
    (out / f"{stem}.md").write_text(text + "\n")
    chart(best, results, out / f"{stem}.png")
    print(text)


if __name__ == "__main__":
    main()
