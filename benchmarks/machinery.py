"""What the parameter server's machinery costs a worker each step, against one read of the gradient.

One process, one thread, float32 CPU gradients of VGG-16 and BERT-base (their real
parameter shapes, biases and norms included, random normal values). Each repeat times,
in CPU seconds (a shared machine's waits for a core are not the machinery's), per
element of the gradient set, the parts a worker does every step:

- **read-once**: one ``sum()`` over every gradient, the yardstick;
- **compress+ef**: ADTopk at density 0.01 with error feedback, through the path the
  training takes: the sparsification policy's routes (tensors under
  ``BYTEPS_MIN_COMPRESS_BYTES`` dense), the client's partitions (``KeyLayout``) and one
  ``start_each`` over every key, as the engine's ``_send_jobs`` calls it;
- **encode**: ``wire.encode`` of each key's push;
- **decode+restore**: ``wire.decode``, ``write_into`` (averaged) and the compressor's
  ``restore`` of each key's answer, the answers shaped as a server sends them when
  W = 8 workers push: the server's own aggregator sums 8 independent selections per key
  and the answer is encoded as the server encodes it, then received through a zmq socket;
- **engine**: the rest of a real step: a :class:`PSClient` pushes the whole set to a real
  server over loopback (1 worker, 1 server: scheduler and server are subprocesses); the
  client process's CPU time for the step (every thread: the caller's, the engine's, zmq's),
  less its compression (its compressors' calls, timed on the engine thread) and the
  encode and decode of that step's pushes and answers, timed here on the same payloads.

The parts of one repeat run back to back, their order rotating from repeat to repeat; each
ratio is a part's time over the read-once of the same repeat. Lines give the median over
repeats and, in brackets, the repeats' [min, max] (with 7 repeats the median lies within
it with 98% confidence, with 5 with 94%). The last line is the whole machinery, both models together,
over the read-once.

    python benchmarks/machinery.py                  # VGG-16 and BERT-base, 7 repeats
    python benchmarks/machinery.py --repeats 9 --models vgg16
    python benchmarks/machinery.py --quick          # small stand-ins, for a smoke test
"""
from __future__ import annotations

import argparse
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import zmq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from adtopk_ps import wire  # noqa: E402
from adtopk_ps.client.ps_client import PSClient  # noqa: E402
from adtopk_ps.cluster.membership import (DEFAULT_PARTITION_BYTES, ClusterConfig, make_key,  # noqa: E402
                                          part_name, partition_rows, split)
from adtopk_ps.compression import (ADTopk, Compressor, Dense, Request, SparsificationPolicy,  # noqa: E402
                                   create, start_each)
from adtopk_ps.core.payload import Payload  # noqa: E402
from adtopk_ps.launcher import free_port  # noqa: E402
from adtopk_ps.wire import Op  # noqa: E402
from server.aggregator import Aggregator  # noqa: E402

DENSITY = 0.01
PARTS = ("compress+ef", "encode", "decode+restore", "engine")


def vgg16(width: int = 64, hidden: int = 4096, classes: int = 1000, side: int = 7) -> list[tuple[int, ...]]:
    """VGG-16's parameter shapes (torchvision's ``vgg16``): 13 convolutions with their biases,
    then three Linear layers; smaller ``width``/``hidden`` give a stand-in of the same form."""
    shapes: list[tuple[int, ...]] = []
    cin = 3
    for mult in (1, 1, 2, 2, 4, 4, 4, 8, 8, 8, 8, 8, 8):
        shapes += [(width * mult, cin, 3, 3), (width * mult,)]
        cin = width * mult
    for fan_in, out in ((cin * side * side, hidden), (hidden, hidden), (hidden, classes)):
        shapes += [(out, fan_in), (out,)]
    return shapes


def bert_base(hidden: int = 768, layers: int = 12, vocab: int = 30522,
              positions: int = 512) -> list[tuple[int, ...]]:
    """BERT-base's parameter shapes (Hugging Face's ``BertModel`` with its pooler): the
    embeddings and their norm, then per layer the attention's four projections, the
    feed-forward pair and two norms, with every bias."""
    inner = 4 * hidden
    shapes: list[tuple[int, ...]] = [(vocab, hidden), (positions, hidden), (2, hidden), (hidden,), (hidden,)]
    for _ in range(layers):
        shapes += [(hidden, hidden), (hidden,)] * 4 + [(hidden,), (hidden,)]
        shapes += [(inner, hidden), (inner,), (hidden, inner), (hidden,), (hidden,), (hidden,)]
    return shapes + [(hidden, hidden), (hidden,)]


MODELS: dict[str, Callable[[], list[tuple[int, ...]]]] = {"vgg16": vgg16, "bert-base": bert_base}
QUICK: dict[str, Callable[[], list[tuple[int, ...]]]] = {
    "vgg16": lambda: vgg16(width=8, hidden=512, classes=100, side=4),
    "bert-base": lambda: bert_base(hidden=128, layers=2, vocab=4000, positions=128),
}


@dataclass
class Key:
    """One partition as the client cuts it: its key, its slices of the gradient and of the
    answer's buffer, the compressor it goes to and the request it makes."""

    key: int
    grad: torch.Tensor
    out: torch.Tensor
    compressor: Compressor
    request: Request


@dataclass
class GradientSet:
    """A model's gradients cut into keys, with the answers a server sends for them."""

    name: str
    grads: list[torch.Tensor]
    keys: list[Key]
    answers: list[list] = field(default_factory=list)  # received frames, by key (W workers)
    elements: int = 0


def gradient_set(name: str, shapes: list[tuple[int, ...]], seed: int = 0) -> GradientSet:
    """Random normal gradients of ``shapes``, routed by the default policy and cut into the
    client's partitions, each sparse one with ADTopk and error feedback."""
    gen = torch.Generator().manual_seed(seed)
    grads = [torch.randn(s, generator=gen) for s in shapes]
    policy, sparse, dense = SparsificationPolicy(DENSITY), create("adtopk", ratio=DENSITY, ef="vanilla"), Dense()
    keys = []
    for i, g in enumerate(grads):
        route = policy.route(g)
        blocks = partition_rows(tuple(g.shape), g.element_size(), DEFAULT_PARTITION_BYTES)
        out = torch.empty_like(g)
        for j, (part, dst) in enumerate(zip(split(g, blocks), split(out, blocks))):
            comp = dense if route.dense else sparse
            ratio = None if route.dense else route.ratio
            keys.append(Key(make_key(i, j), part, dst, comp, Request(part, part_name(f"{name}.{i}", j), 0, ratio)))
    return GradientSet(name, grads, keys, elements=sum(g.numel() for g in grads))


def received(frames_by_key: list[list]) -> list[list]:
    """Each message as the engine receives it: through a zmq socket, frames not copied."""
    ctx = zmq.Context.instance()
    out, inn = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    address = f"inproc://machinery-{id(frames_by_key)}"
    out.bind(address)
    inn.connect(address)
    got = []
    for frames in frames_by_key:
        out.send_multipart(frames, copy=False)
        got.append(inn.recv_multipart(copy=False))
    out.close(0)
    inn.close(0)
    return got


def server_answers(gs: GradientSet, workers: int, seed: int = 1) -> list[list]:
    """Each key's answer when ``workers`` workers push it: their selections of independent
    random normal gradients (the first step's, residuals zero) summed by the server's
    aggregator, encoded as the server encodes a result, and received."""
    gen = torch.Generator().manual_seed(seed)
    frames = []
    for k in gs.keys:
        agg, answer = Aggregator(workers), None
        selector = ADTopk(ratio=DENSITY) if k.compressor.sparse else Dense()
        for w in range(workers):
            payload = selector.compress(torch.randn(k.grad.shape, generator=gen), k.request.name, 0,
                                        k.request.ratio)
            answer = agg.push(k.key, 0, w, payload)
        frames.append(wire.encode(Op.RESULT, key=k.key, round=0, payload=answer))
    return received(frames)


def compress(gs: GradientSet) -> list[Payload]:
    """Every key's payload, the compressors handed their keys in one call (as the engine)."""
    return list(start_each([(k.compressor, k.request) for k in gs.keys]))


def encode(gs: GradientSet, payloads: list[Payload]) -> list[list]:
    return [wire.encode(Op.PUSH, key=k.key, round=0, sender=0, payload=p)
            for k, p in zip(gs.keys, payloads)]


def decode(gs: GradientSet, answers: list[list], divisor: int) -> None:
    for k, frames in zip(gs.keys, answers):
        msg = wire.decode(frames)
        msg.payload.write_into(k.out, divisor)
        k.compressor.restore(k.out, k.request.name)


def read_once(gs: GradientSet) -> float:
    return sum(float(g.sum()) for g in gs.grads)


def timed(call: Callable[[], object]) -> float:
    """CPU seconds of ``call`` on this thread: on a shared machine, time the thread waited for
    a core is not the machinery's."""
    started = time.thread_time()
    call()
    return time.thread_time() - started


class Cluster:
    """A scheduler and one server, subprocesses over loopback, and this process's client."""

    def __init__(self) -> None:
        env = {**os.environ, "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": str(free_port()),
               "DMLC_NUM_WORKER": "1", "DMLC_NUM_SERVER": "1", "DMLC_NODE_HOST": "127.0.0.1",
               "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
               "PS_HEARTBEAT_TIMEOUT_MS": "600000"}  # building a gradient set holds the GIL for seconds
        self.procs = [subprocess.Popen([sys.executable, "-m", module], env={**env, "DMLC_ROLE": role},
                                       start_new_session=True, stdout=subprocess.DEVNULL,
                                       stderr=subprocess.DEVNULL, cwd=ROOT)
                      for module, role in (("adtopk_ps.cluster.scheduler", "scheduler"), ("server", "server"))]
        try:
            self.client = PSClient(ClusterConfig.from_env({**env, "DMLC_ROLE": "worker"}))
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if hasattr(self, "client"):
            self.client.shutdown()
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)


class CpuTimed(Compressor):
    """A compressor that counts the CPU seconds its calls take on the thread that makes them
    (the engine's), so that the engine's step can be told apart from its compression."""

    def __init__(self, inner: Compressor):
        super().__init__(inner.ratio)
        self.inner, self.name, self.sparse, self.seconds = inner, inner.name, inner.sparse, 0.0

    def compress(self, tensor: torch.Tensor, name: str, step: int = 0, ratio: float | None = None) -> Payload:
        return next(self.start([Request(tensor, name, step, ratio)]))

    def start(self, requests: list[Request]):
        started = time.thread_time()
        payloads = self.inner.start(requests)
        self.seconds += time.thread_time() - started
        return self._each(payloads)

    def _each(self, payloads):
        while True:
            started = time.thread_time()
            payload = next(payloads, None)
            self.seconds += time.thread_time() - started
            if payload is None:
                return
            yield payload

    def restore(self, answer: torch.Tensor, name: str) -> None:
        self.inner.restore(answer, name)


class EngineStep:
    """One real step of a gradient set through the cluster's client, and its CPU seconds."""

    def __init__(self, cluster: Cluster, gs: GradientSet):
        self.client, self.gs = cluster.client, gs
        policy = SparsificationPolicy(DENSITY)
        self.sparse = CpuTimed(create("adtopk", ratio=DENSITY, ef="vanilla"))
        self.dense = CpuTimed(Dense())
        self.routes = [(f"{gs.name}.{i}", g, self.dense if policy.route(g).dense else self.sparse,
                        policy.route(g).ratio) for i, g in enumerate(gs.grads)]
        self.outs = [torch.empty_like(g) for g in gs.grads]
        payloads = compress(gs)  # what one worker's step pushes and gets back (W = 1)
        self.pushes = payloads
        self.answers = received([wire.encode(Op.RESULT, key=k.key, payload=Aggregator(1).push(k.key, 0, 0, p))
                                 for k, p in zip(gs.keys, payloads)])
        self.run()  # declares every key; the server allocates its buffers

    def run(self) -> tuple[float, float]:
        """The step's CPU seconds in this process (every thread), and its compression's."""
        before, compressed = time.process_time(), self.sparse.seconds + self.dense.seconds
        handles = [self.client.push_pull(g, name, comp, ratio=None if comp is self.dense else ratio, out=out)
                   for (name, g, comp, ratio), out in zip(reversed(self.routes), reversed(self.outs))]
        for h in handles:
            h.wait()
        return time.process_time() - before, self.sparse.seconds + self.dense.seconds - compressed

    def python(self) -> float:
        """The step's CPU seconds less what the other parts count: compression (counted on the
        engine thread), and the encode and decode of its pushes and answers, timed here."""
        cpu, compressed = self.run()
        coding = timed(lambda: encode(self.gs, self.pushes)) + timed(lambda: decode(self.gs, self.answers, 1))
        return cpu - compressed - coding


def measure(gs: GradientSet, step: EngineStep | None, repeats: int, workers: int) -> dict[str, list[float]]:
    """Seconds of each part in every repeat, the parts' order rotating between repeats."""
    payloads: list[Payload] = compress(gs)  # the first step's payloads, for encode
    calls: dict[str, Callable[[], float]] = {
        "read-once": lambda: timed(lambda: read_once(gs)),
        "compress+ef": lambda: timed(lambda: compress(gs)),
        "encode": lambda: timed(lambda: encode(gs, payloads)),
        "decode+restore": lambda: timed(lambda: decode(gs, gs.answers, workers)),
    }
    if step is not None:
        calls["engine"] = step.python
    names = list(calls)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        for n in names[r % len(names):] + names[:r % len(names)]:
            times[n].append(calls[n]())
    return times


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} [{min(values):.3f}, {max(values):.3f}]"


def report(gs: GradientSet, times: dict[str, list[float]]) -> list[str]:
    """One line a part: ns per element and the ratio to the same repeat's read-once."""
    read, n = times["read-once"], gs.elements
    sparse = sum(1 for k in gs.keys if k.compressor.sparse)
    lines = [f"{gs.name} read-once: {spread([t / n * 1e9 for t in read])} ns/element "
             f"({n} elements, {len(gs.keys)} keys, {sparse} sparse)"]
    whole = [0.0] * len(read)
    for part in PARTS:
        if part not in times:
            continue
        whole = [w + t for w, t in zip(whole, times[part])]
        per_key = f", {statistics.median(times[part]) / len(gs.keys) * 1e6:.0f} us/key" if part == "engine" else ""
        lines.append(f"{gs.name} {part}: {spread([t / n * 1e9 for t in times[part]])} ns/element, "
                     f"{spread([t / r for t, r in zip(times[part], read)])}x read-once{per_key}")
    lines.append(f"{gs.name} machinery: {spread([t / n * 1e9 for t in whole])} ns/element, "
                 f"{spread([t / r for t, r in zip(whole, read)])}x read-once")
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--repeats", type=int, default=None, help="repeats of every part (default 7; 3 with --quick)")
    ap.add_argument("--workers", type=int, default=8, help="workers whose selections the answers unite")
    ap.add_argument("--quick", action="store_true", help="small stand-ins of the models (a smoke test)")
    ap.add_argument("--no-engine", action="store_true", help="leave out the engine (no cluster is started)")
    args = ap.parse_args(argv)
    repeats = args.repeats or (3 if args.quick else 7)
    torch.set_num_threads(1)
    shapes = QUICK if args.quick else MODELS
    print(f"# machinery per step: 1 thread, ADTopk at {DENSITY} with error feedback, answers of "
          f"W = {args.workers}, {repeats} repeats (median [min, max])", flush=True)
    cluster = None if args.no_engine else Cluster()
    totals: dict[str, list[float]] = {"read-once": [0.0] * repeats, "machinery": [0.0] * repeats}
    try:
        for name in args.models:
            gs = gradient_set(name, shapes[name]())
            gs.answers = server_answers(gs, args.workers)
            step = EngineStep(cluster, gs) if cluster is not None else None
            times = measure(gs, step, repeats, args.workers)
            for line in report(gs, times):
                print(line, flush=True)
            totals["read-once"] = [a + b for a, b in zip(totals["read-once"], times["read-once"])]
            for part in PARTS:
                if part in times:
                    totals["machinery"] = [a + b for a, b in zip(totals["machinery"], times[part])]
            del gs, step, times
    finally:
        if cluster is not None:
            cluster.close()
    ratios = [m / r for m, r in zip(totals["machinery"], totals["read-once"])]
    print(f"machinery ({', '.join(args.models)}): {spread(ratios)}x read-once")


if __name__ == "__main__":
    main()
