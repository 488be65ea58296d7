"""benchmarks/kernel_budget.py's mechanics: its SASS and cuobjdump parsing on known text, the
loops it finds in a real compiled loop, and a quick run's table. Whether the kernel meets
the budget is the script's own exit status (CI runs it), not asserted here: the kernel
may be mid-redesign."""
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from adtopk_ps.compression import fibre_triton

try:
    import triton
except ImportError:
    triton = None

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "kernel_budget.py"
_spec = importlib.util.spec_from_file_location("kernel_budget", SCRIPT)
kb = sys.modules["kernel_budget"] = importlib.util.module_from_spec(_spec)  # for its dataclasses
_spec.loader.exec_module(kb)

needs_triton = pytest.mark.skipif(triton is None, reason="triton cannot be imported")

# nvdisasm -c's form: a loop (.L_x_1 back from 0x0060), a forward branch, then the trap after
# EXIT and its NOP padding, which are not instructions of the kernel
SASS = """\
\t.target\tsm_90a
//--------------------- .text.looped              --------------------------
\t.section\t.text.looped,"ax",@progbits
        .size           looped,(.L_x_3 - looped)
looped:
.text.looped:
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/                   ISETP.GE.AND P0, PT, R6, 0x1, PT ;
        /*0020*/              @!P0 BRA `(.L_x_0) ;
.L_x_1:
        /*0030*/                   IMAD R5, R5, 0x3, R8 ;
        /*0040*/                   VIADD R2, R2, 0xffffffff ;
        /*0050*/                   ISETP.NE.AND P0, PT, R2, RZ, PT ;
        /*0060*/               @P0 BRA `(.L_x_1) ;
.L_x_0:
        /*0070*/                   STG.E desc[UR6][R2.64], R5 ;
        /*0080*/                   EXIT ;
.L_x_2:
        /*0090*/                   BRA `(.L_x_2);
        /*00a0*/                   NOP;
        /*00b0*/                   NOP;
.L_x_3:
"""

RES_USAGE = """
Resource usage:
 Common:
  GLOBAL:0
 Function kernel:
  REG:180 STACK:16 SHARED:1024 LOCAL:0 CONSTANT[0]:568 TEXTURE:0 SURFACE:0 SAMPLER:0
"""


def test_sass_instructions_leave_out_the_trap_and_padding():
    instructions, _ = kb.parse_sass(SASS)
    assert [at for at, _ in instructions] == list(range(0, 0x90, 0x10))
    assert instructions[2] == (0x20, "@!P0 BRA `(.L_x_0)")
    assert instructions[-1] == (0x80, "EXIT")


def test_a_branch_back_is_a_loop_and_its_body_counts_trips_times():
    instructions, loops = kb.parse_sass(SASS)
    assert loops == [kb.Loop(first=0x30, last=0x60, size=4)]  # the forward branch is no loop
    e = kb.estimate(instructions, loops, trips=31)
    assert (e.static, e.per_warp, e.counted, e.flagged) == (9, 9 + 4 * 30, loops[0], ())


def test_of_several_loops_the_longest_counts_and_the_others_are_flagged():
    store = "        /*0070*/                   STG.E desc[UR6][R2.64], R5 ;\n"
    second = SASS.replace(store, ".L_x_9:\n" + store +
                          "        /*0078*/           @!UP1 BRA.U `(.L_x_9) ;\n")
    instructions, loops = kb.parse_sass(second)
    assert loops == [kb.Loop(0x30, 0x60, 4), kb.Loop(0x70, 0x78, 2)]
    e = kb.estimate(instructions, loops, trips=15)
    assert (e.per_warp, e.counted, e.flagged) == (10 + 4 * 14, loops[0], (loops[1],))
    assert kb.loops_cell(e) == "15x4+1?"


def test_a_branch_with_two_predicates_is_a_loop_too():
    # a while loop on uniform registers ends in `@P0 BRA P1, target`
    two = SASS.replace("@P0 BRA `(.L_x_1)", "@P0 BRA P1, `(.L_x_1)")
    assert kb.parse_sass(two)[1] == [kb.Loop(first=0x30, last=0x60, size=4)]


def test_the_early_exit_settles_as_the_kernel_does():
    def steps(rows, k=2):  # float32 keys whose top 4 of 31 bits are these
        return kb.steps_to_settle(np.array(rows) << 27, k=k, bits=31)
    # exactly k keys at least the bound: settled (the lower bits take nothing else)
    assert steps([[5, 3, 9, 1]]) == 2
    # a fibre of zeros, or of padding, settles before the first step
    assert kb.steps_to_settle(np.array([[0, 0, 0, 0], [-1, -1, -1, -1]]), k=2, bits=31) == 0
    # tied at the k-th key: every bit is taken to find it, unless it is the largest
    assert steps([[6, 5, 5, 1]]) == 31
    assert steps([[4, 4, 4, 1]]) == 2  # 4 << 27 is the largest key
    # a program runs until its last fibre settles
    assert steps([[5, 3, 9, 1], [6, 5, 5, 1]]) == 31
    # 16-bit keys take every step
    assert kb.steps_to_settle(np.array([[5, 3, 9, 1]]) << 11, k=2, bits=15) == 15


def test_without_a_loop_the_static_count_is_the_estimate():
    unrolled = re.sub(r".*@P0 BRA `\(\.L_x_1\) ;\n", "", SASS)
    instructions, loops = kb.parse_sass(unrolled)
    e = kb.estimate(instructions, loops, trips=31)
    assert (loops, e.static, e.per_warp, kb.loops_cell(e)) == ([], 8, 8, "-")


def test_res_usage_by_function():
    assert kb.parse_res_usage(RES_USAGE) == {"kernel": {
        "REG": 180, "STACK": 16, "SHARED": 1024, "LOCAL": 0, "CONSTANT[0]": 568, "TEXTURE": 0,
        "SURFACE": 0, "SAMPLER": 0}}


LOOPED = """
import sys
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

@triton.jit
def _looped(x, out, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    acc = tl.load(x + offs)
    for _ in range(n):  # a trip count known only at run time: a loop in the SASS
        acc = acc * 3 + tl.sum(acc, 0)
    tl.store(out + offs, acc)

compiled = triton.compile(ASTSource(_looped, {"x": "*i32", "out": "*i32", "n": "i32"}, {"BLOCK": 128}),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
open(sys.argv[1], "wb").write(compiled.asm["cubin"])
"""


@needs_triton
def test_loops_found_in_a_compiled_kernel(tmp_path):
    # compiled in a process of its own: the interpreter tests set TRITON_INTERPRET in this one
    cubin, program = tmp_path / "looped.cubin", tmp_path / "looped.py"  # triton.jit reads the source
    program.write_text(LOOPED)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(program), str(cubin)], capture_output=True, text=True,
                         timeout=300, env={**env, "TRITON_CACHE_DIR": str(tmp_path / "cache")})
    assert run.returncode == 0, run.stderr[-2000:]
    instructions, loops = kb.parse_sass(kb.tool("nvdisasm", "-c", cubin))
    assert loops and all(loop.size >= 3 for loop in loops)  # the body: sum, multiply-add, branch
    assert instructions[-1][1] == "EXIT" and not any(t == "NOP" for _, t in instructions[-3:])
    e = kb.estimate(instructions, loops, trips=10)
    longest = max(loop.size for loop in loops)
    assert e.per_warp == len(instructions) + 9 * longest
    assert kb.parse_res_usage(kb.tool("cuobjdump", "-res-usage", cubin))["_looped"]["REG"] > 0


@needs_triton
@pytest.mark.skipif(not hasattr(fibre_triton, "variant"),
                    reason="fibre_triton's variant interface has not landed")
def test_quick_run_prints_a_row_per_variant(tmp_path):
    out_json = tmp_path / "budget.json"
    run = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--json", str(out_json)],
                         capture_output=True, text=True, timeout=600, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(
                             filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))})
    assert run.returncode in (0, 1), run.stderr  # 1: over budget, which CI judges, not this
    lines = run.stdout.splitlines()
    assert kb.header() in lines, run.stdout
    rows = [line for line in lines if re.match(r"(float32|bfloat16|float16) +(yes|no) ", line)]
    table = json.loads(out_json.read_text())["rows"]
    assert rows and len(rows) == len(table), run.stdout
    number = r"\d+(\.\d+)?"
    for line in rows:
        cells = line.split(None, len(kb.COLUMNS) - 1)
        assert len(cells) == len(kb.COLUMNS), line
        values = dict(zip(kb.COLUMNS, cells))
        assert values["budget"] in ("ok", "MISS"), line
        for column in ("n", "regs", "stack", "sass", "instr/warp", "instr/elem", "compile_s"):
            assert re.fullmatch(rf"{number}(-{number})?|-", values[column]), (column, line)
    for row in table:
        assert row["error"] is not None or row["registers"] > 0, row
        assert bool(row["misses"]) == (row["error"] is not None or row["stack"] > kb.MAX_STACK_BYTES
                                       or row["registers"] > kb.MAX_REGISTERS
                                       or row["per_element"] > kb.MAX_INSTRUCTIONS_PER_ELEMENT
                                       or row["compile_s"] >= kb.MAX_COMPILE_S), row
    assert re.search(rf"^{len(table)} variants, \d+ over budget", run.stdout, re.M), run.stdout
    assert (run.returncode == 1) == any(row["misses"] for row in table)
