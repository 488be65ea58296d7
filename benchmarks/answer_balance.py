"""Would weighing keys by the answers a job measured balance the servers' answers better than
the placement's estimate? Measured on real gradients before anything is built.

The placement (``adtopk_ps/cluster/placement.py``) weighs each sparse row by its push and its
answer, the answer's width estimated as if the workers chose independently
(``exchange_bytes``). Gradients of one model on different batches agree on much of what is
large (``union_density.py``), and by how much differs from layer to layer, so the servers
that hold the layers where they agree most get less of the answers than the plan expects.

This takes one config's model and data, trains it with plain SGD to two points (as
``union_density.py`` does), and at each takes W gradients on W batches, as W workers would
push them. For every tensor the job sparsifies it selects with ADTopk (no error feedback) and
counts, row by row, the union of the W selections: a row's answer bytes, as the plan's own
model prices them (a value and a position per entry, no more than the dense row). Then, with
one server per worker (S = W), it cuts the sparse tensors twice, as the planner does: by the
estimate, and by the answers measured at the first point, and prints the busiest server's
answer bytes over the mean for each plan against the answers at the second point (a later
step, which neither plan has seen). The dense tensors are left out: their answers are their
pushes, which the plan prices exactly.

    python benchmarks/answer_balance.py                                   # both configs below
    python benchmarks/answer_balance.py --configs configs/fashion-cnn.yaml --workers 8 --at 0 300
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from adtopk_ps.cluster.membership import DEFAULT_PARTITION_BYTES, make_key  # noqa: E402
from adtopk_ps.cluster.placement import Item, exchange_bytes, imbalance, plan, push_bytes  # noqa: E402
from adtopk_ps.compression import create  # noqa: E402
from adtopk_ps.core.dtypes import index_dtype  # noqa: E402
from union_density import trained_gradients  # noqa: E402

CONFIGS = [ROOT / "configs" / "fashion-cnn.yaml", ROOT / "configs" / "pysource-transformer.yaml"]
ELEMENT_SIZE = 4  # float32 gradients


def row_answers(grads: list[dict[str, torch.Tensor]], density: float) -> dict[str, torch.Tensor]:
    """Each tensor's answer bytes row by row (axis-0 slices): the union of the workers'
    ADTopk selections, priced as ``exchange_bytes`` prices it."""
    adtopk = create({"compressor": "adtopk", "k": density})
    out = {}
    for name, first in grads[0].items():
        shape = tuple(first.shape)
        covered = torch.zeros(first.numel(), dtype=torch.bool)
        for g in grads:
            covered[adtopk.compress(g[name], name).flat_positions()] = True
        per_row = covered.view(shape[0], -1).sum(1).double()
        entry = ELEMENT_SIZE + index_dtype(shape[1]).itemsize
        out[name] = per_row.mul(entry).clamp(max=float(first.numel() // shape[0] * ELEMENT_SIZE))
    return out


def answer_shares(cut, names: list[str], answers: dict[str, torch.Tensor], servers: int) -> list[float]:
    """Each server's answer bytes under the plan ``cut``, the answers being ``answers``."""
    placed = cut.assign(servers)
    held = [0.0] * servers
    for tensor_id, name in enumerate(names):
        for index, (start, length) in enumerate(cut.blocks[tensor_id]):
            held[placed[make_key(tensor_id, index)]] += float(answers[name][start:start + length].sum())
    return held


def compare(shapes: dict[str, tuple[int, ...]], seen: dict[str, torch.Tensor],
            later: dict[str, torch.Tensor], workers: int, density: float) -> tuple[float, float, int, int]:
    """(estimate plan's busiest/mean, measured plan's busiest/mean, their keys) on ``later``."""
    names = list(shapes)
    estimated = [Item(i, shapes[n], ELEMENT_SIZE, exchange_bytes(shapes[n], ELEMENT_SIZE, density, workers), True)
                 for i, n in enumerate(names)]
    measured = [Item(i, shapes[n], ELEMENT_SIZE,
                     push_bytes(shapes[n], ELEMENT_SIZE, density) + int(seen[n].sum()), True)
                for i, n in enumerate(names)]
    by_estimate = plan(estimated, workers, DEFAULT_PARTITION_BYTES)
    by_measure = plan(measured, workers, DEFAULT_PARTITION_BYTES)
    return (imbalance(answer_shares(by_estimate, names, later, workers)),
            imbalance(answer_shares(by_measure, names, later, workers)),
            len(by_estimate.weights), len(by_measure.weights))


def main(argv: list[str] | None = None) -> float:
    """Print each tensor's measured answer over the estimate, then one line per config and W;
    returns the measured plan's worst ratio."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", nargs="+", default=[str(c) for c in CONFIGS])
    ap.add_argument("--workers", type=int, nargs="+", default=[8, 16, 64])
    ap.add_argument("--at", type=int, nargs=2, default=[0, 300],
                    help="the step whose answers the measured plan weighs by, and a later one")
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    worst = 0.0
    for config in args.configs:
        points = dict(trained_gradients(Path(config), list(args.at), max(args.workers), args.seed))
        seen_at, later_at = args.at
        shapes = {n: tuple(g.shape) for n, g in points[seen_at][0].items()}
        for workers in args.workers:
            seen = row_answers(points[seen_at][:workers], args.density)
            later = row_answers(points[later_at][:workers], args.density)
            for name, shape in shapes.items():
                guess = exchange_bytes(shape, ELEMENT_SIZE, args.density, workers) - \
                    push_bytes(shape, ELEMENT_SIZE, args.density)
                print(f"  W={workers:<3} {name:<28} {str(shape):<18} measured answer / estimate: "
                      f"step {seen_at} {float(seen[name].sum()) / guess:.2f}, "
                      f"step {later_at} {float(later[name].sum()) / guess:.2f}")
            by_estimate, by_measure, keys, measured_keys = compare(shapes, seen, later, workers, args.density)
            worst = max(worst, by_measure)
            print(f"{Path(config).stem} W=S={workers}: busiest server's answers over the mean at step "
                  f"{later_at}: estimate plan {by_estimate:.3f}x ({keys} keys), plan weighed by step "
                  f"{seen_at}'s answers {by_measure:.3f}x ({measured_keys} keys)", flush=True)
    print(f"worst measured-plan busiest/mean: {worst:.3f}x")
    return worst


if __name__ == "__main__":
    main()
