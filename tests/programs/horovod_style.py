"""A horovod user's calls with only the import changed; every worker checks its results
against values computed from the ranks and prints one line per check.

    bpslaunch --local --num-workers 3 --num-servers 1 -- python horovod_style.py
"""
import torch

import adtopk_ps.torch as hvd


def check(label, ok):
    print(f"worker {hvd.rank()}: {label} {'ok' if ok else 'WRONG'}", flush=True)


def refused(label, call):
    try:
        call()
    except ValueError as exc:
        check(f"{label} refused ({exc})", True)
        return
    check(f"{label} refused", False)


def main():
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    ranks = torch.arange(n, dtype=torch.float32) + 1
    t = torch.tensor([1.0, 2.0]) * (r + 1)
    check("allreduce average", torch.allclose(hvd.allreduce(t, op=hvd.Average),
                                              torch.tensor([1.0, 2.0]) * ranks.mean()))
    check("allreduce sum", torch.equal(hvd.allreduce(t, name="sum", op=hvd.Sum),
                                       torch.tensor([1.0, 2.0]) * ranks.sum()))
    check("allreduce average=False", torch.equal(hvd.allreduce(t, average=False),
                                                 torch.tensor([1.0, 2.0]) * ranks.sum()))
    ints = hvd.allreduce(torch.tensor([r + 1, -(r + 1), 7]))
    expected = torch.tensor([int(ranks.sum()), -int(ranks.sum()), 7 * n]).floor_divide(n)
    check(f"integer average floors {ints.tolist()}", ints.dtype == torch.int64 and torch.equal(ints, expected))
    big = hvd.allreduce(torch.tensor([2**40 + r]), op=hvd.Sum)
    check("int64 sum exact", big.item() == n * 2**40 + n * (n - 1) // 2)
    x = t.clone()
    check("allreduce_ in place", hvd.allreduce_(x, op=hvd.Sum) is x and torch.equal(x, torch.tensor([1.0, 2.0]) * ranks.sum()))
    half = hvd.allreduce(t, compression=hvd.Compression.fp16)
    check("fp16 compression", half.dtype == torch.float32 and torch.allclose(half, torch.tensor([1.0, 2.0]) * ranks.mean()))
    handle = hvd.allreduce_async(t, name="async")
    result = hvd.synchronize(handle)
    check("allreduce_async + synchronize", torch.allclose(result, torch.tensor([1.0, 2.0]) * ranks.mean()))
    w = torch.ones(3, requires_grad=True)
    hvd.allreduce(w * (r + 1), op=hvd.Sum).sum().backward()
    check("allreduce gradient", torch.equal(w.grad, torch.full((3,), float(n * (r + 1)))))

    b = hvd.broadcast(torch.full((3,), float(r)), root_rank=n - 1)
    check("broadcast", torch.equal(b, torch.full((3,), float(n - 1))))
    y = torch.full((2, 2), r, dtype=torch.int32)
    check("broadcast_ in place", hvd.broadcast_(y, root_rank=1, name="y") is y and torch.equal(y, torch.ones(2, 2, dtype=torch.int32)))

    g = hvd.allgather(torch.full((r + 1, 2), float(r)))
    rows = torch.cat([torch.full((k + 1, 2), float(k)) for k in range(n)])
    check(f"allgather unequal first dimensions {tuple(g.shape)}", torch.equal(g, rows))
    gi = hvd.allgather(torch.arange(r + 1), name="ints")
    check("allgather integers", gi.dtype == torch.int64 and gi.tolist() == [i for k in range(n) for i in range(k + 1)])
    objs = hvd.allgather_object({"rank": r, "pad": "x" * r})
    check("allgather_object", [o["rank"] for o in objs] == list(range(n)))
    ns = hvd.broadcast_object({"lr": 0.1} if r == 0 else None, root_rank=0)
    check("broadcast_object", ns == {"lr": 0.1})

    hvd.barrier()
    last = hvd.join()
    check(f"join returned {last}", 0 <= last < n and hvd.allgather_object(last) == [last] * n)
    check("is_initialized", hvd.is_initialized())

    torch.manual_seed(r)
    model = torch.nn.Linear(4, 1, bias=False)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                   named_parameters=model.named_parameters(), op=hvd.Sum)
    opt.set_backward_passes_per_step(1)
    model(torch.full((1, 4), float(r + 1))).sum().backward()
    # the gradient of sum(W x) is x: not read from p.grad, where with overlap the average
    # may land before step() (as with horovod's in-place allreduce_async_)
    own = torch.full((1, 4), float(r + 1))
    opt.step()
    check("DistributedOptimizer op=Sum", torch.allclose(model.weight.grad, hvd.allreduce(own, op=hvd.Sum)))

    refused("Adasum", lambda: hvd.allreduce(t, op=hvd.Adasum))
    refused("Max", lambda: hvd.allreduce(t, op=hvd.Max))
    refused("op and average", lambda: hvd.allreduce(t, average=True, op=hvd.Sum))
    refused("DistributedOptimizer Adasum", lambda: hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), op=hvd.Adasum))
    refused("broadcast root out of range", lambda: hvd.broadcast(t, root_rank=n))
    check("still running", torch.equal(hvd.allreduce(torch.tensor(1.0), op=hvd.Sum), torch.tensor(float(n))))
    hvd.shutdown()


if __name__ == "__main__":
    main()
