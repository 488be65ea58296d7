"""Run under bpslaunch: workers start from different weights and optimizer states,
then broadcast from rank 0; prints checksums before and after for the test to compare."""
import argparse

import torch

import adtopk_ps.torch as bps
from report import digest


bps.init()
rank = bps.rank()
torch.manual_seed(100 + rank)  # a different initialisation on every worker
model = torch.nn.Sequential(torch.nn.Linear(20, 30), torch.nn.BatchNorm1d(30), torch.nn.Linear(30, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
if rank == 0:  # only the root has optimizer state (momentum buffers) and a changed lr
    model(torch.randn(8, 20)).sum().backward()
    opt.step()
    opt.param_groups[0]["lr"] = 0.05
print(f"before {rank} {digest(model.state_dict().values())}", flush=True)
bps.broadcast_parameters(model.state_dict(), root_rank=0)
bps.broadcast_optimizer_state(opt, root_rank=0)
momenta = [opt.state[p]["momentum_buffer"] for p in model.parameters()]
print(f"after {rank} {digest(model.state_dict().values())} {digest(momenta)} "
      f"lr={opt.param_groups[0]['lr']} batches={int(model[1].num_batches_tracked)}", flush=True)
# objects: a Namespace from the root, and one object of a different size from every worker
ns = bps.broadcast_object(argparse.Namespace(lr=0.1 * (rank + 1), name="root") if rank == 0 else None)
gathered = bps.allgather_object({"rank": rank, "pad": "x" * (7 * rank)})
print(f"objects {rank} {ns.lr} {ns.name} {[g['rank'] for g in gathered]} "
      f"{[len(g['pad']) for g in gathered]}", flush=True)
bps.shutdown()
