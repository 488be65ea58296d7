"""Two workers train a model of many small tensors with fused buckets; every step each
worker checks its averaged gradients bit for bit against the mean it computes itself
from both workers' inputs (seeded per rank), and that a never-used layer inside a bucket
gets zeros.

    bpslaunch --local --num-workers 2 ... -- python fusion_check.py FUSION_BYTES
"""
import sys

import torch

import adtopk_ps.torch as bps


def build():
    torch.manual_seed(0)
    layers = [torch.nn.Linear(12, 12) for _ in range(6)]
    model = torch.nn.Sequential(*[m for layer in layers for m in (layer, torch.nn.LayerNorm(12))])
    unused = torch.nn.Linear(3, 3)  # in a bucket, never used
    return model, unused


def batch(rank, step):
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 12, generator=gen)


def local_grads(model, x):
    model.zero_grad()
    model(x).square().mean().backward()
    return [p.grad.clone() for p in model.parameters()]


def main():
    bps.init()
    rank = bps.rank()
    model, unused = build()
    twin, _ = build()  # computes both workers' gradients to predict the average
    params = list(model.named_parameters()) + [(f"unused.{n}", p) for n, p in unused.named_parameters()]
    opt = bps.DistributedOptimizer(torch.optim.SGD([p for _, p in params], lr=0.05), params,
                                   fusion_bytes=int(sys.argv[1]))
    fused = sum(len(b.members) for b in opt.gradient_sync.buckets)
    print(f"worker {rank}: {len(opt.gradient_sync.buckets)} bucket(s) holding {fused} of {len(params)} tensors",
          flush=True)
    for step in range(4):
        twin.load_state_dict(model.state_dict())
        both = [local_grads(twin, batch(r, step)) for r in range(2)]
        want = [(a + b) / 2 for a, b in zip(*both)]
        opt.zero_grad()
        model(batch(rank, step)).square().mean().backward()
        opt.synchronize()
        for (name, p), w in zip(model.named_parameters(), want):
            assert torch.equal(p.grad, w), (step, name)
        assert torch.equal(unused.weight.grad, torch.zeros(3, 3))
        with opt.skip_synchronize():
            opt.step()
    print(f"worker {rank}: fused averages exact", flush=True)
    bps.shutdown()


if __name__ == "__main__":
    main()
