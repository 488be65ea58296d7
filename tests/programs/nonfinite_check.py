"""Two workers train a small MLP; one puts a NaN (or an infinity) into one tensor's gradient
at one step. Every worker prints a checksum of its parameters and the loss after each step,
and at the end how many steps it skipped.

    python nonfinite_check.py POLICY ROUTE TENSOR BAD_RANK BAD_STEP VALUE

ROUTE: sparse (adtopk with error feedback for the weights, fused buckets for the rest),
none (no compression, every tensor its own key), allreduce (the dense tensors all-reduced
among the workers). VALUE: nan, inf or -inf.
"""
import hashlib
import sys

import torch

import adtopk_ps.torch as bps
from adtopk_ps.compression import SparsificationPolicy, create

STEPS = 8


def digest(model):
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def compression(route):
    if route == "none":
        return bps.GradientCompression(None)
    adtopk = create("adtopk", ratio=0.05, ef="vanilla")
    policy = SparsificationPolicy(0.05, min_compress_bytes=4096)
    return bps.GradientCompression(adtopk, policy, dense_transport="allreduce" if route == "allreduce" else "ps")


def main():
    policy, route, tensor, bad_rank, bad_step, value = sys.argv[1:]
    bad_rank, bad_step, value = int(bad_rank), int(bad_step), float(value)
    bps.init()
    rank = bps.rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64),
                                torch.nn.ReLU(), torch.nn.Linear(64, 4))
    opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   model.named_parameters(), compression(route),
                                   fusion_bytes=0 if route == "none" else None, nonfinite=policy)
    state = {"step": 0}

    def poison(grad):  # in backward, so it is in the gradient however early it leaves
        if rank == bad_rank and state["step"] == bad_step:
            grad = grad.clone()
            grad.view(-1)[grad.numel() // 3] = value
        return grad
    dict(model.named_parameters())[tensor].register_hook(poison)
    gen = torch.Generator().manual_seed(1 + rank)
    for step in range(STEPS):
        state["step"] = step
        x = torch.randn(16, 32, generator=gen)
        y = torch.randint(0, 4, (16,), generator=gen)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        try:
            opt.step()
        except bps.NonFiniteGradient as exc:
            print(f"stopped: {exc}", flush=True)
            sys.exit(3)
        print(f"step {step} checksum {digest(model)} loss {loss.item():.6f}", flush=True)
    print(f"done skipped={opt.skipped_steps}", flush=True)
    bps.shutdown()


if __name__ == "__main__":
    main()
