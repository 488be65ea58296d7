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

Every PS system runs with the optimizer's default overlap="auto": its trial
chooses in steps of their own before the timed rounds (timing
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
each layer waits for its own update in the next forward pass); its rounds also
time, on a copy of the model, the plain optimizer with overlap (at the barrier)
and without, and it reports what crossing hides by the same formula and what
overlap at the barrier hides. A cross-barrier step's communication lands
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
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SYSTEMS = {
    "ps-dense": {"kind": "ps", "compressor": "none"},
    "ps-topk": {"kind": "ps", "compressor": "topk"},
    "ps-adtopk": {"kind": "ps", "compressor": "adtopk", "measure_overlap": True},
    "ps-adtopk+cost": {"kind": "ps", "compressor": "adtopk", "cost": True},
    # the cost model, and dense tensors all-reduced among the workers where that measures faster
    "ps-adtopk+hybrid": {"kind": "ps", "compressor": "adtopk", "cost": True, "dense": "auto"},
    "ps-adtopk-i": {"kind": "ps", "compressor": "adtopk-i"},
    # each layer's update applied in the next forward pass (adtopk_ps.torch.cross_barrier)
    "ps-adtopk+crossbarrier": {"kind": "ps", "compressor": "adtopk", "crossbarrier": True},
    "ddp-dense": {"kind": "ddp", "hook": "none"},
    "ddp-powersgd": {"kind": "ddp", "hook": "powersgd"},
    "ddp-adtopk": {"kind": "ddp", "hook": "adtopk"},
}
# a cross-barrier step leaves its communication to the next forward pass: its system's kinds
# are timed in runs of this many consecutive steps, the cross-barrier run ending by waiting for
# its last updates (see worker())
CROSSBARRIER_RUN = 4
# steps the overlap="auto" trial times each way (jobs default to 8; PS_OVERLAP_TRIAL_STEPS overrides)
OVERLAP_TRIAL_STEPS = 4
# name: (architecture, its parameters, input kind). "vgg" has VGG's own 4096-wide classifier;
# the smaller two are the scaling study's model sizes
SCALING_SYSTEMS = ["ps-dense", "ps-adtopk", "ddp-dense", "ddp-powersgd"]
MODELS = {"vgg": ("vgg", {"hidden": 4096}, "images"),
          "vgg-2048": ("vgg", {"hidden": 2048}, "images"),
          "vgg-1024": ("vgg", {"hidden": 1024}, "images"),
          "resnet18": ("resnet18", {"width": 32}, "images"),
          "transformer": ("transformer", {"dim": 256, "layers": 4}, "tokens")}


# --- one worker ------------------------------------------------------------------------

def worker(args: argparse.Namespace) -> None:
    import torch

    from adtopk_ps.compression.cost import synchronize
    from worker.models import build
    torch.set_num_threads(1)
    arch, spec, inputs = MODELS[args.model]
    system = SYSTEMS[args.system]
    # every worker is a host of its own here (local rank 0): GPUs go round-robin by worker
    device = torch.device("cuda", int(os.environ["DMLC_WORKER_ID"]) % torch.cuda.device_count()) \
        if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)  # Triton's kernels and the CUDA context follow it
    torch.manual_seed(0)
    model = build(arch, spec).to(device)
    twin = copy.deepcopy(model)  # for compute alone: no optimizer hooks, no DDP reducer on it
    gen = torch.Generator().manual_seed(1)
    if inputs == "images":
        x, y = torch.randn(args.batch, 3, 32, 32, generator=gen), torch.randint(0, 10, (args.batch,), generator=gen)
    else:
        x = torch.randint(0, 256, (args.batch, 64), generator=gen)
        y = torch.randint(0, 256, (args.batch, 64), generator=gen)
    x, y = x.to(device), y.to(device)

    def loss_of(net):
        out = net(x)
        return torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))

    def interleaved(kinds: dict, rounds: int) -> dict[str, tuple[float, float, list[float]]]:
        """Wall and CPU seconds (every thread of this worker) per step of each kind, and each
        round's wall seconds, the kinds taking turns, so that this machine's drift slows them
        alike; the order rotates every round, so that each kind follows each other kind as
        often (in a fixed order the system's step always came right after the twin's forward
        + backward and the step the other way right after it, and whatever the one before
        leaves behind, caches or allocator state, fell on one kind). ``kinds``: name ->
        (prepare, step); prepare is not timed."""
        wall = {name: [] for name in kinds}
        cpu = dict.fromkeys(kinds, 0.0)
        names = list(kinds)
        for turn in range(rounds):
            for name in names[turn % len(names):] + names[:turn % len(names)]:
                prepare, fn = kinds[name]
                prepare()
                synchronize(device)
                started, cpu_started = time.perf_counter(), time.process_time()
                fn()
                synchronize(device)  # a GPU step ends when its queued kernels have run
                wall[name].append(time.perf_counter() - started)
                cpu[name] += time.process_time() - cpu_started
        return {name: (sum(wall[name]) / rounds, cpu[name] / rounds, wall[name]) for name in kinds}

    def local_step():
        twin.zero_grad()
        loss_of(twin).backward()

    def nothing():
        pass

    # (crossing the barrier compares itself with the plain optimizer in its own rounds instead)
    paired = args.paired and system["kind"] == "ps" and not system.get("crossbarrier")
    if paired:  # DDP's copy of the model starts from the same weights
        ddp_model = copy.deepcopy(model)
    if system["kind"] == "ps":
        import adtopk_ps.torch as bps
        bps.init()
    if system["kind"] == "ddp" or paired:
        import torch.distributed as dist
        dist.init_process_group("gloo", init_method=f"tcp://{args.master}",
                                rank=int(os.environ["DMLC_WORKER_ID"]), world_size=args.workers)
    result = {"params": sum(p.numel() for p in model.parameters())}
    ratio = args.ratio

    def ddp_step(net, hook: str):
        """One training step of ``net`` under torch DDP on gloo, with ``hook`` on its buckets."""
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

        import adtopk_ps.torch as bps
        # PowerSGD issues its later collectives from future callbacks; with two buckets in
        # flight gloo can see them in different orders on different ranks ("collective
        # mismatch"), so it gets one bucket
        ddp = torch.nn.parallel.DistributedDataParallel(net, bucket_cap_mb=1024 if hook == "powersgd" else 25)
        if hook == "powersgd":
            ddp.register_comm_hook(powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=2,
                                                          start_powerSGD_iter=2),
                                   powersgd.powerSGD_hook)
        elif hook == "adtopk":
            ddp.register_comm_hook(bps.ADTopkHookState(net, {"compressor": "adtopk", "k": ratio,
                                                             "ef": "vanilla"}), bps.adtopk_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)

        def step():
            opt.zero_grad()
            loss_of(ddp).backward()
            opt.step()
        return step

    if system["kind"] == "ps":
        from adtopk_ps.compression import SparsificationPolicy
        name = system["compressor"]
        compression = bps.GradientCompression(
            None if name == "none" else {"compressor": name, "k": ratio, "ef": "vanilla"},
            SparsificationPolicy(ratio if name != "none" else 1.0),
            measure_costs=system.get("cost", False), dense_transport=system.get("dense", "ps"))
        client = bps.client()
        if system.get("crossbarrier"):
            result.update(crossbarrier(args, model, twin, loss_of, interleaved, compression, client))
            rank = bps.rank()
            bps.shutdown()
            if rank == 0:
                print("RESULT " + json.dumps(result), flush=True)
            return
        opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                       model.named_parameters(), compression)  # overlap="auto"
        waits: dict[str, list[float]] = {"step": [], "other": []}

        def step(kind):
            opt.zero_grad()
            loss_of(model).backward()
            began = time.perf_counter()
            opt.synchronize()
            waits[kind].append(time.perf_counter() - began)
            with opt.skip_synchronize():
                opt.step()

        # the step trial (overlap, and with the cost model its routes against every tensor
        # dense) chooses in steps of its own, then every kind warms up; every worker chooses
        # at the same step
        while opt.choosing:
            interleaved({"step": (nothing, lambda: step("step"))}, 1)
        chose = opt.overlap
        kinds = {"compute": (nothing, local_step), "step": (nothing, lambda: step("step"))}
        if system.get("measure_overlap"):  # the same steps the other way, to measure what overlap hides
            kinds["step"] = (lambda: opt.set_overlap(chose), lambda: step("step"))
            kinds["other"] = (lambda: opt.set_overlap(not chose), lambda: step("other"))
        if paired:
            kinds["ddp"] = (nothing, ddp_step(ddp_model, "none"))
            # every kind starts with the workers in step: the lead one worker gains in a kind
            # that does not synchronise (compute alone) is otherwise waited out by whichever
            # step comes next, and with three kinds in rotation that is not each step as often
            kinds = {name: (lambda prepare=prepare: (dist.barrier(), prepare()), fn)
                     for name, (prepare, fn) in kinds.items()}
        interleaved(kinds, args.warmup)
        moved = lambda: client.bytes_pushed + client.bytes_pulled + opt.allreduce_bytes  # noqa: E731
        c0, b0 = client.compress_seconds, moved()
        times = interleaved(kinds, args.steps)
        pushes = args.steps * len(set(kinds) - {"compute", "ddp"})  # both kinds of PS step push the same

        def summary(kind: str) -> dict:
            return {"compute_s": times["compute"][0], "step_s": times[kind][0], "cpu_s": times[kind][1],
                    "wait_s": sum(waits[kind][-args.steps:]) / args.steps,
                    "compress_s": (client.compress_seconds - c0) / pushes,
                    "bytes_per_step": (moved() - b0) / pushes}

        result.update(summary("step"), overlap=chose)
        if paired:
            result["paired"] = {"ddp_cpu_s": times["ddp"][1],
                                "rounds": list(zip(times["step"][2], times["ddp"][2]))}
        sizes = {name: p.numel() for name, p in model.named_parameters()}
        dense = [name for name, route in compression.routes.items() if route.dense]
        result["dense"] = [len(dense), len(sizes), sum(sizes[n] for n in dense) / sum(sizes.values())]
        cost = compression.costs
        if cost is not None:
            result["cost"] = {"bytes_per_s": cost.bytes_per_s, "s_per_element": cost.compress_s_per_element,
                              "key_s": cost.key_s, "allreduce_bytes_per_s": compression.allreduce_bytes_per_s,
                              "allreduce": compression.allreduce}
        if "other" in times:
            result["other"] = summary("other")
        rank = bps.rank()
        bps.shutdown()
    else:
        rank = dist.get_rank()
        kinds = {"compute": (nothing, local_step), "step": (nothing, ddp_step(model, system["hook"]))}
        interleaved(kinds, args.warmup)
        times = interleaved(kinds, args.steps)
        result.update(compute_s=times["compute"][0], step_s=times["step"][0], cpu_s=times["step"][1])
    if system["kind"] == "ddp" or paired:
        dist.destroy_process_group()
    if rank == 0:
        print("RESULT " + json.dumps(result), flush=True)


def crossbarrier(args: argparse.Namespace, model, twin, loss_of, interleaved, compression,
                 client) -> dict:
    """ps-adtopk+crossbarrier's rounds: forward + backward alone, the cross-barrier step, and
    on a copy of the model the plain optimizer with overlap and without, each kind a run of
    CROSSBARRIER_RUN consecutive steps (the cross-barrier run ending by waiting for its last
    updates, so that none of its communication lands during another kind's turn)."""
    import torch

    import adtopk_ps.torch as bps
    from adtopk_ps.compression import SparsificationPolicy
    from adtopk_ps.torch.cross_barrier import CrossBarrier
    base = copy.deepcopy(model)
    cb = CrossBarrier(model, torch.optim.SGD(model.parameters(), lr=0.01),
                      named_parameters=model.named_parameters(), compression=compression)
    plain = bps.DistributedOptimizer(
        torch.optim.SGD(base.parameters(), lr=0.01), base.named_parameters(),
        bps.GradientCompression({"compressor": "adtopk", "k": args.ratio, "ef": "vanilla"},
                                SparsificationPolicy(args.ratio)), overlap=True, key_prefix="barrier.")
    run = CROSSBARRIER_RUN
    waits: dict[str, list[float]] = {"step": [], "barrier": [], "other": []}

    def steps(net, opt, kind: str):
        def go():
            for _ in range(run):
                opt.zero_grad()
                loss_of(net).backward()
                began = time.perf_counter()
                if opt is cb:
                    opt.step()
                else:
                    opt.synchronize()
                    with opt.skip_synchronize():
                        opt.step()
                waits[kind].append(time.perf_counter() - began)
            if opt is cb:  # the run's last updates, counted as exposed
                began = time.perf_counter()
                cb.synchronize()
                waits[kind][-1] += time.perf_counter() - began
        return go

    def alone():
        for _ in range(run):
            twin.zero_grad()
            loss_of(twin).backward()

    kinds = {"compute": (lambda: None, alone), "step": (lambda: None, steps(model, cb, "step")),
             "barrier": (lambda: plain.set_overlap(True), steps(base, plain, "barrier")),
             "other": (lambda: plain.set_overlap(False), steps(base, plain, "other"))}
    interleaved(kinds, args.warmup)
    moved = lambda: client.bytes_pushed + client.bytes_pulled  # noqa: E731
    c0, b0 = client.compress_seconds, moved()
    times = interleaved(kinds, args.steps)
    pushes = args.steps * run * 3  # the three PS kinds push the same

    def summary(kind: str) -> dict:
        return {"compute_s": times["compute"][0] / run, "step_s": times[kind][0] / run,
                "cpu_s": times[kind][1] / run, "wait_s": sum(waits[kind][-args.steps * run:]) / (args.steps * run),
                "compress_s": (client.compress_seconds - c0) / pushes,
                "bytes_per_step": (moved() - b0) / pushes}

    # (the routes are named by the cross-barrier's server keys, in the model's order)
    sizes = [p.numel() for p in model.parameters()]
    dense = [n for n, route in zip(sizes, compression.routes.values()) if route.dense]
    return {**summary("step"), "barrier": summary("barrier"), "other": summary("other"),
            "run": run, "dense": [len(dense), len(sizes), sum(dense) / sum(sizes)]}


def hidden_share(overlapped: dict, without: dict) -> str:
    """1 - (overlapped step - compute) / (step without overlap - compute), or "-" where noise
    leaves nothing exposed without overlap."""
    exposed = without["step_s"] - without["compute_s"]
    return "-" if exposed <= 0 else \
        f"{1 - max(0.0, overlapped['step_s'] - overlapped['compute_s']) / exposed:.0%}"


# --- the driver ------------------------------------------------------------------------

def run_system(net: dict, system: str, model: str, args: argparse.Namespace) -> dict:
    from adtopk_ps.allocator import keep_freed_memory
    from adtopk_ps.launcher import free_port
    from adtopk_ps.testing import netns
    kind = SYSTEMS[system]["kind"]
    shared = net["scheduler"][0] is None  # loopback: every role on this machine, so no fixed ports
    workers = [f"worker{i}" for i in range(args.workers)]
    roles = (["scheduler"] + [f"server{i}" for i in range(args.servers)] if kind == "ps" else []) + workers
    # DDP's workers get the allocator settings bpslaunch gives ours, so compute costs the same
    env = keep_freed_memory({k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "BYTEPS_"))})
    env.update(DMLC_PS_ROOT_URI=net["scheduler"][1], DMLC_PS_ROOT_PORT=str(free_port() if shared else 9000),
               DMLC_NUM_SERVER=str(args.servers), DMLC_NUM_WORKER=str(args.workers),
               BYTEPS_LOCAL_SIZE="1", OMP_NUM_THREADS="1",
               # gloo's own address lookup would leave the namespace; likewise NCCL's (the hybrid
               # lane, GPU workers)
               GLOO_SOCKET_IFNAME="lo" if shared else "eth0",
               NCCL_SOCKET_IFNAME="lo" if shared else "eth0")
    env.setdefault("PS_OVERLAP_TRIAL_STEPS", str(OVERLAP_TRIAL_STEPS))
    job = [sys.executable, __file__, "--worker", "--system", system, "--model", model,
           "--batch", str(args.batch), "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--ratio", str(args.ratio), "--workers", str(args.workers),
           "--master", f"{net['worker0'][1]}:{free_port() if shared else 29500}",
           "--device", args.device] + \
        (["--paired"] if args.paired else [])
    procs = []
    try:
        for role in roles:
            role_env = {**env, "DMLC_ROLE": role.rstrip("0123456789")}
            if role.startswith("worker"):
                role_env["DMLC_WORKER_ID"] = role[len("worker"):]
            argv = ([sys.executable, "-m", "adtopk_ps.launcher"] if kind == "ps" else []) + \
                (job if role.startswith("worker") else [])
            procs.append(netns.run_in(net[role][0], argv, role_env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, cwd=ROOT))
        outputs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
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


def paired_speed(trials: list[dict]) -> float | None:
    """--paired: DDP dense's mean step over the PS system's, every trial's rounds pooled."""
    pairs = [pair for r in trials if "paired" in r for pair in r["paired"]["rounds"]]
    return speed_of(pairs) if pairs else None


def speed_of(pairs: list) -> float:
    return statistics.mean(d for _, d in pairs) / statistics.mean(p for p, _ in pairs)


def interval(pairs: list, draws: int = 2000, seed: int = 0) -> tuple[float, float]:
    """The 5th and 95th percentiles of ``speed_of`` over rounds resampled with replacement:
    how far the pooled ratio could move with other rounds of the same noise."""
    rng = random.Random(seed)
    speeds = sorted(speed_of(rng.choices(pairs, k=len(pairs))) for _ in range(draws))
    return speeds[draws // 20], speeds[draws - 1 - draws // 20]


def paired(by_system: dict) -> list[str]:
    """--paired: each PS system against DDP dense timed in the same processes, round by round."""
    out = []
    for system, trials in by_system.items():
        ran = [r["paired"] for r in trials if "paired" in r]
        if not ran:
            continue
        pairs = [pair for r in ran for pair in r["rounds"]]
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
        ddp, ps = by_system.get("ddp-dense"), by_system.get("ps-dense")
        params = next((r["params"] for r in by_system.values() if "params" in r), 0)
        out += [f"#### {model} ({params / 1e6:.1f} M params), {link}, {workers} workers x {args.servers} "
                f"servers, batch {args.batch}", "",
                "| system | samples/s | step ms | worker CPU ms | compute | compress | wait after backward "
                "| exposed comm | MB per step | vs DDP dense | vs PS dense |",
                "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        rows = []
        for system, r in by_system.items():
            # every tensor went dense: the step trial kept that plan, or the cost model chose it
            every = "cost" in r and r["dense"][0] == r["dense"][1]
            rows.append((system + (f" (chose {mode(r['overlap'])}{', every tensor dense' if every else ''})"
                                   if "overlap" in r else ""), r))
            if "barrier" in r:  # crossing the barrier, against the plain optimizer at it
                rows += [(f"{system}, at the barrier with overlap", r["barrier"]),
                         (f"{system}, at the barrier without overlap", r["other"])]
            elif "other" in r:
                rows.append((f"{system}, {mode(not r['overlap'])}", r["other"]))
        for system, r in rows:
            if "error" in r:
                out.append(f"| {system} | failed: {r['error']} ||||||||||")
                continue
            ms = lambda v: "-" if v is None else f"{1000 * v:.0f}"  # noqa: E731
            mb = "-" if "bytes_per_step" not in r else f"{r['bytes_per_step'] / 1e6:.2f}"
            out.append(f"| {system} | {workers * args.batch / r['step_s']:.1f} | {ms(r['step_s'])} | "
                       f"{ms(r.get('cpu_s'))} | {ms(r['compute_s'])} | {ms(r.get('compress_s'))} | "
                       f"{ms(r.get('wait_s'))} | "
                       f"{ms(max(0.0, r['step_s'] - r['compute_s']))} | {mb} | "
                       f"{speedup(ddp, r)} | {speedup(ps, r)} |")
        chosen = by_system.get("ps-adtopk", {})
        if "other" in chosen:
            ov, no = (chosen, chosen["other"]) if chosen["overlap"] else (chosen["other"], chosen)
            out.append(f"\nADTopk compression + communication hidden by the backward pass: {hidden_share(ov, no)} "
                       f"(step {1000 * ov['step_s']:.0f} ms with overlap, {1000 * no['step_s']:.0f} ms "
                       f"without, forward + backward alone {1000 * ov['compute_s']:.0f} ms: the three "
                       f"taking turns in one run)")
        crossing = by_system.get("ps-adtopk+crossbarrier", {})
        if "barrier" in crossing:
            at, no = crossing["barrier"], crossing["other"]
            out.append(f"\nCrossing the barrier (ps-adtopk+crossbarrier): ADTopk compression + communication "
                       f"hidden by the backward and the next forward pass: {hidden_share(crossing, no)}; by the "
                       f"backward pass alone, at the barrier: {hidden_share(at, no)} (step "
                       f"{1000 * crossing['step_s']:.0f} ms crossing the barrier, {1000 * at['step_s']:.0f} ms "
                       f"with overlap at the barrier, {1000 * no['step_s']:.0f} ms without, forward + backward "
                       f"alone {1000 * crossing['compute_s']:.0f} ms: the four taking turns in one run, in runs "
                       f"of {crossing['run']} steps, the run crossing the barrier ending by waiting for its "
                       f"last updates)")
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
        out += trial_by_trial(trials[(model, link, workers)])
        out += paired(trials[(model, link, workers)])
        out.append("")
    if args.scaling:
        systems = list(next(iter(results.values())))
        out += ["#### Step time (ms) against model size and workers", "",
                "| model | params (M) | workers | " + " | ".join(systems) + " |",
                "|---|---:|---:|" + "---:|" * len(systems)]
        for (model, _, workers), by_system in results.items():
            params = next((r["params"] for r in by_system.values() if "params" in r), 0)
            steps = [f"{1000 * by_system[s]['step_s']:.0f}" if "step_s" in by_system.get(s, {}) else "-"
                     for s in systems]
            out.append(f"| {model} | {params / 1e6:.1f} | {workers} | " + " | ".join(steps) + " |")
        out.append("")
    return "\n".join(out)


def mode(overlap: bool) -> str:
    return "overlap" if overlap else "no overlap"


def chart(results: dict, trials: dict, path: Path) -> None:
    """Bars of step speed against DDP dense: --paired's ratio where a system has one, else
    against DDP dense's own run."""
    import matplotlib
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


def main() -> None:
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
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    from adtopk_ps.testing import netns
    if args.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            sys.exit("e2e benchmark: --device cuda, but torch sees no GPU here")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the namespaces are deleted
    why = netns.unavailable()
    if why and set(args.links) != {"loopback"}:
        sys.exit(f"e2e benchmark: {why} (--links loopback runs every role on this machine, unshaped)")
    results: dict = {}
    for link, workers, models, systems in plan(args):
        names = ["scheduler"] + [f"server{i}" for i in range(args.servers)] + \
            [f"worker{i}" for i in range(workers)]
        args.workers = workers
        with netns.loopback(names) if link == "loopback" else netns.hosts(names, rate=link) as net:
            for model in models:
                by_system = results.setdefault((model, link, workers), {s: [] for s in systems})
                for trial in range(args.trials):  # the order flips each trial, so drift hits all alike
                    for system in systems if trial % 2 == 0 else systems[::-1]:
                        try:
                            result = run_system(net, system, model, args)
                        except (RuntimeError, subprocess.TimeoutExpired) as exc:
                            lines = str(exc).splitlines()
                            result = {"error": next((ln.strip() for ln in reversed(lines) if "Error: " in ln),
                                                    lines[0])}
                            print(str(exc)[-3000:], file=sys.stderr, flush=True)
                        print(f"{model} {link} W={workers} {system} trial {trial}: {result}", flush=True)
                        by_system[system].append(result)
    best = best_of(results)
    text = report(results, best, args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "e2e-scaling" if args.scaling else "-".join(["e2e", *args.models]) if args.models != ["vgg"] else "e2e"
    stem += "-paired" if args.paired else ""
    (out / f"{stem}.md").write_text(text + "\n")
    chart(best, results, out / f"{stem}.png")
    print(text)
    if all("error" in r for trials in results.values() for runs in trials.values() for r in runs):
        sys.exit("e2e benchmark: every run failed (see above)")


if __name__ == "__main__":
    main()
