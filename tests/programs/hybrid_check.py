"""Two workers train a model of sparse and dense tensors; every step each prints a digest of
its parameters, which must not depend on the route the dense tensors take (two workers' sum
is exact either way) and must agree between the workers.

    bpslaunch --local --num-workers 2 ... -- python hybrid_check.py TRANSPORT OVERLAP COMPRESSOR \
        [--die-at STEP]

With --die-at, worker 1 dies in the middle of that step, its gradients half pushed; with
--hang-at it stops there, alive but silent, as a hung process or a cut link would be.
"""
import argparse
import hashlib
import os
import signal

import torch

import adtopk_ps.torch as bps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("transport")
    ap.add_argument("overlap", choices=["0", "1"])
    ap.add_argument("compressor")
    ap.add_argument("--die-at", type=int)
    ap.add_argument("--hang-at", type=int, help="worker 1 stops (SIGSTOP) in the middle of that step")
    ap.add_argument("--cost", action="store_true", help="the measured cost model, its step trial too")
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    transport, overlap, compressor = args.transport, args.overlap == "1", args.compressor
    bps.init()
    rank = bps.rank()
    torch.manual_seed(0)
    # sparse: the two large weights; dense: biases, the norm, the small layers; with 3 KB
    # buckets some dense tensors share one and the 512-wide biases and the norm go alone. With
    # the cost model, two 4 MB layers that no bucket would carry, which sparsifying pays for
    wide = [torch.nn.Linear(512, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 512)] if args.cost else []
    model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.LayerNorm(512), torch.nn.ReLU(),
                                torch.nn.Linear(512, 512), torch.nn.ReLU(), *wide, torch.nn.Linear(512, 16),
                                torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
    compression = bps.GradientCompression(
        None if compressor == "none" else {"compressor": compressor, "k": 0.05, "ef": "vanilla"},
        dense_transport=transport, measure_costs=args.cost)
    opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   model.named_parameters(), compression,
                                   overlap="auto" if args.cost else overlap, fusion_bytes=3000)
    lane = "allreduce" if compression.allreduce else "servers"
    print(f"worker {rank}: dense via {lane}, {len(opt.gradient_sync.buckets)} bucket(s)", flush=True)
    if compression.costs is not None:
        print(f"worker {rank}: measured {compression.costs.bytes_per_s / 1e6:.3f} MB/s through the "
              f"servers, {compression.allreduce_bytes_per_s / 1e6:.3f} MB/s by all-reduce", flush=True)
    for step in range(args.steps):
        overlap, dense = opt.overlap, sum(route.dense for route in compression.routes.values())
        gen = torch.Generator().manual_seed(100 * step + rank)
        opt.zero_grad()
        model(torch.randn(8, 64, generator=gen)).square().mean().backward()
        if step == args.die_at and rank == 1:  # with overlap, some gradients have left
            print(f"worker {rank}: dying", flush=True)
            os._exit(3)
        if step == args.hang_at and rank == 1:
            print(f"worker {rank}: hanging", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
        opt.step()
        digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters()))
        print(f"worker {rank}: step {step} {digest.hexdigest()[:16]} overlap={overlap} "
              f"dense={dense} choosing={opt.choosing}", flush=True)
    if opt.gradient_sync.trial is not None and opt.gradient_sync.trial.choice is not None:
        def mode(m):  # (overlap, 1 where every tensor goes dense)
            return f"({m.overlap}, {int(m.plan.every_dense)})"
        medians = " ".join(f"{mode(m)}={t:.6f}" for m, t in zip(opt.gradient_sync.trial.modes, opt.gradient_sync.trial.medians))
        print(f"worker {rank}: trial medians {medians} chose {mode(opt.gradient_sync.trial.choice)}", flush=True)
    bps.shutdown()


if __name__ == "__main__":
    main()
