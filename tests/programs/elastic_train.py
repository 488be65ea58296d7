"""A horovod elastic script (only the import changed) that loses a worker mid-training.

Trains an MLP on scikit-learn's digits through ``hvd.elastic.run`` with a ``TorchState``
committed every step and an ``ElasticSampler``. ``--kill W:S`` (repeatable): the worker
started as ``DMLC_WORKER_ID`` W kills itself with SIGKILL at step S, ``--when``: before its
push, between its push and the answers (with overlap), in the middle of the commit after
step S (the model copied, the rest not), or at start-up, before the optimizer's agreement
(S ignored). ``--pause W:S``: that worker stops itself (SIGSTOP) for
``--pause-s`` seconds at step S. ``--slow S:SECONDS``: every worker not killed sleeps that
long in step S's backward pass, between the two layers' gradients (so that a re-form lands
in the middle of it). ``--wrapper``: the optimizer (default), byteps' DDP wrapper, or
CrossBarrier. Every survivor prints one line a step (``step N``), the
time it took up training again after a re-form (``resumed in S s``), and at the end its step
count and a digest of its parameters. A worker that joins the running job (``bpslaunch
--restarts``) says so with the time it registered, and kills or pauses itself no more
(``--kill-joiner``: the first joiner dies as it joins; ``--joiner-sleep-s``: each sleeps
that long before its first step). ``--joins FILE:N``: every joiner adds
a line to FILE as it joins, and no worker takes the last step before FILE has N: a job that
lasts until its restarts have joined, however long they take to start.
"""
import argparse
import copy
import hashlib
import os
import signal
import subprocess
import sys
import time

import torch
from sklearn.datasets import load_digits

import adtopk_ps.torch as hvd
from adtopk_ps.torch.cross_barrier import CrossBarrier
from adtopk_ps.torch.parallel import DistributedDataParallel


class MLP(torch.nn.Module):
    """Two layers; ``pause`` seconds of sleep between their gradients in the next backward."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(64, 128), torch.nn.Linear(128, 10)
        self.pause = 0.0

    def forward(self, x):
        hidden = torch.relu(self.fc1(x))
        if self.pause and hidden.requires_grad:
            pause, self.pause = self.pause, 0.0
            hidden.register_hook(lambda grad: (time.sleep(pause), grad)[1])
        return self.fc2(hidden)


def _lines(path: str) -> int:
    if not os.path.exists(path):
        return 0
    with open(path) as text:
        return len(text.read().split())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--kill", action="append", default=[], help="worker:step")
    ap.add_argument("--when", choices=["before-push", "mid-push", "mid-commit", "start-up"], default="before-push")
    ap.add_argument("--pause", default="", help="worker:step")
    ap.add_argument("--pause-s", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0, help="the model's initialisation and the data order")
    ap.add_argument("--slow", default="", help="step:seconds")
    ap.add_argument("--joiner-sleep-s", type=float, default=0.0, help="a joiner sleeps this "
                    "long after init(), before anything else (a slow data loader)")
    ap.add_argument("--kill-joiner", default="", help="a joiner kills itself before its "
                    "optimizer's agreement unless this file exists (it makes it first)")
    ap.add_argument("--step-s", type=float, default=0.0, help="every step sleeps this long (a "
                    "job that lasts until a restarted worker joins)")
    ap.add_argument("--joins", default="", help="FILE:N: joiners add a line to FILE, and the "
                    "last step waits for N")
    ap.add_argument("--wrapper", choices=["optimizer", "ddp", "crossbarrier"], default="optimizer")
    args = ap.parse_args()
    # torch's first optimizer imports torch._dynamo (seconds on a loaded machine): done before
    # registering, so that a kill at start-up is timed against the re-form, not that import
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.0)
    registering = time.time()
    hvd.init()
    started_as = int(os.environ.get("DMLC_WORKER_ID", hvd.rank()))
    joined = hvd.client().epoch > 0
    joins, awaited = (args.joins.rsplit(":", 1)[0], int(args.joins.rsplit(":", 1)[1])) \
        if args.joins else ("", 0)
    if joined:
        print(f"worker {hvd.rank()}: joined the running job (epoch {hvd.client().epoch}), "
              f"registering at {registering:.3f}", flush=True)
        if joins:
            with open(joins, "a") as out:
                out.write(f"{os.getpid()}\n")

    def await_joins() -> None:
        while joins and _lines(joins) < awaited:
            time.sleep(0.05)
    kill_at = {int(w): int(s) for w, s in (k.split(":") for k in args.kill)}.get(started_as, -1)
    pause_at = int(args.pause.split(":")[1]) if args.pause and \
        int(args.pause.split(":")[0]) == started_as else -1
    if joined:
        kill_at = pause_at = -1
        if args.joiner_sleep_s:
            print(f"worker {hvd.rank()}: sleeping {args.joiner_sleep_s} s before its first step",
                  flush=True)
            time.sleep(args.joiner_sleep_s)
        if args.kill_joiner and not os.path.exists(args.kill_joiner):
            open(args.kill_joiner, "w").close()
            print(f"worker {hvd.rank()}: killed as it joins at {time.time():.3f}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    def die(steps_done: int) -> None:
        print(f"worker {started_as}: killed after step {steps_done} at {time.time():.3f}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    if kill_at >= 0 and args.when == "start-up":
        die(0)
    torch.manual_seed(args.seed)
    digits = load_digits()
    data = torch.utils.data.TensorDataset(torch.tensor(digits.data, dtype=torch.float32) / 16,
                                          torch.tensor(digits.target))
    net = MLP()
    slow_at, slow_s = (int(args.slow.split(":")[0]), float(args.slow.split(":")[1])) \
        if args.slow and kill_at < 0 else (-1, 0.0)
    compression = hvd.Compression.adtopk(ratio=0.05)
    sgd = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    model = net
    if args.wrapper == "optimizer":
        optimizer = hvd.DistributedOptimizer(sgd, net.named_parameters(), compression=compression,
                                             overlap=args.when == "mid-push")
    elif args.wrapper == "ddp":
        model, optimizer = DistributedDataParallel(net, compression=compression), sgd
    else:
        optimizer = CrossBarrier(net, sgd, net.named_parameters(), compression=compression)
    sampler = hvd.elastic.ElasticSampler(data, shuffle=True, seed=args.seed)
    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, sampler=sampler,
                                   epoch=0, batch=0, step=0, seen={}, commits=0)
    lost_at, slowed = [], []
    state.register_reset_callbacks([lambda: lost_at.append(time.time())])
    if kill_at >= 0 and args.when == "mid-commit":
        commit_in_full = state.save

        def save_in_part() -> None:
            if state.step == kill_at:
                copy.deepcopy(model.state_dict())  # the commit's first part; the rest never comes
                die(state.step)
            commit_in_full()
        state.save = save_in_part

    @hvd.elastic.run
    def train(state):
        while state.step < args.steps:
            loader = torch.utils.data.DataLoader(data, batch_size=16, sampler=sampler)
            for state.batch, (x, y) in enumerate(loader):
                if state.step >= args.steps:
                    break
                if state.step == kill_at and args.when == "before-push":
                    die(state.step)
                if state.step == args.steps - 1:
                    await_joins()
                if state.step == pause_at:
                    subprocess.Popen(["sh", "-c", f"sleep {args.pause_s}; kill -CONT {os.getpid()}"])
                    print(f"worker {started_as}: pausing for {args.pause_s} s", flush=True)
                    os.kill(os.getpid(), signal.SIGSTOP)
                optimizer.zero_grad()
                time.sleep(args.step_s)
                if state.step == slow_at and not slowed:  # once: not again when the step is redone
                    slowed.append(state.step)
                    net.pause = slow_s
                torch.nn.functional.cross_entropy(model(x), y).backward()
                if state.step == kill_at and args.when == "mid-push":
                    time.sleep(0.05)  # with overlap, the pushes have left; the answers have not
                    die(state.step)
                optimizer.step()
                sampler.record_batch(state.batch, len(x))
                state.seen[state.epoch] = state.seen.get(state.epoch, 0) + len(x) * hvd.size()
                state.step += 1
                if lost_at:
                    print(f"worker {hvd.rank()}: resumed in {time.time() - lost_at[-1]:.3f} s "
                          f"at {time.time():.3f}", flush=True)
                    lost_at.clear()
                print(f"worker {hvd.rank()}: step {state.step} of {hvd.size()} at {time.time():.3f}",
                      flush=True)
                state.commits += 1  # a name of the user's (horovod's own elastic test keeps one)
                state.commit()
            else:
                state.epoch += 1
                state.batch = 0
                sampler.set_epoch(state.epoch)
                state.commits += 1
                state.commit()

    train(state)
    if args.wrapper == "crossbarrier":
        optimizer.synchronize()  # the last step's updates
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters()))
    with torch.no_grad():  # on every digit: a figure to set runs against each other, not a test score
        x, y = data.tensors
        accuracy = (model(x).argmax(1) == y).float().mean().item()
    epochs_ended = state.epoch  # one commit each, besides one a step
    assert state.commits == state.step + epochs_ended, (state.commits, state.step, epochs_ended)
    print(f"worker {hvd.rank()}: done step={state.step} size={hvd.size()} "
          f"digest={digest.hexdigest()[:16]} accuracy={accuracy:.4f} seen={sorted(state.seen.items())}",
          flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    sys.exit(main())
