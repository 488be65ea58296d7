"""A worker job that proves a cluster sums correctly: every aggregate is checked exactly.

Every worker draws every worker's gradients from shared seeds, so each can
compute, on its own, what the servers must return: the sum over workers of
what each worker's compressor sends, divided by W. Gradients are small
integers, so sums are exact in any order and results compare bit for bit.

    bpslaunch --local --num-workers 2 --num-servers 2 -- \\
        python -m worker.selfcheck --compressor adtopk --ratio 0.05 --ef --rounds 20

``--report FILE`` writes each round's latency (first push to last answer) as
JSON, for the soak benchmark; ``--slow-rank R --slow-seconds S`` makes rank R
sleep before every round, the test hook for a straggler.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import time

import torch

from adtopk_ps.client.ps_client import PSClient
from adtopk_ps.cluster.membership import part_name, partition_rows, split
from adtopk_ps.cluster.stop import exit_when_done
from adtopk_ps.compression import COMPRESSORS, create
from adtopk_ps.core.dtypes import FLOAT_DTYPES

DEFAULT_SHAPES = ["64x300", "1000", "7x3x5x5", "33x1", "1x70000", "600x1024"]
# the dtypes gradients are trained in (float64 travels too, but no model here pushes it)
DTYPES = {name: FLOAT_DTYPES[name] for name in ("float32", "float16", "bfloat16")}


def parse_shape(text: str) -> tuple[int, ...]:
    """``"256x256"`` as ``(256, 256)``."""
    return tuple(int(d) for d in text.lower().split("x"))


def gradient(shape: tuple[int, ...], dtype: torch.dtype, worker: int, rnd: int, tensor: int,
             seed: int) -> torch.Tensor:
    """A worker's gradient for one round and tensor: small integers from shared seeds, so any worker can recompute it."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + worker * 10_007 + rnd * 101 + tensor)
    return torch.randint(-8, 9, shape, generator=gen).to(dtype)


def make_compressor(args: argparse.Namespace):
    """The compressor the command line asks for."""
    if args.compressor == "none":
        return create("none")
    return create(args.compressor, ratio=args.ratio, ef="vanilla" if args.ef else None)


def expected(compressors: list, grads: list[torch.Tensor], name: str, step: int,
             partition_bytes: int) -> torch.Tensor:
    """What the servers must answer: each worker's decompressed sends, summed, over W."""
    g0 = grads[0]
    blocks = partition_rows(tuple(g0.shape), g0.element_size(), partition_bytes)
    total = torch.zeros_like(g0)
    for comp, grad in zip(compressors, grads):
        for index, (part, out) in enumerate(zip(split(grad, blocks), split(total, blocks))):
            out.add_(comp.decompress(comp.compress(part, part_name(name, index), step)))
    return total.div_(len(grads))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (see the module's docstring)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--compressor", default="adtopk", choices=sorted(COMPRESSORS))
    ap.add_argument("--ratio", type=float, default=0.05)
    ap.add_argument("--ef", action="store_true", help="wrap the compressor with error feedback")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--shapes", nargs="*", default=DEFAULT_SHAPES)
    ap.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sleep", type=float, default=0.0, help="seconds to pause after each round")
    ap.add_argument("--shuffle", action="store_true",
                    help="push the tensors in a different random order on every worker and round")
    ap.add_argument("--report", help="write per-round latencies to this JSON file ({rank} is "
                                     "replaced by the worker's rank)")
    ap.add_argument("--every", type=int, default=1, help="print a progress line every N rounds")
    ap.add_argument("--slow-rank", type=int, default=-1, help="this rank sleeps before every round")
    ap.add_argument("--slow-seconds", type=float, default=0.0)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Push known gradients for ``--rounds`` rounds and check every sum exactly; returns the exit status."""
    args = parse_args(argv)
    shapes = [parse_shape(s) for s in args.shapes]
    dtype = DTYPES[args.dtype]

    client = PSClient()
    rank, size = client.rank, client.size
    print(f"worker {rank}/{size} pid={os.getpid()} compressor={args.compressor}", flush=True)
    mine = make_compressor(args)
    # a twin of every worker's compressor, so each worker can predict the sum
    twins = [make_compressor(args) for _ in range(size)]
    names = [f"t{i}" for i in range(len(shapes))]
    for name, shape in zip(names, shapes):
        client.declare(name, torch.empty(shape, dtype=dtype))
    try:
        return check_rounds(client, args, list(zip(names, shapes)), dtype, mine, twins)
    except Exception as exc:
        print(f"worker {rank}: {type(exc).__name__}: {exc}", flush=True)
        return 1
    finally:
        client.shutdown()


def check_rounds(client: PSClient, args: argparse.Namespace, tensors: list[tuple[str, tuple[int, ...]]],
                 dtype: torch.dtype, mine, twins: list) -> int:
    """Every round: push ``tensors`` (name, shape), check every answer; 0 where all were exact."""
    rank = client.rank
    start = time.perf_counter()
    latencies: list[float] = []
    order = list(range(len(tensors)))
    for rnd in range(args.rounds):
        if rank == args.slow_rank:
            time.sleep(args.slow_seconds)
        if args.shuffle:
            random.Random(rank * 7919 + rnd).shuffle(order)
        answered, latency = push_round(client, args, [(i, *tensors[i]) for i in order], dtype, mine, rnd)
        latencies.append(latency)
        wrong = first_wrong(client, answered, twins, rnd)
        if wrong:
            print(f"worker {rank}: round {rnd} {wrong}", flush=True)
            return 1
        if (rnd + 1) % args.every == 0:
            print(f"worker {rank}: round {rnd} ok", flush=True)
        if args.sleep:
            time.sleep(args.sleep)
    wall = time.perf_counter() - start
    client.barrier()
    if args.report:
        with open(args.report.format(rank=rank), "w") as f:
            json.dump({"rank": rank, "rounds": args.rounds, "wall_s": wall, "latencies_s": latencies}, f)
    print(f"worker {rank}: selfcheck passed: {args.rounds} rounds x {len(tensors)} tensors, "
          f"{args.rounds / wall:.1f} rounds/s, pushed {client.bytes_pushed} B, "
          f"pulled {client.bytes_pulled} B", flush=True)
    return 0


def push_round(client: PSClient, args: argparse.Namespace, tensors: list[tuple[int, str, tuple[int, ...]]],
               dtype: torch.dtype, mine, rnd: int) -> tuple[list[tuple[str, list, torch.Tensor]], float]:
    """Push this worker's gradient of every tensor (index, name, shape) in round ``rnd``, all in
    flight at once: (name, every worker's gradient, the answer) for each, and the round's
    latency (first push to last answer)."""
    rank, size = client.rank, client.size
    grads = {i: [gradient(shape, dtype, w, rnd, i, args.seed) for w in range(size)] for i, _, shape in tensors}
    handles = []
    began = time.perf_counter()
    for i, name, shape in tensors:
        # dense tensors and the 1-D ones go dense, as the policy would send them
        comp = mine if len(shape) >= 2 else create("none")
        handles.append((name, client.push_pull(grads[i][rank], name, comp), grads[i]))
    answers = [handle.wait() for _, handle, _ in handles]
    latency = time.perf_counter() - began
    return [(name, every, got) for (name, _, every), got in zip(handles, answers)], latency


def first_wrong(client: PSClient, answered: list, twins: list, rnd: int) -> str | None:
    """The first answer that is not the expected aggregate, in words; None where all are."""
    for name, grads, got in answered:
        comps = twins if len(grads[0].shape) >= 2 else [create("none")] * client.size
        want = expected(comps, grads, name, rnd, client.config.partition_bytes)
        if not torch.equal(got, want):
            bad = (got != want).sum().item()
            return f"tensor {name}: {bad} of {want.numel()} elements differ from the expected aggregate"
    return None


if __name__ == "__main__":
    exit_when_done(main())
