"""How evenly the servers share a step's pushes: the balanced placement against byteps' hash.

For VGG-16, ResNet-50 and BERT-base's parameters at S = 4, 8, 64 and 256 servers, one beside
each of as many workers, from the placement code itself (``adtopk_ps.cluster.placement``):
the keys each placement makes and the busiest server's bytes over the mean, push and
answer (``exchange_bytes``), ADTopk at the density for the tensors the default policy
sparsifies, dense for the rest. byteps' placement is its 4 MB partitions,
each on djb2 of its key modulo S. The last line is the balanced placement's worst ratio.

With ``--cluster W``, a real local cluster of W workers and W servers trains a small CNN
with ADTopk for three steps under each placement (``PS_PLACEMENT``), and the busiest
server's push and answer bytes over the mean are added up from every worker's ledger: with
a head of 100 classes (sparsified, as a large model's layers are), and of 10 (a dense head
that carries a tenth of the step's bytes in 10 rows, which no cut between rows can share
evenly).

    python benchmarks/placement.py [--ratio 0.01] [--servers 4 8 64 256]
    python benchmarks/placement.py --cluster 8
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from compression import GRADIENT_SETS  # noqa: E402

from adtopk_ps.cluster.membership import (DEFAULT_PARTITION_BYTES, make_key,  # noqa: E402
                                          partition_rows, server_of)
from adtopk_ps.cluster.placement import (Item, exchange_bytes, imbalance, loads, plan,  # noqa: E402
                                         push_bytes)
from adtopk_ps.compression.policy import SparsificationPolicy  # noqa: E402

MODELS = ("vgg16", "resnet50", "bert-base")
JOB = Path(__file__).resolve().parent.parent / "tests" / "programs" / "placement_check.py"
ELEMENT_SIZE = 4  # float32 gradients


def parameters(model: str) -> list[tuple[int, ...]]:
    """A model's weight shapes with one vector of ``shape[0]`` beside each (its bias or its
    norm's scale), which the policy sends dense."""
    weights = GRADIENT_SETS[model]()
    return [s for w in weights for s in (w, (w[0],))]


def items(shapes: list[tuple[int, ...]], ratio: float, workers: int | None = None) -> list[Item]:
    """Each tensor with the bytes it moves each step under the default policy at ``ratio``:
    its push, and with ``workers`` its answer too (``exchange_bytes``)."""
    policy = SparsificationPolicy(ratio=ratio)
    out = []
    for i, s in enumerate(shapes):
        sparse = not policy.is_dense(s, torch.float32)
        density = ratio if sparse else None
        weight = push_bytes(s, ELEMENT_SIZE, density) if workers is None else \
            exchange_bytes(s, ELEMENT_SIZE, density, workers)
        out.append(Item(i, s, ELEMENT_SIZE, weight, sparse))
    return out


def byteps(entries: list[Item], num_servers: int) -> tuple[int, float]:
    """byteps' placement: (keys, busiest over mean)."""
    weights, placed = {}, {}
    for item in entries:
        blocks = partition_rows(item.shape, item.element_size, DEFAULT_PARTITION_BYTES)
        count = item.rows[1]
        for index, (_, length) in enumerate(blocks):
            key = make_key(item.tensor_id, index)
            weights[key] = item.weight * length // count if count else 0
            placed[key] = server_of(key, num_servers)
    return len(weights), imbalance(loads(weights, placed, num_servers))


def balanced(entries: list[Item], num_servers: int) -> tuple[int, float]:
    """The balanced placement: (keys, busiest over mean)."""
    p = plan(entries, num_servers, DEFAULT_PARTITION_BYTES)
    return len(p.weights), imbalance(loads(p.weights, p.assign(num_servers), num_servers))


def shares(stdout: str) -> tuple[float, float, int]:
    """From a job's output (each worker's ``tally`` line): the busiest server's push and
    answer bytes over the mean, added up over every worker, and the servers that got any."""
    pushed: dict[str, int] = {}
    pulled: dict[str, int] = {}
    for line in stdout.splitlines():
        if "tally " in line:
            tally = json.loads(line.split("tally ", 1)[1])
            for server, size in tally["pushed"].items():
                pushed[server] = pushed.get(server, 0) + size
            for server, size in tally["pulled"].items():
                pulled[server] = pulled.get(server, 0) + size
    return imbalance(list(pushed.values())), imbalance(list(pulled.values())), len(pushed)


def cluster(workers: int, placement: str, classes: int = 100,
            timeout: float = 600) -> tuple[float, float, int]:
    """Run the small CNN's job, its head of ``classes``, on ``workers`` workers and as many
    servers under ``placement``."""
    out = subprocess.run([sys.executable, "-m", "adtopk_ps.launcher", "--local", "--num-workers",
                          str(workers), "--num-servers", str(workers), "--", sys.executable, str(JOB),
                          str(classes)],
                         env={**os.environ, "PS_PLACEMENT": placement}, capture_output=True,
                         text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"the {placement} job failed ({out.returncode}): {out.stdout[-2000:]}")
    return shares(out.stdout)


def main(argv: list[str] | None = None) -> float:
    """Print one line per model and S, and last the balanced placement's worst ratio."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ratio", type=float, default=0.01)
    parser.add_argument("--servers", type=int, nargs="+", default=[4, 8, 64, 256])
    parser.add_argument("--cluster", type=int, metavar="W",
                        help="also run a real job on W workers and W servers under each placement")
    args = parser.parse_args(argv)
    print(f"{'model':<10} {'S':>4} {'byteps keys':>11} {'busiest/mean':>12} "
          f"{'balanced keys':>13} {'busiest/mean':>12}")
    worst = 0.0
    for model in MODELS:
        for num_servers in args.servers:
            entries = items(parameters(model), args.ratio, num_servers)  # a server per worker
            bkeys, bratio = byteps(entries, num_servers)
            keys, ratio = balanced(entries, num_servers)
            worst = max(worst, ratio)
            print(f"{model:<10} {num_servers:>4} {bkeys:>11} {bratio:>11.2f}x {keys:>13} {ratio:>11.3f}x")
    if args.cluster:
        print(f"\nreal job, {args.cluster} workers x {args.cluster} servers, from the ledgers:")
        for classes in (100, 10):
            for placement in ("hash", "balanced"):
                pushed, pulled, used = cluster(args.cluster, placement, classes)
                print(f"head {classes:>3}, {placement:<8} pushes {pushed:.3f}x  answers "
                      f"{pulled:.3f}x  servers used {used} of {args.cluster}")
    print(f"worst balanced busiest/mean: {worst:.3f}x")
    return worst


if __name__ == "__main__":
    main()
