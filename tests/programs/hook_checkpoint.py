"""The ADTopk DDP hook on gloo: a branch only rank 0 uses (rank 1's gradient of it is all
zeros) under ``find_unused_parameters=True``, then the PowerSGD checkpoint pattern: save
the hook state with the model, load both, register the loaded state on a new DDP model.

    python hook_checkpoint.py RANK WORLD INIT_FILE OUT_DIR

Writes OUT_DIR/rank<R>.pt: the parameters after continuing with the original state and
with the loaded one (they must be equal), the zero-gradient step's gradients, and how far
the hook without compression strays from plain DDP.
"""
import copy
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import adtopk_ps.torch as bps
from adtopk_ps.compression import SparsificationPolicy


class Net(torch.nn.Module):
    """Two same-shaped layers (binding by name order must not swap them) and a branch."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(32, 32)
        self.b = torch.nn.Linear(32, 32)
        self.branch = torch.nn.Linear(32, 32)
        self.head = torch.nn.Linear(32, 4)

    def forward(self, x, use_branch):
        h = torch.relu(self.b(torch.relu(self.a(x))))
        if use_branch:
            h = h + self.branch(h)
        return self.head(h)


def steps(ddp, opt, rank, count, seed, use_branch):
    gen = torch.Generator().manual_seed(seed + rank)
    for _ in range(count):
        x, y = torch.randn(16, 32, generator=gen), torch.randint(0, 4, (16,), generator=gen)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x, use_branch), y).backward()
        opt.step()


def make(model, state):
    ddp = DistributedDataParallel(model, find_unused_parameters=True, bucket_cap_mb=0.005)
    ddp.register_comm_hook(state, bps.adtopk_hook)
    return ddp, torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)


def main():
    rank, world, init, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = Net()
    compression = bps.GradientCompression(  # the 32x32 weights go sparse, with residuals
        {"compressor": "adtopk", "k": 0.1, "ef": "vanilla"},
        SparsificationPolicy(0.1, min_compress_bytes=1024))
    state = bps.ADTopkHookState(model, compression)
    ddp, opt = make(model, state)
    # the branch only on rank 0: rank 1's gradient of branch.weight is all zeros
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(rank))
    opt.zero_grad()
    ddp(x, use_branch=rank == 0).sum().backward()
    zero_step = {n: p.grad.clone() for n, p in model.named_parameters()}
    steps(ddp, opt, rank, 3, seed=10, use_branch=True)
    path = f"{out}/checkpoint{rank}.pt"
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "hook": state}, path)
    loaded = torch.load(path, weights_only=False)
    # continue with the original state...
    twin = copy.deepcopy(model)
    steps(ddp, opt, rank, 3, seed=20, use_branch=True)
    # ...and, from the checkpoint, with the loaded state on a new DDP model
    fresh = Net()
    fresh.load_state_dict(loaded["model"])
    assert all(torch.equal(p, q) for p, q in zip(fresh.parameters(), twin.parameters()))
    ddp2, opt2 = make(fresh, loaded["hook"])
    opt2.load_state_dict(loaded["opt"])
    steps(ddp2, opt2, rank, 3, seed=20, use_branch=True)
    # a loaded state on a model whose values did not come from its checkpoint is refused
    stranger, _ = make(Net(), torch.load(path, weights_only=False)["hook"])
    try:
        stranger(x, True).sum().backward()
        refused = ""
    except Exception as exc:  # noqa: BLE001 - DDP may wrap the hook's ValueError
        refused = str(exc)
    # parity, as PyTorch's hook tests check it: with no compression the hook trains as plain DDP
    plain, hooked = Net(), Net()
    hooked.load_state_dict(plain.state_dict())
    ddp_plain = DistributedDataParallel(plain, find_unused_parameters=True)
    opt_plain = torch.optim.SGD(ddp_plain.parameters(), lr=0.1, momentum=0.9)
    ddp_hooked, opt_hooked = make(hooked, bps.ADTopkHookState(hooked, "none"))
    steps(ddp_plain, opt_plain, rank, 4, seed=30, use_branch=True)
    steps(ddp_hooked, opt_hooked, rank, 4, seed=30, use_branch=True)
    parity = max((p - q).abs().max().item() for p, q in zip(plain.parameters(), hooked.parameters()))
    torch.save({"zero_step": zero_step, "refused": refused, "parity": parity, "original": dict(model.named_parameters()),
                "loaded": dict(fresh.named_parameters()),
                "steps": (state.steps, loaded["hook"].steps),
                "group": loaded["hook"].process_group}, f"{out}/rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
