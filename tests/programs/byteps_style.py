"""A byteps user's script with only the import changed: the synthetic benchmark loop with
fp16 compression, an MNIST-style trainer (scikit-learn's digits) with DataLoader and
DistributedSampler that averages its metrics with push_pull, byteps' elastic suspend and
resume, and calls that must be refused while the job goes on. Prints one line per result
for the test to compare between workers.

    bpslaunch --local --num-workers 2 --num-servers 2 -- python byteps_style.py
"""
import timeit
import warnings

import torch
import torch.nn.functional as F
import torch.utils.data.distributed
from sklearn.datasets import load_digits

import adtopk_ps.torch as bps
from report import digest, say


def synthetic_benchmark():
    torch.manual_seed(10 + bps.rank())  # different weights on every worker until the broadcast
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                                torch.nn.Linear(8 * 14 * 14, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    optimizer = bps.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=bps.Compression.fp16)
    bps.broadcast_parameters(model.state_dict(), root_rank=0)
    bps.broadcast_optimizer_state(optimizer, root_rank=0)
    data = torch.rand(8, 3, 16, 16)
    target = torch.LongTensor(8).random_() % 10

    def benchmark_step():
        optimizer.zero_grad()
        F.cross_entropy(model(data), target).backward()
        optimizer.step()

    timeit.timeit(benchmark_step, number=2)  # warm-up
    c = bps.client()
    pushed, pulled = c.bytes_pushed, c.bytes_pulled
    seconds = timeit.timeit(benchmark_step, number=5)
    elements = sum(p.numel() for p in model.parameters())
    say(f"synthetic {8 * 5 / seconds:.1f} img/sec; per step {elements} elements, "
        f"{(c.bytes_pushed - pushed) // 5} bytes pushed, {(c.bytes_pulled - pulled) // 5} pulled; "
        f"params {digest(model.parameters())}")


def metric_average(val, name):
    tensor = torch.tensor(val)
    avg_tensor = bps.push_pull(tensor, name=name)
    return avg_tensor.item()


def mnist_style():
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16
    y = torch.tensor(digits.target)
    train = torch.utils.data.TensorDataset(x[:1500], y[:1500])
    test = torch.utils.data.TensorDataset(x[1500:], y[1500:])
    train_sampler = torch.utils.data.distributed.DistributedSampler(
        train, num_replicas=bps.size(), rank=bps.rank())
    train_loader = torch.utils.data.DataLoader(train, batch_size=50, sampler=train_sampler)
    test_sampler = torch.utils.data.distributed.DistributedSampler(
        test, num_replicas=bps.size(), rank=bps.rank())
    test_loader = torch.utils.data.DataLoader(test, batch_size=64, sampler=test_sampler)
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1 * bps.size(), momentum=0.5)
    bps.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = bps.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=bps.Compression.adtopk(ratio=0.25))
    for epoch in range(1, 4):
        model.train()
        train_sampler.set_epoch(epoch)
        for data, target in train_loader:
            optimizer.zero_grad()
            F.cross_entropy(model(data), target).backward()
            optimizer.step()
    model.eval()
    test_loss, test_accuracy, correct = 0.0, 0.0, 0
    with torch.no_grad():
        for data, target in test_loader:
            output = model(data)
            test_loss += F.cross_entropy(output, target, reduction="sum").item()
            hits = int(output.argmax(1).eq(target).sum())
            correct += hits
            test_accuracy += hits
    test_loss /= len(test_sampler)
    test_accuracy /= len(test_sampler)
    test_loss = metric_average(test_loss, "avg_loss")
    test_accuracy = metric_average(test_accuracy, "avg_accuracy")
    total = bps.push_pull(torch.tensor(correct), average=False, name="correct")
    say(f"mnist loss {test_loss:.6f} accuracy {test_accuracy:.6f} own {correct} "
        f"total {total.item()} {total.dtype}")


def suspend_and_resume():
    grad = torch.full((1000,), float(bps.rank() + 1))
    handle = bps.push_pull_async(grad, name="in-flight")
    bps.suspend()  # waits for the push_pull above
    assert bps.poll(handle)
    try:
        bps.push_pull(torch.ones(2), name="while-suspended")
        say("push_pull while suspended: not refused")
    except RuntimeError as exc:
        say(f"refused while suspended: {exc}")
    try:
        bps.resume(bps.size() + 1, 2)
        say("resume with another shape: not refused")
    except ValueError as exc:
        say(f"refused: {exc}")
    with warnings.catch_warnings(record=True) as caught:  # as byteps' elastic benchmark: rank 0
        warnings.simplefilter("always")                  # passed on every worker
        bps.resume(bps.size(), 2, 0)
    assert bps.rank() == 0 or "ranks stay as the scheduler gave them" in str(caught[0].message)
    mean = (bps.size() + 1) / 2
    assert torch.equal(bps.synchronize(handle), torch.full((1000,), mean))
    after = bps.push_pull(torch.tensor(float(bps.rank())), name="after-resume").item()
    say(f"resumed, in-flight average {mean}, next push_pull {after}")


def refused(call, what):
    try:
        call()
    except (ValueError, TypeError, RuntimeError, NotImplementedError) as exc:
        say(f"refused {what}: {type(exc).__name__}: {exc}")
        return
    say(f"NOT refused {what}")


def bad_input():
    bps.push_pull(torch.tensor(0.5), name="acc")
    refused(lambda: bps.push_pull(torch.tensor(1.0)), "unnamed push_pull")
    refused(lambda: bps.push_pull(torch.ones(3), name="x", compression=object()), "object compression")
    refused(lambda: bps.push_pull(torch.ones(3), name="x", compression="zip"), "zip compression")
    reused = bps.push_pull(torch.full((3,), float(bps.rank())), name="acc")  # another shape
    say(f"reused name with another shape {reused.tolist()}")
    refused(lambda: bps.push_pull(torch.ones(3, dtype=torch.complex64), name="c"), "complex tensor")
    refused(lambda: bps.synchronize(12345), "unknown handle")
    refused(lambda: bps.resume(bps.size(), 2), "resume without suspend")
    ok = bps.push_pull(torch.tensor(float(bps.rank())), name="still-running").item()
    say(f"after the refusals {ok}")


def main():
    bps.init()
    synthetic_benchmark()
    mnist_style()
    suspend_and_resume()
    bad_input()
    bps.shutdown()


if __name__ == "__main__":
    main()
