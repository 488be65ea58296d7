"""byteps' DistributedDataParallel used as its examples use it, with only the import changed:
construct, train with the user's own optimizer, no_sync() gradient accumulation, buffers
broadcast, ADTopk by one argument, refused misuse. Each worker checks its results against a
single-process reference trained on every worker's data, and prints one line per result.

    bpslaunch --local --num-workers 2 --num-servers 1 -- python ddp_style.py
"""
import copy

import torch
import torch.nn.functional as F

import adtopk_ps.torch as bps
from adtopk_ps.torch.parallel import DistributedDataParallel
from report import digest, say

BATCH, STEPS, CHUNKS = 8, 6, 3


def batch(step, worker, chunk=0):
    gen = torch.Generator().manual_seed(1000 * step + 10 * worker + chunk)
    return torch.randn(BATCH, 12, generator=gen), torch.randint(0, 4, (BATCH,), generator=gen)


class Scaled(torch.nn.Module):
    """A buffer used, never updated, by forward: what each worker sees shows whose it is."""

    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.ones(1))

    def forward(self, x):
        return x * self.scale


def net():
    return torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.ReLU(), Scaled(),
                               torch.nn.Linear(32, 4))


def diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a.parameters(), b.parameters()))


def train(compression, chunks, label):
    c = bps.client()
    pushed = c.bytes_pushed
    torch.manual_seed(5 + bps.rank())  # different weights everywhere until the broadcast
    model = net()
    ddp = DistributedDataParallel(model, compression=compression)
    reference = copy.deepcopy(model)  # rank 0's weights, on every worker
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        optimizer.zero_grad()
        with ddp.no_sync():
            for chunk in range(chunks - 1):
                (F.cross_entropy(ddp(batch(step, bps.rank(), chunk)[0]),
                                 batch(step, bps.rank(), chunk)[1]) / chunks).backward()
        x, y = batch(step, bps.rank(), chunks - 1)
        (F.cross_entropy(ddp(x), y) / chunks).backward()
        ddp.synchronize()  # byteps' pattern: nothing left to do
        optimizer.step()
        # the big-batch step: every worker's every chunk in one mean
        xs, ys = zip(*(batch(step, w, c) for w in range(bps.size()) for c in range(chunks)))
        ref_opt.zero_grad()
        F.cross_entropy(reference(torch.cat(xs)), torch.cat(ys)).backward()
        ref_opt.step()
    say(f"{label}: max diff from the big-batch step {diff(model, reference):.3g}; "
        f"params {digest(model.parameters())}; pushed {(c.bytes_pushed - pushed) // STEPS} "
        f"bytes a step")
    return ddp


def main():
    bps.init()
    ddp = train(bps.Compression.none, 1, "plain")
    train(bps.Compression.none, CHUNKS, "no_sync")
    # buffers: rank 0's at the start of a forward pass with gradients, a worker's own under no_grad
    scaled = ddp.module[2]
    scaled.scale.fill_(bps.rank() + 1.0)
    with torch.no_grad():
        ddp(torch.ones(1, 12))
    kept = scaled.scale.item()
    ddp(torch.ones(1, 12))
    say(f"buffer under no_grad {kept}, after a forward {scaled.scale.item()}")
    # ADTopk by one argument (the test makes the first layer large enough to sparsify)
    train(bps.Compression.adtopk(ratio=0.1), 1, "adtopk")
    for what, call in (("two devices", lambda: DistributedDataParallel(net(), device_ids=[0, 1])),
                       ("synchronize inside no_sync", lambda: _sync_inside(ddp))):
        try:
            call()
            say(f"NOT refused {what}")
        except (ValueError, RuntimeError) as exc:
            say(f"refused {what}: {exc}")
    bps.shutdown()


def _sync_inside(ddp):
    with ddp.no_sync():
        ddp.synchronize()


if __name__ == "__main__":
    main()
