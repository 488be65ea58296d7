"""byteps' cross-barrier benchmark's use of CrossBarrier, with only the import changed, against
the plain DistributedOptimizer on the same data: SGD with momentum, weight decay and nesterov,
Adam and RMSprop (and SGD under ADTopk); step() leaves the updates pending for the next forward
pass; a refused optimizer class; a forward that reads a parameter outside its module; a NaN
on one worker stops both.

    bpslaunch --local --num-workers 2 --num-servers 1 -- python cross_barrier_style.py
"""
import copy

import torch
import torch.nn.functional as F

import adtopk_ps.torch.cross_barrier as bps
from report import say

STEPS = 6
OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=1e-3, nesterov=True),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01, weight_decay=1e-3),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=0.01, momentum=0.5),
}


def batch(step):
    gen = torch.Generator().manual_seed(100 * step + bps.rank())
    return torch.randn(16, 12, generator=gen), torch.randint(0, 4, (16,), generator=gen)


def net():
    torch.manual_seed(3 + bps.rank())  # different everywhere until the broadcast
    model = torch.nn.Sequential(torch.nn.Linear(12, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32),
                                torch.nn.ReLU(), torch.nn.Linear(32, 4))
    bps.broadcast_parameters(model.state_dict(), root_rank=0)
    return model


def run(model, optimizer):
    for step in range(STEPS):
        x, y = batch(step)
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()


def compare(kind, compression=None):
    plain = net()
    crossing = copy.deepcopy(plain)
    opt = bps.DistributedOptimizer(OPTIMIZERS[kind](plain.parameters()), plain.named_parameters(),
                                   compression() if compression else None,
                                   key_prefix=f"plain.{kind}{'.adtopk' if compression else ''}.")
    run(plain, opt)
    cb = bps.CrossBarrier(crossing, OPTIMIZERS[kind](crossing.parameters()),
                          named_parameters=crossing.named_parameters(),
                          compression=compression() if compression else bps.Compression.none)
    bps.broadcast_optimizer_state(cb, root_rank=0)
    run(crossing, cb)
    before = crossing[0].weight.detach().clone()
    pending = len(cb._pending)
    with torch.no_grad():  # the pre-hooks apply the last step's updates, layer by layer
        outputs = (plain(batch(99)[0]) - crossing(batch(99)[0])).abs().max().item()
    moved = not torch.equal(before, crossing[0].weight)
    params = max((a - b).abs().max().item()
                 for a, b in zip(plain.state_dict().values(), crossing.state_dict().values()))
    state = max((a - b).abs().max().item() for a, b in zip(
        (t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)),
        (t for s in cb.state.values() for t in s.values() if torch.is_tensor(t))))
    say(f"{kind}{'+adtopk' if compression else ''}: {pending} updates pending after step(), "
        f"applied by the forward: {moved}; max diff from the plain optimizer: outputs "
        f"{outputs:.3g}, params {params:.3g}, optimizer state {state:.3g}")


class Reader(torch.nn.Module):
    """Reads its child's weight in its own forward: the child's pre-hook never runs."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(12, 4)

    def forward(self, x):
        return F.linear(x, self.lin.weight, self.lin.bias)


def refusals():
    model = net()
    try:
        bps.CrossBarrier(model, torch.optim.Adagrad(model.parameters()))
        say("NOT refused Adagrad")
    except TypeError as exc:
        say(f"refused Adagrad: {exc}")
    reader = Reader()
    bps.broadcast_parameters(reader.state_dict(), root_rank=0, prefix="reader")
    cb = bps.CrossBarrier(reader, torch.optim.SGD(reader.parameters(), lr=0.1))
    try:
        run(reader, cb)
        say("NOT refused a stale read")
    except RuntimeError as exc:
        say(f"refused a stale read: {exc}")


def nan_stops():
    """Worker 1's gradient turns NaN at step 2: every worker stops at the same layer."""
    model = net()
    cb = bps.CrossBarrier(model, torch.optim.SGD(model.parameters(), lr=0.1))
    try:
        for step in range(4):
            x, y = batch(step)
            cb.zero_grad()
            loss = F.cross_entropy(model(x), y)
            if step == 2 and bps.rank() == 1:
                loss = loss * float("nan")
            loss.backward()
            cb.step()
        cb.synchronize()
        say("NOT refused a NaN")
    except bps.NonFiniteGradient as exc:
        say(f"refused a NaN: {exc}")


def main():
    bps.init()
    for kind in OPTIMIZERS:
        compare(kind)
    compare("sgd", lambda: bps.Compression.adtopk(ratio=0.1))
    refusals()
    nan_stops()
    bps.shutdown()


if __name__ == "__main__":
    main()
