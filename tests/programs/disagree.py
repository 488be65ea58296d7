"""Workers set up alike, or differing in one respect chosen by rank; prints what happened.

    bpslaunch --local --num-workers 2 ... -- python disagree.py CASE [CASE ...]
    python disagree.py --ddp RANK WORLD INIT_FILE CASE    (the DDP hook on gloo)

Worker 1 takes each CASE's other setting; the cases run one after another in one cluster.
Each worker prints ``REFUSED case=C rank=R after S s: ...`` where the optimizer refuses, or
``TRAINED case=C rank=R checksum=...`` after three steps; it exits 3 if any case was refused.
"""
import hashlib
import sys
import time

import torch
import torch.distributed as dist

import adtopk_ps.torch as bps
from adtopk_ps.compression import SparsificationPolicy

BASE = {"compressor": "adtopk", "k": 0.01, "ef": "vanilla", "hidden": 64, "dtype": torch.float32,
        "dense_transport": "ps", "backward_passes_per_step": 1, "overlap": False, "prefix": "", "op": bps.Average, "nonfinite": "stop"}
OTHER = {  # worker 1's setting in each case
    "agree": {},
    "compressor": {"compressor": "topk"},
    "randomk": {"compressor": "randomk"},
    "ratio": {"k": 0.05},
    "ef": {"ef": "none"},
    "none": {"compressor": "none"},
    "transport": {"dense_transport": "allreduce"},
    "shape": {"hidden": 65},
    "dtype": {"dtype": torch.float64},
    "passes": {"backward_passes_per_step": 2},
    "overlap": {"overlap": True},
    "op": {"op": bps.Sum},
    "nonfinite": {"nonfinite": "skip"},
    "names": {"prefix": "net."},
}


def setup(case: str, rank: int):
    s = {**BASE, **(OTHER[case] if rank == 1 else {})}
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, s["hidden"]), torch.nn.ReLU(),
                                torch.nn.Linear(s["hidden"], 4)).to(s["dtype"])
    spec = "none" if s["compressor"] == "none" else \
        {"compressor": s["compressor"], "k": s["k"], "ef": s["ef"]}
    ratio = 1.0 if spec == "none" else s["k"]
    # 1 KiB: both weights are sparsified, the biases travel dense
    compression = bps.GradientCompression(spec, SparsificationPolicy(ratio, min_compress_bytes=1024),
                                          dense_transport=s["dense_transport"])
    return s, model, compression


def run(case: str, rank: int) -> bool:
    """One case in the running cluster; whether it trained."""
    s, model, compression = setup(case, rank)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    began = time.monotonic()
    try:
        named = [(s["prefix"] + name, p) for name, p in model.named_parameters()]
        opt = bps.DistributedOptimizer(sgd, named, compression,
                                       overlap=s["overlap"], op=s["op"], nonfinite=s["nonfinite"],
                                       backward_passes_per_step=s["backward_passes_per_step"])
    except bps.Disagreement as exc:
        print(f"REFUSED case={case} rank={rank} after {time.monotonic() - began:.2f} s: {exc}",
              flush=True)
        return False
    gen = torch.Generator().manual_seed(rank)
    for _ in range(3):
        opt.zero_grad()
        for _ in range(s["backward_passes_per_step"]):
            model(torch.randn(8, 32, generator=gen).to(s["dtype"])).square().mean().backward()
        opt.step()
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters()))
    print(f"TRAINED case={case} rank={rank} checksum={digest.hexdigest()[:16]}", flush=True)
    return True


def ddp(rank: int, world: int, init: str, case: str) -> bool:
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    _, model, compression = setup(case, rank)
    began = time.monotonic()
    try:
        bps.ADTopkHookState(model, compression)
    except bps.Disagreement as exc:
        print(f"REFUSED case={case} rank={rank} after {time.monotonic() - began:.2f} s: {exc}",
              flush=True)
        return False
    finally:
        dist.destroy_process_group()
    print(f"AGREED case={case} rank={rank}", flush=True)
    return True


def main() -> int:
    if sys.argv[1] == "--ddp":
        rank, world, init, case = sys.argv[2:]
        return 0 if ddp(int(rank), int(world), init, case) else 3
    bps.init()
    trained = [run(case, bps.rank()) for case in sys.argv[1:]]
    bps.shutdown()
    return 0 if all(trained) else 3


if __name__ == "__main__":
    sys.exit(main())
