"""Fine-tuning's schedule under DistributedOptimizer: the backbone frozen when the optimizer
is built and unfrozen at step 2, the head frozen at step 4; every worker trains on its own
data. Prints ``worker R: <check> ok`` or ``FAILED``."""
import hashlib

import torch

import adtopk_ps.torch as bps

bps.init()
rank = bps.rank()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
backbone, head = model[0], model[2]
for p in backbone.parameters():
    p.requires_grad_(False)
bps.broadcast_parameters(model.state_dict(), root_rank=0)
opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                               named_parameters=model.named_parameters())
start = backbone.weight.detach().clone()
data = torch.Generator().manual_seed(rank)


def digest() -> str:
    return hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()


for step in range(6):
    if step == 2:
        for p in backbone.parameters():
            p.requires_grad_(True)
    if step == 4:
        for p in head.parameters():
            p.requires_grad_(False)
    opt.zero_grad()
    x, y = torch.randn(32, 8, generator=data), torch.randint(0, 2, (32,), generator=data)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    same = len(set(bps.allgather_object(digest()))) == 1
    print(f"worker {rank}: step {step} replicas equal {'ok' if same else 'FAILED'}", flush=True)
moved = not torch.equal(backbone.weight.detach(), start)
print(f"worker {rank}: unfrozen backbone trained {'ok' if moved else 'FAILED'}", flush=True)
bps.verify_replicas(model, 6)
print(f"worker {rank}: equal replicas verified ok", flush=True)
with torch.no_grad():
    if rank == 1:
        head.bias.add_(1.0)  # one worker's copy drifts
try:
    bps.verify_replicas(model, 7)
    print(f"worker {rank}: drift found FAILED (not raised)", flush=True)
except bps.ReplicasDiverged as exc:
    named = "'2.bias'" in str(exc) and "after step 7" in str(exc)
    print(f"worker {rank}: drift found {'ok' if named else 'FAILED ' + str(exc)}", flush=True)
