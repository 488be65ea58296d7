"""Two iterations of the same model and inputs, through the PS optimizer or the DDP hook;
saves the averaged gradients of each iteration for the test to compare.

    bpslaunch --local ... -- python hook_vs_ps.py ps OUT_DIR
    python hook_vs_ps.py ddp OUT_DIR RANK WORLD INIT_FILE
"""
import sys

import torch
import torch.distributed as dist

import adtopk_ps.torch as bps
from adtopk_ps.compression import SparsificationPolicy

COMPRESSION = {"compressor": "adtopk", "k": 0.05, "ef": "vanilla"}


def model_and_inputs(rank):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                                torch.nn.Linear(16 * 6 * 6, 64), torch.nn.ReLU(), torch.nn.Linear(64, 5))
    gen = torch.Generator().manual_seed(1000 + rank)
    batches = [(torch.randn(4, 3, 8, 8, generator=gen), torch.randint(0, 5, (4,), generator=gen))
               for _ in range(2)]
    return model, batches


def compression():
    # 1 KiB: the conv and the first linear layer are sparsified, the rest travel dense
    return bps.GradientCompression(COMPRESSION, SparsificationPolicy(0.05, min_compress_bytes=1024))


def run(model, opt, batches, sync):
    grads = []
    for x, y in batches:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        sync()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
    return grads


def main():
    mode, out = sys.argv[1], sys.argv[2]
    if mode == "ps":
        bps.init()
        rank = bps.rank()
        model, batches = model_and_inputs(rank)
        opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       model.named_parameters(), compression())

        def sync():
            opt.synchronize()
        with opt.skip_synchronize():
            grads = run(model, opt, batches, sync)
        bps.shutdown()
    else:
        rank, world, init = int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
        dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
        model, batches = model_and_inputs(rank)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        ddp.register_comm_hook(bps.ADTopkHookState(model, compression()), bps.adtopk_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        grads = run(ddp, opt, batches, lambda: None)
        grads = [{n.removeprefix("module."): g for n, g in step.items()} for step in grads]
        # both past their last collective before either closes its connections (gloo aborts
        # a process whose peer hangs up under a collective in flight)
        dist.barrier()
        dist.destroy_process_group()
    torch.save(grads, f"{out}/{mode}{rank}.pt")


if __name__ == "__main__":
    main()
