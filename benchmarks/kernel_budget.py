"""A budget for the CUDA fibre top-k kernel, checked without a GPU.

The kernel (adtopk_ps/compression/_fibre_kernel.py) holds a tile of whole
fibres in registers and finds each fibre's k-th largest magnitude by
bisection over the key bits, so what it costs on a GPU is fixed when it is
compiled: the registers a thread holds, whether any spill to memory, and how
many instructions an element takes. Triton compiles for any target on any
machine, and the CUDA tools it ships (cuobjdump, nvdisasm) read the result,
so this script checks those costs for an H200 (sm_90) on a CPU-only machine,
in CI, before a GPU ever runs the kernel.

What it compiles: every tensor the sparsification policy sends sparse, in
the gradient sets of ResNet-50, VGG-16 and BERT-base (benchmarks/compression.py)
and in the training job's models (configs/*.yaml, built by worker/models.py,
routed with each config's min_compress_bytes), at density 0.01 (ADTopk's
``fibre_k`` per fibre along axis 1), in float32, bfloat16 and float16, with
and without error feedback, maps to a compiled form,
``fibre_triton.variant(n, k, dtype, feedback)``. Each distinct one is
compiled once (in parallel processes, with an empty Triton cache, so the
compile time is a first compile's, as a job's first step pays it) and
printed as soon as it is done. Tensors whose variant is None take the
kernel's fallback path and are listed after the table.

The budget (the constants below; a miss makes the exit status 1, naming it):

- no spills (cuobjdump's STACK is 0): a spilled tile goes to memory and back
  on every bisection step, which is the cost the kernel exists to avoid;
- at most ``MAX_REGISTERS`` registers a thread, so that an SM's register file
  keeps enough warps resident to hide memory latency;
- at most ``MAX_INSTRUCTIONS_PER_ELEMENT`` thread-instructions per useful
  element, so that the selection stays within a small multiple of the time
  the kernel's own memory traffic takes;
- a compile under ``MAX_COMPILE_S`` seconds, since a job's first step waits
  for every variant it needs. It is measured in CPU seconds of the compiling
  process and its ptxas, which other work on a shared CI machine does not
  inflate as it does wall time (the JSON has both).

The instruction estimate is static, read from SASS (``nvdisasm -c``). The
registers and spills are the real build's; the count comes from a second
assembly of the same PTX with ptxas told not to unroll the loop (a
``.pragma "nounroll"`` at each loop header), since ptxas unrolls the bisection
a few times in the real build and an unrolled body cannot be told from a long
one. Every instruction counts once (straight-line code, both sides of every
branch), except the body of a loop: a back-edge, a branch to an earlier
address, whose body is the instructions from the branch's target through the
branch. The back-edge with the longest body is the kernel's single loop (the
bisection) and its body is counted ``variant.loop_trips`` times, its worst
case (no early exit). Every other back-edge is counted once and flagged in the
row's ``loops`` column. The rolled loop pays its branch and counter on every
trip, which the real, unrolled build pays less often: the estimate is an upper
bound. Thread-instructions per useful element are ``instructions per warp *
warps * 32 / (fb * n)`` for the shortest n that uses the variant: its worst
case, where most of the tile is padding.

    python benchmarks/kernel_budget.py                  # every variant, exit 1 on a miss
    python benchmarks/kernel_budget.py --quick          # a few representative variants (CI)
    python benchmarks/kernel_budget.py --sets vgg16 --dtypes bfloat16 --json budget.json
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from multiprocessing import get_context
from pathlib import Path

import numpy as np
import torch

from adtopk_ps.compression import ADTopk, SparsificationPolicy, fibre_k, fibre_triton

# Triton 3.9 warns on every compile that leaves fp fusion unstated; its default, stated
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

MAX_STACK_BYTES = 0
MAX_REGISTERS = 128
MAX_INSTRUCTIONS_PER_ELEMENT = 200
MAX_COMPILE_S = 10.0

DENSITY = 0.01
TARGET = ("cuda", 90, 32)  # an H200: sm_90, warps of 32 threads
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
BENCHMARK_SETS = ("resnet50", "vgg16", "bert-base")
# compression.py's small sets, named only: the GPU check's CPU dry run compiles "dry"
SMALL_SETS = ("tiny", "dry")
CONFIGS = Path(__file__).resolve().parents[1] / "configs"
JOB_SETS = tuple(sorted(p.stem for p in CONFIGS.glob("*.yaml")))
# --quick: the main job's model (both its sparse tensors), in float32 and bfloat16, with
# error feedback as the job runs it
QUICK_SETS, QUICK_DTYPES, QUICK_FEEDBACK = ["digits-cnn"], ["float32", "bfloat16"], (True,)
COLUMNS = ("dtype", "ef", "n", "tensors", "fb", "tile", "warps", "regs", "stack", "smem", "sass",
           "loops", "instr/warp", "instr/elem", "compile_s", "budget", "used-by")
WIDTHS = (8, 3, 11, 7, 4, 11, 5, 4, 5, 6, 6, 13, 10, 10, 9, 6, 0)


@dataclass(frozen=True)
class Use:
    """One sparse tensor that a variant selects from: its set, its name (or shape), and its
    fibres' length and k."""

    where: str
    tensor: str
    n: int
    k: int
    fibres: int = 1  # fibres of the tensor: its programs are fibres / fb, rounded up


@dataclass(frozen=True)
class Loop:
    """A back-edge in SASS: the body runs from ``first`` (the branch's target) through
    ``last`` (the branch), addresses; ``size`` instructions."""

    first: int
    last: int
    size: int


@dataclass(frozen=True)
class Estimate:
    """Instructions per warp: ``static`` SASS instructions, ``per_warp`` with the ``counted``
    loop's body run ``trips`` times; ``flagged`` loops are counted once."""

    static: int
    per_warp: int
    trips: int
    counted: Loop | None
    flagged: tuple[Loop, ...]


@dataclass
class Row:
    """One variant, what uses it, and what its compiled form costs (None until measured,
    or where the compile failed: then ``error``)."""

    dtype: str
    feedback: bool
    fb: int
    bn: int
    tile: str  # segments x positions a segment / positions a thread holds
    warps: int
    loop_trips: int
    uses: list[Use]
    registers: int | None = None
    stack: int | None = None
    local: int | None = None
    shared: int | None = None
    estimate: Estimate | None = None
    compile_s: float | None = None  # CPU seconds, ptxas included
    wall_s: float | None = None
    error: str | None = None
    misses: list[str] = field(default_factory=list)

    @property
    def n_min(self) -> int:
        return min(u.n for u in self.uses)

    @property
    def per_element(self) -> float | None:
        """Thread-instructions per useful element at the shortest n (the worst case)."""
        if self.estimate is None:
            return None
        return self.estimate.per_warp * self.warps * TARGET[2] / (self.fb * self.n_min)


_INSTRUCTION = re.compile(r"^\s*/\*([0-9a-fA-F]+)\*/\s+([^;]*?)\s*;")
_LABEL = re.compile(r"^\s*([.$\w]+):\s*$")
_BRANCH = re.compile(r"^(@!?U?P\w+\s+)?BRA(?:\.\w+)*\s+(?:!?U?P\w+,\s*)?`?\(?([.$\w]+)\)?")


def parse_sass(listing: str) -> tuple[list[tuple[int, str]], list[Loop]]:
    """The (address, instruction) pairs of an ``nvdisasm -c`` listing and its back-edges.

    The listing ends with an unpredicated branch to itself after the last
    EXIT (a trap no thread reaches) and NOP padding: those are left out.

    Example::

        instructions, loops = parse_sass(tool("nvdisasm", "-c", "kernel.cubin"))
        loops[0].size     # instructions from the loop's head through its branch back
    """
    instructions: list[tuple[int, str]] = []
    labels: dict[str, int] = {}
    branches: list[tuple[int, str]] = []
    for line in listing.splitlines():
        label = _LABEL.match(line)
        if label:
            labels[label.group(1)] = len(instructions)
            continue
        found = _INSTRUCTION.match(line)
        if not found:
            continue
        text = found.group(2)
        branch = _BRANCH.match(text)
        if branch:
            if not branch.group(1) and labels.get(branch.group(2)) == len(instructions):
                break  # the trap after EXIT: the rest is padding
            branches.append((len(instructions), branch.group(2)))
        instructions.append((int(found.group(1), 16), text))
    loops = [Loop(instructions[labels[target]][0], instructions[at][0], at - labels[target] + 1)
             for at, target in branches if labels.get(target, at + 1) <= at]
    return instructions, loops


def estimate(instructions: list[tuple[int, str]], loops: list[Loop], trips: int) -> Estimate:
    """Instructions per warp: each instruction once, the longest loop's body ``trips`` times.

    Example::

        instructions, loops = parse_sass(listing)
        estimate(instructions, loops, variant.loop_trips).per_warp
    """
    static = len(instructions)
    if not loops:
        return Estimate(static, static, trips, None, ())
    counted = max(loops, key=lambda loop: loop.size)
    flagged = tuple(loop for loop in loops if loop is not counted)
    return Estimate(static, static + counted.size * (trips - 1), trips, counted, flagged)


_FUNCTION = re.compile(r"^\s*Function\s+(\S+?):?\s*$")
_RESOURCE = re.compile(r"\b([A-Z]+(?:\[\d+\])?):(\d+)")


def parse_res_usage(text: str) -> dict[str, dict[str, int]]:
    """``cuobjdump -res-usage``'s resources per function: REG, STACK, SHARED, LOCAL, ...

    Example::

        parse_res_usage(tool("cuobjdump", "-res-usage", "kernel.cubin"))
        # {"kernel": {"REG": 180, "STACK": 0, "SHARED": 1024, "LOCAL": 0, ...}}
    """
    usage: dict[str, dict[str, int]] = {}
    current: dict[str, int] | None = None
    for line in text.splitlines():
        function = _FUNCTION.match(line)
        if function:
            current = usage.setdefault(function.group(1), {})
        elif current is not None:
            current.update((key, int(value)) for key, value in _RESOURCE.findall(line))
    return usage


def tool(name: str, *args: str | Path) -> str:
    """The output of one of the CUDA tools that ship inside Triton (cuobjdump, nvdisasm).

    Example::

        tool("cuobjdump", "-res-usage", Path("kernel.cubin"))
    """
    import triton
    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    return subprocess.run([str(path), *map(str, args)], capture_output=True, text=True,
                          check=True).stdout


def measure(variant: "fibre_triton.Variant") -> dict:
    """Compile ``variant`` for sm_90 and read its cubin: resources, SASS estimate, seconds.

    Runs in a worker process; returns the fields of :class:`Row` it measures.

    Example::

        measure(fibre_triton.variant(1024, 10, torch.float32, True))
        # {"registers": ..., "stack": 0, "local": 0, "shared": ..., "estimate": Estimate(...), ...}
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from adtopk_ps.compression import _fibre_kernel
    source = ASTSource(_fibre_kernel.kernel, fibre_triton.SIGNATURE, variant.constants())
    started, cpu = time.perf_counter(), _cpu_seconds()
    compiled = triton.compile(source, target=GPUTarget(*TARGET),
                              options={"num_warps": variant.warps})
    wall, cpu = time.perf_counter() - started, _cpu_seconds() - cpu
    with tempfile.TemporaryDirectory() as folder:
        cubin, rolled = Path(folder) / "kernel.cubin", Path(folder) / "rolled.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        usage = parse_res_usage(tool("cuobjdump", "-res-usage", cubin))
        (Path(folder) / "rolled.ptx").write_text(rolled_ptx(compiled.asm["ptx"]))
        tool("ptxas-blackwell", f"-arch=sm_{TARGET[1]}a", Path(folder) / "rolled.ptx", "-o", rolled)
        listing = tool("nvdisasm", "-c", rolled)
    resources = usage.get(compiled.metadata.name) or next(iter(usage.values()))
    instructions, loops = parse_sass(listing)
    return {"registers": resources["REG"], "stack": resources["STACK"],
            "local": resources.get("LOCAL", 0), "shared": compiled.metadata.shared,
            "estimate": estimate(instructions, loops, variant.loop_trips), "compile_s": cpu,
            "wall_s": wall}


_LOOP_HEADER = re.compile(r"^(\$L__BB\d+_\d+):(\s*//\s*=>This Inner Loop Header.*)$", re.M)


def rolled_ptx(ptx: str) -> str:
    """``ptx`` with a ``nounroll`` pragma at every loop header (LLVM marks them in a comment),
    so that ptxas assembles each loop's body once.

    Example::

        rolled_ptx("$L__BB0_7:   // =>This Inner Loop Header: Depth=1\n")
        # '$L__BB0_7:   // =>This Inner Loop Header: Depth=1\n\t.pragma "nounroll";\n'
    """
    return _LOOP_HEADER.sub(lambda m: f'{m.group(0)}\n\t.pragma "nounroll";', ptx)


def _cpu_seconds() -> float:
    """CPU seconds of this process and the children it waited for (Triton's ptxas): a compile's
    cost that other work on a shared machine does not inflate, as it does wall time."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def sparse_tensors(name: str, dtype: torch.dtype) -> list[tuple[str, tuple[int, ...], float]]:
    """(name or shape, shape, density) of each tensor of set ``name`` sent sparse in ``dtype``.

    Example::

        sparse_tensors("digits-cnn", torch.float32)
        # [("features.2.weight", (64, 32, 3, 3), 0.01), ("head.1.weight", (128, 1024), 0.01)]
    """
    if name in BENCHMARK_SETS + SMALL_SETS:
        # benchmarks/compression.py, beside this script (on sys.path when it runs as a script)
        from compression import GRADIENT_SETS, sparsified
        return [(str(shape), shape, DENSITY) for shape in sparsified(GRADIENT_SETS[name](), dtype)]
    return _job_tensors(CONFIGS / f"{name}.yaml", dtype)


def _job_tensors(config: Path, dtype: torch.dtype) -> list[tuple[str, tuple[int, ...], float]]:
    """(name, shape, density) of the sparse tensors of the training job's model of
    ``config``, routed as its policy routes them (the config's min_compress_bytes and budget
    mode; a cost model, measured where the job runs, is not known here)."""
    from worker.config import load, parse_args
    from worker.models import build
    cfg = load(parse_args(["--config", str(config)]))
    with torch.device("meta"):
        model = build(cfg["model"], cfg["model_args"]).to(dtype)
    policy = SparsificationPolicy(DENSITY, min_compress_bytes=cfg["min_compress_bytes"],
                                  budget=cfg["budget"])
    routes = policy.plan(model.named_parameters())
    return [(name, tuple(p.shape), routes[name].ratio) for name, p in model.named_parameters()
            if not routes[name].dense]


def collect(sets: list[str], dtypes: list[str], feedbacks: tuple[bool, ...]
            ) -> tuple[dict, dict[tuple[str, bool, int, int], list[Use]]]:
    """Every distinct variant the sets need (variant -> its uses), and the uses that fall back
    (dtype, feedback, n, k -> uses), where ``fibre_triton.variant`` is None.

    Example::

        variants, fallbacks = collect(["vgg16"], ["float32"], (False, True))
    """
    fibres = ADTopk(DENSITY)
    variants: dict = {}
    fallbacks: dict[tuple[str, bool, int, int], list[Use]] = {}
    for dtype_name in dtypes:
        dtype = DTYPES[dtype_name]
        for where in sets:
            for tensor, shape, ratio in sparse_tensors(where, dtype):
                view = fibres.view_of(shape)
                n, k = view[1], fibre_k(view[1], ratio)
                adjacent = math.prod(view[2:]) == 1 and n % 4 == 0  # as torch allocates it
                for feedback in feedbacks:
                    variant = fibre_triton.variant(n, k, dtype, feedback, adjacent)
                    use = Use(where, tensor, n, k, view[0] * math.prod(view[2:]))
                    if variant is None:
                        fallbacks.setdefault((dtype_name, feedback, n, k), []).append(use)
                    else:
                        variants.setdefault(variant, []).append(use)
    return variants, fallbacks


def _row_of(variant: "fibre_triton.Variant", uses: list[Use]) -> Row:
    """The row of ``variant``, to be measured."""
    return Row(str(variant.dtype).removeprefix("torch."), variant.feedback, variant.fb,
               variant.bn, f"{variant.seg}x{variant.bs}/{variant.runs}", variant.warps,
               variant.loop_trips, uses)


def check(row: Row) -> list[str]:
    """What ``row`` misses of the budget, each named with its figure and its bound.

    Example::

        row.misses = check(row)   # ["161 registers (budget 128)"]; [] within budget
    """
    if row.error is not None:
        return [f"compile failed: {row.error}"]
    misses = []
    if row.stack > MAX_STACK_BYTES:
        misses.append(f"spills: {row.stack} bytes of stack (budget {MAX_STACK_BYTES})")
    if row.registers > MAX_REGISTERS:
        misses.append(f"{row.registers} registers (budget {MAX_REGISTERS})")
    if row.per_element > MAX_INSTRUCTIONS_PER_ELEMENT:
        misses.append(f"{row.per_element:.0f} thread-instructions per element at n={row.n_min} "
                      f"(budget {MAX_INSTRUCTIONS_PER_ELEMENT})")
    if row.compile_s >= MAX_COMPILE_S:
        misses.append(f"compiles in {row.compile_s:.1f} CPU seconds (budget under "
                      f"{MAX_COMPILE_S:g})")
    return misses


def _name_of(row: Row) -> str:
    """How a variant is named in the lists after the table."""
    return (f"{row.dtype} {'with' if row.feedback else 'without'} feedback, n={_span(row)} "
            f"(fb {row.fb}, tile {row.tile}, {row.warps} warps)")


def _span(row: Row) -> str:
    """The fibre lengths that use the row's variant, as ``low-high``."""
    low, high = row.n_min, max(u.n for u in row.uses)
    return str(low) if low == high else f"{low}-{high}"


def _used_by(uses: list[Use], shown: int = 3) -> str:
    """The first ``shown`` distinct tensors of ``uses`` and how many more."""
    names = list(dict.fromkeys(f"{u.where}:{u.tensor}" for u in uses))
    more = f" +{len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def loops_cell(e: Estimate) -> str:
    """``-`` without a loop, else trips x body size, and how many other loops are flagged.

    Example::

        loops_cell(estimate(instructions, loops, 31))   # "31x412", or "31x412+1?"
    """
    if e.counted is None:
        return "-"
    return f"{e.trips}x{e.counted.size}" + (f"+{len(e.flagged)}?" if e.flagged else "")


def format_row(row: Row) -> str:
    """One line of the table, in ``COLUMNS``' order; ``-`` where the compile failed.

    Example::

        print(header())
        print(format_row(row))   # float32  yes 513-1024 3 4 1024 4 96 0 ...
    """
    measured = row.estimate is not None
    cells = [row.dtype, "yes" if row.feedback else "no", _span(row),
             len({(u.where, u.tensor) for u in row.uses}), row.fb, row.tile, row.warps]
    if measured:
        e = row.estimate
        cells += [row.registers, row.stack, row.shared, e.static, loops_cell(e), e.per_warp,
                  f"{row.per_element:.1f}", f"{row.compile_s:.1f}"]
    else:
        cells += ["-"] * 8
    cells += ["MISS" if row.misses else "ok", _used_by(row.uses)]
    return " ".join(f"{c!s:<{w}}" if w else str(c) for c, w in zip(cells, WIDTHS))


def header() -> str:
    """The table's header: ``COLUMNS`` at the widths :func:`format_row` writes.

    Example::

        print(header())   # dtype    ef  n           tensors fb ...
    """
    return " ".join(f"{c:<{w}}" if w else c for c, w in zip(COLUMNS, WIDTHS))


def _legend() -> str:
    """What the table's columns mean, printed above it."""
    return "\n".join([
        f"Fibre top-k kernel compiled for sm_{TARGET[1]} (H200) at density {DENSITY}; budget: "
        f"stack {MAX_STACK_BYTES} bytes, <= {MAX_REGISTERS} registers, "
        f"<= {MAX_INSTRUCTIONS_PER_ELEMENT} thread-instructions per element, "
        f"compile < {MAX_COMPILE_S:g} CPU seconds.",
        "ef: error feedback; n: fibre lengths using the variant; fb: fibres per program; "
        "tile: segments x positions a segment / adjacent positions a thread holds; smem: shared "
        "bytes the launch asks; sass: static SASS instructions;",
        "loops: the back-edge's body counted loop_trips times (trips x body), +N? other "
        "back-edges flagged and counted once, - none (unrolled);",
        "instr/warp: straight-line SASS once plus that loop; instr/elem: instr/warp * warps * 32 "
        "/ (fb * n) at the shortest n;",
        "compile_s: CPU seconds of a first compile (Triton and its ptxas; the budget's measure, "
        "which a loaded machine does not inflate).", ""])


def _compile_all(rows: dict[Future, Row]) -> list[Row]:
    """Each row's measurement as its compile finishes, printed then; the rows in that order."""
    done = []
    for future in as_completed(rows):
        row = rows[future]
        try:
            for key, value in future.result().items():
                setattr(row, key, value)
        except Exception as exc:  # a variant that does not compile is a miss, named
            row.error = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
        row.misses = check(row)
        print(format_row(row), flush=True)
        done.append(row)
    return done


def _report(rows: list[Row], fallbacks: dict) -> int:
    """The fallbacks, flagged loops and misses after the table; 1 where any variant missed."""
    for (dtype, feedback, n, k), uses in sorted(fallbacks.items()):
        print(f"falls back ({dtype}, {'with' if feedback else 'without'} feedback, n={n}, k={k}): "
              f"{_used_by(uses)}: {fibre_triton.refusal(torch.empty(1, n, device='meta'))}")
    for row in rows:
        for loop in row.estimate.flagged if row.estimate else ():
            print(f"flagged loop in {_name_of(row)}: {loop.size} instructions at "
                  f"{loop.first:#06x}-{loop.last:#06x}, counted once")
    missed = [row for row in rows if row.misses]
    for row in missed:
        print(f"MISS {_name_of(row)}: {'; '.join(row.misses)}")
    print(f"{len(rows)} variants, {len(missed)} over budget, "
          f"{sum(len(u) for u in fallbacks.values())} tensor uses fall back")
    return 1 if missed else 0


# the H200 as the prediction models it: SMs, warp instructions each issues a cycle (one per
# scheduler), boost clock, and the bandwidth a whole-tensor read reaches (its spec sheet's
# 4.8 TB/s less the share a streaming read loses)
SMS, ISSUE_PER_SM, CLOCK_HZ, BANDWIDTH = 132, 4, 1.98e9, 4.3e12
STALLS = (1.5, 3.0)  # issue slots lost to dependencies and memory, from best to poor


def steps_to_settle(keys: np.ndarray, k: int, bits: int) -> int:
    """The bisection's trips for one program's fibres (``keys``: a row a fibre, -1 for
    padding), with the kernel's early exit for float32 keys (``bits`` 31;
    ``_fibre_kernel._kth_key``): it stops once every fibre has exactly k keys at least its
    bound, or its bound is its largest key.

    Example::

        keys = np.array([[5, 3, 9, 1]]) << 27
        steps_to_settle(keys, k=2, bits=31)   # 2: 9 and 5 (shifted) are >= 4 << 27
    """
    if bits != 31:  # 16-bit keys take every step
        return bits
    kth = np.zeros(len(keys), dtype=np.int64)
    largest = keys.max(1)
    settled = largest <= 0
    for i in range(bits):
        if settled.all():
            return i
        cand = kth | (1 << (bits - 1 - i))
        at_least = (keys >= cand[:, None]).sum(1)
        kth = np.where(at_least >= k, cand, kth)
        settled |= (at_least == k) | (kth == largest)
    return bits


def sampled_trips(row: Row, use: Use, programs: int = 2, seed: int = 0) -> float:
    """The mean trips of ``programs`` programs of ``use`` filled with normal samples in the
    row's dtype (continuous values: the lower bits separate the k-th key from the next early;
    gradients with many ties take up to every step)."""
    gen = torch.Generator().manual_seed(seed)
    dtype, bits = DTYPES[row.dtype], row.loop_trips
    trips = []
    for _ in range(programs):
        x = torch.randn(row.fb, use.n, generator=gen).to(dtype)
        raw = x.view(torch.int32 if bits == 31 else torch.int16).numpy().astype(np.int64)
        trips.append(steps_to_settle(raw & ((1 << bits) - 1), use.k, bits))
    return sum(trips) / len(trips)


def predict(rows: list[Row]) -> list[str]:
    """Each gradient set's predicted kernel time, from the budget's instruction counts: every
    program's thread-instructions at the H200's issue rate, times ``STALLS``, and never
    below the memory its tensors need at ``BANDWIDTH`` (read the gradient and, with error
    feedback, read and write the residual); once with every bisection step (ties, the
    budget's count) and once with the steps normal samples take (:func:`sampled_trips`).
    Lines of ``set dtype ef: ms``."""
    totals: dict[tuple[str, str, bool], list[float]] = {}
    for row in rows:
        if row.estimate is None:
            continue
        e = row.estimate
        for use in row.uses:
            if use.where not in BENCHMARK_SETS:
                continue
            threads = -(-use.fibres // row.fb) * row.warps * TARGET[2]
            body = e.counted.size if e.counted is not None else 0
            sampled = e.per_warp - body * (e.trips - sampled_trips(row, use))
            t = totals.setdefault((use.where, row.dtype, row.feedback), [0.0, 0.0, 0.0])
            t[0] += e.per_warp * threads
            t[1] += sampled * threads
            t[2] += use.n * use.fibres * DTYPES[row.dtype].itemsize * (3 if row.feedback else 1)
    rate = SMS * ISSUE_PER_SM * CLOCK_HZ * TARGET[2]  # thread-instructions a second
    lines = []
    for (where, dtype, feedback), (worst, sampled, nbytes) in sorted(totals.items()):
        memory = nbytes / BANDWIDTH
        low, high = (max(worst * s / rate, memory) * 1e3 for s in STALLS)
        low_s, high_s = (max(sampled * s / rate, memory) * 1e3 for s in STALLS)
        lines.append(f"predicted {where} {dtype} {'with' if feedback else 'without'} feedback: "
                     f"{low:.2f}-{high:.2f} ms with every step (issue {worst / rate * 1e3:.2f} ms), "
                     f"{low_s:.2f}-{high_s:.2f} ms with normal samples' steps (issue "
                     f"{sampled / rate * 1e3:.2f} ms); memory {memory * 1e3:.2f} ms")
    return lines


def _to_json(rows: list[Row], fallbacks: dict) -> dict:
    """The budget, the table and the fallbacks, for ``--json``."""
    budget = {"max_stack_bytes": MAX_STACK_BYTES, "max_registers": MAX_REGISTERS,
              "max_instructions_per_element": MAX_INSTRUCTIONS_PER_ELEMENT,
              "max_compile_s": MAX_COMPILE_S}
    table = [{**asdict(row), "n_min": row.n_min, "per_element": row.per_element} for row in rows]
    falls = [{"dtype": d, "feedback": f, "n": n, "k": k, "uses": [asdict(u) for u in uses]}
             for (d, f, n, k), uses in sorted(fallbacks.items())]
    return {"target": f"sm_{TARGET[1]}", "density": DENSITY, "budget": budget, "rows": table,
            "fallbacks": falls}


def _parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (``--help``)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help=f"a few representative variants: {QUICK_SETS} in {QUICK_DTYPES}, "
                         f"with feedback (--sets and --dtypes still apply)")
    ap.add_argument("--sets", nargs="+", choices=BENCHMARK_SETS + JOB_SETS + SMALL_SETS,
                    help="gradient sets and job configs (default: all)")
    ap.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), help="(default: all)")
    ap.add_argument("--json", type=Path, metavar="PATH", help="write the table here as JSON")
    ap.add_argument("--processes", type=int, default=len(os.sched_getaffinity(0)),
                    help="compiles at once (default: this machine's cores)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Collect, compile and check every variant; the exit status (1: a variant missed).

    Example::

        sys.exit(main(["--quick", "--json", "budget.json"]))
    """
    args = _parse_args(argv)
    # the compiling processes compile for a GPU: under the interpreter (a test process's
    # setting, which they would inherit) there would be nothing to compile
    os.environ.pop("TRITON_INTERPRET", None)
    if not hasattr(fibre_triton, "variant"):
        raise SystemExit("adtopk_ps.compression.fibre_triton has no variant(): the kernel's "
                         "interface (SIGNATURE, Variant, variant) has not landed")
    sets = args.sets or (QUICK_SETS if args.quick else list(BENCHMARK_SETS + JOB_SETS))
    dtypes = args.dtypes or (QUICK_DTYPES if args.quick else list(DTYPES))
    variants, fallbacks = collect(sets, dtypes, QUICK_FEEDBACK if args.quick else (False, True))
    print(_legend())
    print(header(), flush=True)
    with tempfile.TemporaryDirectory() as cache:
        os.environ["TRITON_CACHE_DIR"] = cache  # the workers inherit it: first compiles
        with ProcessPoolExecutor(max(1, min(args.processes, len(variants))),
                                 mp_context=get_context("spawn")) as pool:
            # the widest tiles first: they compile longest
            order = sorted(variants, key=lambda v: -v.bn * v.fb)
            rows = _compile_all({pool.submit(measure, v): _row_of(v, variants[v]) for v in order})
    status = _report(rows, fallbacks)
    for line in predict(rows):
        print(line)
    if args.json:
        args.json.write_text(json.dumps(_to_json(rows, fallbacks), indent=1))
    return status


if __name__ == "__main__":
    sys.exit(main())
