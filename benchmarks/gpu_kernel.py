"""The CUDA fibre kernel on whole gradient sets: its own time, the host's, and the references.

For each gradient set (benchmarks/compression.py's ResNet-50, VGG-16 and BERT-base
shapes, the tensors the default policy sends sparse), dtype, with and without error
feedback, and for each of the two paths, kept apart:

- per-tensor: one ``fibre_triton.select([item])`` a tensor, as a job compresses them;
- batched: one ``fibre_triton.select(items)`` for the whole set;

it prints one line as soon as it is measured:

- kernel ms: the kernel alone, from CUDA events recorded at each launch (Triton's launch
  hooks) while the GPU is kept busy by a sleep kernel queued before each select(), so that
  every launch waits in the queue and no host work lies between the events;
- host ms: the Python/torch work of select() around the launches (the wall time of a call
  less the time it blocks waiting for the copy to host), in total, per select() call and
  per tensor (goal: at most 20 us a tensor on the batched path);
- wall ms: select() from call to host bytes ready, what a job waits for;

and each against the references measured in the same run on the same tensors
(``compression.references``: one global ``torch.topk`` over all of them, and reading them
once), both timed the same way (CUDA events, GPU kept busy). The goals: at most 0.5x the
global top-k and at most 10x reading once. Each set's largest tensor (VGG-16's fc1,
4096 x 25088) gets lines of its own against references on that tensor alone.

No compile is timed: every configuration is called (untimed) before it is timed, and a
Triton hook counts compiles and cache loads; a count above 0 inside the timed calls is
printed as a warning. ``--warm`` compiles every kernel the timed run needs, in parallel
processes, by making exactly the calls the timed run makes once: the same specializations
land in Triton's on-disk cache (TRITON_CACHE_DIR) and the timed run only loads them.

    python benchmarks/gpu_kernel.py --warm                # fill the compile cache, in parallel
    python benchmarks/gpu_kernel.py --json out.json       # the figures
    TRITON_INTERPRET=1 python benchmarks/gpu_kernel.py --device cpu --sets tiny --reps 2
                                                          # the flow on a CPU (interpreter)
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from multiprocessing import get_context
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # compression.py, beside this file
from compression import GRADIENT_SETS, references, sparsified  # noqa: E402

from adtopk_ps.compression import fibre_k, fibre_triton  # noqa: E402
from adtopk_ps.compression.staging import Stage  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PATHS = ("per-tensor", "batched")
GOAL_TOPK, GOAL_READ = 0.5, 10.0
GOAL_HOST_US = 20.0  # host work a tensor, batched
FC1 = (4096, 25088)


# ---- what is timed: the same calls in --warm and in the timed run ----

def gradients(name: str, dtype: torch.dtype, device: torch.device) -> tuple[list[torch.Tensor], int]:
    """The set's sparsified tensors that the kernel takes, random normal, made on the device
    (seeded), and how many it does not take (select.py's path: left out here, named)."""
    gen = torch.Generator(device=device).manual_seed(0)
    grads = [torch.randn(s, generator=gen, device=device).to(dtype)
             for s in sparsified(GRADIENT_SETS[name](), dtype)]
    taken = [g for g in grads if fibre_triton.applies(g)]
    return taken, len(grads) - len(taken)


def items_of(grads: list[torch.Tensor], feedback: bool, density: float) -> list[fibre_triton.Item]:
    """One item a tensor, its fibres along axis 1 keeping ``fibre_k`` entries each (ADTopk's
    layout); with feedback the residual (zeros at first) takes the gradient."""
    return [fibre_triton.Item(torch.zeros_like(g), g, fibre_k(g.shape[1], density)) if feedback
            else fibre_triton.Item(g, None, fibre_k(g.shape[1], density)) for g in grads]


class TimedStage(Stage):
    """A :class:`Stage` that adds up the seconds select() blocks waiting for its host copy."""

    def __init__(self, device: torch.device):
        super().__init__(device)
        self.blocked = 0.0

    def wait(self) -> None:
        started = time.perf_counter()
        super().wait()
        self.blocked += time.perf_counter() - started


def calls_of(items: list[fibre_triton.Item], path: str, device: torch.device
             ) -> tuple[list, list[TimedStage]]:
    """The select() calls of one pass over the set on ``path`` (per tensor: one call and one
    stage a tensor, as a job keeps them; batched: one call), and their stages."""
    if path == "batched":
        stage = TimedStage(device)
        return [lambda: fibre_triton.select(items, stage)], [stage]
    stages = [TimedStage(device) for _ in items]
    return [lambda item=item, stage=stage: fibre_triton.select([item], stage)
            for item, stage in zip(items, stages)], stages


# ---- clocks and hooks ----

class Clock:
    """Stamps on the device's queue (CUDA events) or, on a CPU, the host's clock."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.cycles_per_s = self._calibrate() if self.cuda else 0.0

    def stamp(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start, end) -> float:
        return start.elapsed_time(end) / 1e3 if self.cuda else end - start

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def busy(self, seconds: float) -> None:
        """Queue a sleep kernel of about ``seconds``: the work queued after it waits, so the
        host's time to queue it does not show between events (nothing on a CPU)."""
        if self.cuda:
            torch.cuda._sleep(max(1, int(seconds * self.cycles_per_s)))

    def _calibrate(self) -> float:
        cycles = 2_000_000
        torch.cuda._sleep(cycles)  # the first call loads the kernel
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        return cycles / (start.elapsed_time(end) / 1e3)


class Launches:
    """A count of the kernels Triton compiles or loads from its cache (its JIT cache hook) while
    entered, and, inside :meth:`stamping`, stamps before and after every Triton launch (its
    launch hooks, attached only there: they cost the host a little at every launch)."""

    def __init__(self, clock: Clock):
        self.clock, self.pairs, self.compiles = clock, [], 0

    def _enter(self, *_):
        self.pairs.append([self.clock.stamp(), None])

    def _exit(self, *_):
        self.pairs[-1][1] = self.clock.stamp()

    def _compiling(self, *_, **__):
        self.compiles += 1
        return None  # go on compiling

    def __enter__(self) -> "Launches":
        from triton import knobs
        self._saved = knobs.runtime.jit_cache_hook
        knobs.runtime.jit_cache_hook = self._compiling
        return self

    def __exit__(self, *_):
        from triton import knobs
        knobs.runtime.jit_cache_hook = self._saved

    @contextlib.contextmanager
    def stamping(self):
        """Stamps into ``self.pairs`` at every launch, while inside."""
        from triton import knobs
        runtime = knobs.runtime
        chained = hasattr(runtime.launch_enter_hook, "add")  # Triton 3.4+: chains of hooks
        if chained:
            runtime.launch_enter_hook.add(self._enter)
            runtime.launch_exit_hook.add(self._exit)
        else:
            saved = runtime.launch_enter_hook, runtime.launch_exit_hook
            runtime.launch_enter_hook, runtime.launch_exit_hook = self._enter, self._exit
        kernel = None
        if fibre_triton.interpreted():  # the interpreter calls no launch hooks: call them here
            from adtopk_ps.compression import _fibre_kernel
            kernel, run = _fibre_kernel.kernel, type(_fibre_kernel.kernel).run

            def hooked(*args, **kwargs):
                self._enter()
                try:
                    return run(kernel, *args, **kwargs)
                finally:
                    self._exit()
            kernel.run = hooked
        try:
            yield
        finally:
            if chained:
                runtime.launch_enter_hook.remove(self._enter)
                runtime.launch_exit_hook.remove(self._exit)
            else:
                runtime.launch_enter_hook, runtime.launch_exit_hook = saved
            if kernel is not None:
                del kernel.run


def cache_entries() -> tuple[str, int]:
    """Triton's on-disk compile cache and the kernels in it."""
    try:
        from triton import knobs
        folder = knobs.cache.dir
    except (ImportError, AttributeError):
        folder = os.environ.get("TRITON_CACHE_DIR", str(Path.home() / ".triton" / "cache"))
    path = Path(folder)
    return folder, sum(1 for p in path.iterdir() if p.is_dir()) if path.is_dir() else 0


# ---- measurements ----

@dataclass
class Times:
    """Seconds per pass over the set (all its select() calls), ``reps`` passes each."""
    kernel: float
    host: float
    wall: float
    selects: int
    launches: int
    gap: float  # the GPU's longest wait for the host while timing kernels (0.0: none)
    compiled: int  # compiles or cache loads inside the timed passes (0 expected)


# on a queue kept busy, the table's upload is all that lies between a sleep's end and the
# call's first launch, and nothing between one launch's end and the next one's start
FIRST_GAP_S, BETWEEN_GAP_S = 1e-4, 1e-5


def idle(launches: "Launches", marks: list) -> float:
    """The longest gap on the GPU's queue, before a call's first launch or between its
    launches, that says the GPU waited for the host (0.0: none did, the sleep covered it)."""
    seconds, pairs, worst = launches.clock.seconds, launches.pairs, 0.0
    for j, (mark, first) in enumerate(marks):
        last = marks[j + 1][1] if j + 1 < len(marks) else len(pairs)
        if first >= last:
            continue
        gap = seconds(mark, pairs[first][0])
        if gap > FIRST_GAP_S:
            worst = max(worst, gap)
        for i in range(first, last - 1):
            gap = seconds(pairs[i][1], pairs[i + 1][0])
            if gap > BETWEEN_GAP_S:
                worst = max(worst, gap)
    return worst


def measure_calls(calls: list, stages: list[TimedStage], launches: Launches, reps: int) -> Times:
    """Warm the calls once, time their wall and host time, then their kernels alone."""
    for call in calls:  # untimed: any compile or cache load happens here
        call()
    launches.clock.sync()
    compiled = launches.compiles
    # host and wall: nothing queued ahead, select() returns once the bytes are on the host
    for stage in stages:
        stage.blocked = 0.0
    started = time.perf_counter()
    for _ in range(reps):
        for call in calls:
            call()
    wall = (time.perf_counter() - started) / reps
    host = wall - sum(stage.blocked for stage in stages) / reps
    # the kernel alone: a sleep ahead of each call keeps every launch waiting in the queue
    sleep = 2 * wall / len(calls) + 5e-4
    for _ in range(2):  # a sleep the host outran leaves the GPU idle: again with a longer one
        launches.pairs, marks = [], []
        with launches.stamping():
            for _ in range(reps):
                for call in calls:
                    launches.clock.busy(sleep)
                    marks.append((launches.clock.stamp(), len(launches.pairs)))
                    call()
        launches.clock.sync()
        gap = idle(launches, marks) if launches.clock.cuda else 0.0
        if gap == 0.0:
            break
        sleep *= 4
    kernel = sum(launches.clock.seconds(a, b) for a, b in launches.pairs) / reps
    return Times(kernel, host, wall, len(calls), len(launches.pairs) // reps, gap,
                 launches.compiles - compiled)


def measure_reference(fn, clock: Clock, reps: int) -> tuple[float, float]:
    """(device time, wall time) of ``fn``, seconds a call, after one untimed call."""
    fn()
    clock.sync()
    started = time.perf_counter()
    for _ in range(reps):
        fn()
        clock.sync()
    wall = (time.perf_counter() - started) / reps
    total = 0.0
    for _ in range(reps):
        clock.busy(2 * wall + 5e-4)
        a = clock.stamp()
        fn()
        b = clock.stamp()
        clock.sync()
        total += clock.seconds(a, b)
    return total / reps, wall


def _ratio(value: float, reference: float, goal: float) -> str:
    r = value / reference
    return f"{r:7.2f} {'ok  ' if r <= goal else 'MISS'}"


HEADER = (f"  {'path':<10} {'ef':<3} {'selects':>7} {'launches':>8} {'kernel ms':>10} {'host ms':>9} "
          f"{'host us/sel':>11} {'host us/tensor':>15} {'wall ms':>9}  {'kernel/topk':>12} {'kernel/read':>12} "
          f"{'wall/topk':>12} {'wall/read':>12}")


def line(path: str, feedback: bool, t: Times, refs: dict, tensors: int) -> str:
    per_tensor = t.host / tensors * 1e6
    return (f"  {path:<10} {'yes' if feedback else 'no':<3} {t.selects:>7} {t.launches:>8} "
            f"{t.kernel * 1e3:>10.3f} {t.host * 1e3:>9.3f} {t.host / t.selects * 1e6:>11.1f} "
            f"{per_tensor:>10.1f} {'ok  ' if per_tensor <= GOAL_HOST_US else 'MISS'} "
            f"{t.wall * 1e3:>9.3f}  {_ratio(t.kernel, refs['topk'], GOAL_TOPK):>12} "
            f"{_ratio(t.kernel, refs['read'], GOAL_READ):>12} {_ratio(t.wall, refs['topk'], GOAL_TOPK):>12} "
            f"{_ratio(t.wall, refs['read'], GOAL_READ):>12}"
            + (f"  WARNING: {t.compiled} compiles/cache loads inside the timed calls" if t.compiled else "")
            + (f"  WARNING: the GPU waited {t.gap * 1e6:.0f} us for the host (the sleep ahead was "
               f"too short): the kernel time may hold host time" if t.gap else ""))


def _references(grads: list[torch.Tensor], density: float, clock: Clock, reps: int) -> dict:
    flat, calls = references(grads, density)
    out = {}
    for name, fn in calls.items():
        out[name], out[f"{name}_wall"] = measure_reference(fn, clock, reps)
    out["numel"] = flat.numel()
    return out


def bench_set(name: str, dtype_name: str, device: torch.device, density: float, reps: int,
              launches: Launches) -> list[dict]:
    """Every row of one set in one dtype, printed as measured; the rows for --json."""
    dtype = DTYPES[dtype_name]
    grads, left_out = gradients(name, dtype, device)
    if not grads:
        print(f"== {name}, {dtype_name}: no tensor the kernel takes is sent sparse", flush=True)
        return []
    clock = launches.clock
    refs = _references(grads, density, clock, reps)
    where = "CUDA events, GPU kept busy" if clock.cuda else "host clock"
    print(f"== {name}, {dtype_name}: {len(grads)} sparse tensors, {refs['numel'] / 1e6:.3g} M elements, "
          f"density {density}" + (f" ({left_out} more the kernel does not take, left out)" if left_out else "")
          + f"\n  references ({where}): read once {refs['read'] * 1e3:.3f} ms, "
          f"global torch.topk {refs['topk'] * 1e3:.3f} ms (wall {refs['read_wall'] * 1e3:.3f} / "
          f"{refs['topk_wall'] * 1e3:.3f} ms)", flush=True)
    print(HEADER, flush=True)
    rows = []
    for feedback in (False, True):
        items = items_of(grads, feedback, density)
        for path in PATHS:
            calls, stages = calls_of(items, path, device)
            t = measure_calls(calls, stages, launches, reps)
            print(line(path, feedback, t, refs, len(items)), flush=True)
            rows.append({"set": name, "dtype": dtype_name, "path": path, "feedback": feedback,
                         **asdict(t), **{f"ref_{k}": v for k, v in refs.items()}})
        del items
    # the largest tensor (VGG-16's fc1) on its own, against references on it alone
    big = max(range(len(grads)), key=lambda i: grads[i].numel())
    shape = tuple(grads[big].shape)
    label = "fc1 " if shape == FC1 else "largest tensor "
    one = _references([grads[big]], density, clock, reps)
    print(f"  {name} {label}{shape}, {one['numel'] / 1e6:.3g} M elements: read once "
          f"{one['read'] * 1e3:.3f} ms, topk {one['topk'] * 1e3:.3f} ms", flush=True)
    for feedback in (False, True):
        calls, stages = calls_of(items_of([grads[big]], feedback, density), "per-tensor", device)
        t = measure_calls(calls, stages, launches, reps)
        print(line(f"{label.split()[0]}", feedback, t, one, 1), flush=True)
        rows.append({"set": name, "dtype": dtype_name, "path": f"single {shape}", "feedback": feedback,
                     **asdict(t), **{f"ref_{k}": v for k, v in one.items()}})
    return rows


def summary(rows: list[dict]) -> list[str]:
    """The goals with error feedback, per set and dtype, each path on its own line."""
    out = [f"== goals with error feedback (kernel and wall against the global topk, goal <= "
           f"{GOAL_TOPK}x, and reading once, goal <= {GOAL_READ:g}x); the paths are not mixed"]
    for r in rows:
        if r["feedback"] and r["path"] in PATHS:
            out.append(f"  {r['set']:<10} {r['dtype']:<9} {r['path']:<10} kernel "
                       f"{_ratio(r['kernel'], r['ref_topk'], GOAL_TOPK)} x topk "
                       f"{_ratio(r['kernel'], r['ref_read'], GOAL_READ)} x read;  wall "
                       f"{_ratio(r['wall'], r['ref_topk'], GOAL_TOPK)} x topk "
                       f"{_ratio(r['wall'], r['ref_read'], GOAL_READ)} x read")
    return out


# ---- --warm: the same calls, once each, in parallel processes ----

def _prepare(device: torch.device) -> None:
    """Refuse what cannot run; on a CPU, CPU tensors take the kernel (Triton's interpreter)."""
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_kernel: --device cuda, but torch sees no GPU")
    if device.type == "cpu":
        if not fibre_triton.interpreted():
            raise SystemExit("gpu_kernel: --device cpu runs the kernel under Triton's interpreter: "
                             "set TRITON_INTERPRET=1")
        fibre_triton.CPU_TENSORS = True
    if not fibre_triton.applies(torch.zeros(2, 2, device=device)):
        raise SystemExit("gpu_kernel: the fibre kernel does not apply here (is triton importable?)")


def warm_unit(name: str, dtype_name: str, feedback: bool, device_name: str, density: float) -> dict:
    """One set, dtype and feedback, every path once (a worker process of --warm)."""
    device = torch.device(device_name)
    _prepare(device)
    started = time.perf_counter()
    grads, _ = gradients(name, DTYPES[dtype_name], device)
    unit = f"{name} {dtype_name} {'with' if feedback else 'without'} feedback"
    if not grads:
        return {"unit": unit, "kernels": 0, "s": time.perf_counter() - started}
    with Launches(Clock(device)) as launches:
        items = items_of(grads, feedback, density)
        for path in PATHS:
            for call in calls_of(items, path, device)[0]:
                call()
        big = max(range(len(grads)), key=lambda i: grads[i].numel())
        for call in calls_of(items_of([grads[big]], feedback, density), "per-tensor", device)[0]:
            call()
        launches.clock.sync()
    return {"unit": unit, "kernels": launches.compiles, "s": time.perf_counter() - started}


def warm(sets: list[str], dtypes: list[str], device: torch.device, density: float,
         processes: int) -> int:
    """Every configuration's calls once, one process each; 1 where one failed."""
    folder, before = cache_entries()
    units = [(s, d, fb) for s in sets for d in dtypes for fb in (True, False)]
    print(f"warming {len(units)} configurations in {min(processes, len(units))} processes; "
          f"Triton's cache {folder}: {before} kernels", flush=True)
    started = time.perf_counter()
    with ProcessPoolExecutor(max(1, min(processes, len(units))), mp_context=get_context("spawn")) as pool:
        futures = {pool.submit(warm_unit, s, d, fb, str(device), density): (s, d, fb) for s, d, fb in units}
        failed = 0
        for future in as_completed(futures):
            try:
                done = future.result()
            except Exception as exc:  # named, and the others still warmed
                failed += 1
                s, d, fb = futures[future]
                print(f"  {s} {d} {'with' if fb else 'without'} feedback: FAILED: "
                      f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}", flush=True)
                continue
            print(f"  {done['unit']}: {done['kernels']} kernels compiled or loaded, "
                  f"{done['s']:.1f} s", flush=True)
    print(f"warm: {cache_entries()[1] - before} kernels added to {folder} in "
          f"{time.perf_counter() - started:.1f} s" + (f"; {failed} configurations failed" if failed else ""),
          flush=True)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--sets", nargs="+", choices=sorted(GRADIENT_SETS),
                    default=["resnet50", "vgg16", "bert-base"])
    ap.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["float32", "bfloat16"])
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--reps", type=int, default=20, help="timed passes over each set and path")
    ap.add_argument("--warm", action="store_true",
                    help="only compile what the timed run needs (in --processes processes)")
    ap.add_argument("--processes", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--json", type=Path, metavar="PATH", help="write every row here")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    _prepare(device)
    if args.warm:
        return warm(args.sets, args.dtypes, device, args.density, args.processes)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton's interpreter)"
    folder, before = cache_entries()
    print(f"fibre kernel on {name}, torch {torch.__version__}; per pass over a set (all its "
          f"select() calls), mean of {args.reps}; goals: <= {GOAL_TOPK}x global topk, <= "
          f"{GOAL_READ:g}x read once", flush=True)
    rows = []
    with Launches(Clock(device)) as launches:
        for set_name in args.sets:
            for dtype_name in args.dtypes:
                rows += bench_set(set_name, dtype_name, device, args.density, args.reps, launches)
    print("\n".join(summary(rows)), flush=True)
    added = cache_entries()[1] - before
    print(f"compiles: {launches.compiles} kernels compiled or loaded from {folder}, {added} of them "
          f"new to it{' (the warm step missed them)' if added and device.type == 'cuda' else ''}",
          flush=True)
    if args.json:
        args.json.write_text(json.dumps({"device": name, "reps": args.reps, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
