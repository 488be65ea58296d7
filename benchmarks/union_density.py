"""The density of a server's answer as workers are added: the union of W workers' selections.

A parameter server answers each round with the sum of the workers' sparse pushes, whose
positions are the union of their selections. Were the selections independent, the union
would cover 1-(1-d)^W of a tensor (47% at W=64, d=0.01); gradients of one model on
different batches agree on much of what is large, so it grows more slowly. This measures it
on real gradients without a cluster: one process trains the Fashion-MNIST CNN of
configs/fashion-cnn.yaml (plain SGD) to a few points, and at each takes W gradients on W
different batches, as W workers would push them, and selects with each compressor.

Only the tensors the job sparsifies count (its partial-sparsification policy's: those of at
least ``min_compress_bytes``, biases and norms aside). A
fresh selection per gradient, without error feedback: the residuals a worker keeps add
positions of their own, so with feedback the union is, if anything, wider.

    python benchmarks/union_density.py                          # W up to 256, 3 points
    python benchmarks/union_density.py --workers 2 8 64 --at 0 300
    python benchmarks/union_density.py --json docs/scale-runs/union.json   # for the step model

--json writes the last point's unions, {density: {compressor: {W: union}}}: the curve along
which the scale study's step model (benchmarks/step_model.py) grows an answer beyond the
workers it ran.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
import yaml

from adtopk_ps.compression import SparsificationPolicy, create
from worker.data import load
from worker.models import build

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "fashion-cnn.yaml"


def gradients(model: torch.nn.Module, data, batches: int, batch_size: int, seed: int,
              names: list[str]) -> list[dict[str, torch.Tensor]]:
    """``batches`` gradients of the model as it is, each on its own random batch."""
    params = dict(model.named_parameters())
    rng = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(batches):
        picked = torch.randint(len(data.x_train), (batch_size,), generator=rng)
        model.zero_grad(set_to_none=True)
        loss(model, data.x_train[picked], data.y_train[picked]).backward()
        out.append({n: params[n].grad.detach().clone() for n in names})
    return out


def trained_gradients(config: Path, at: list[int], batches: int, seed: int
                      ) -> Iterator[tuple[int, list[dict[str, torch.Tensor]]]]:
    """(step, ``batches`` gradients of the tensors the job sparsifies) at each step of ``at``:
    the config's model trained with plain SGD (its learning rate, momentum 0.9, its batch size)
    on the config's data, each gradient on a random batch of its own."""
    cfg = yaml.safe_load(config.read_text())
    torch.manual_seed(seed)
    data = load(cfg["dataset"], seed, cfg.get("dataset_args"))
    model = build(cfg["model"], cfg["model_args"])
    names = sparsified(cfg, model)
    print(f"{cfg['model']} {cfg['model_args']} on {cfg['dataset']}: sparsified tensors "
          f"{', '.join(names)} ({sum(dict(model.named_parameters())[n].numel() for n in names)} "
          f"elements)", flush=True)
    opt = torch.optim.SGD(model.parameters(), lr=cfg["optimizer"]["lr"], momentum=0.9)
    done, rng = 0, torch.Generator().manual_seed(seed + 1)
    for point in sorted(at):
        while done < point:
            picked = torch.randint(len(data.x_train), (cfg["batch_size"],), generator=rng)
            opt.zero_grad()
            loss(model, data.x_train[picked], data.y_train[picked]).backward()
            opt.step()
            done += 1
        yield point, gradients(model, data, batches, cfg["batch_size"], seed + point, names)


def sparsified(cfg: dict, model: torch.nn.Module) -> list[str]:
    """The names of ``model``'s tensors that the job of ``cfg`` sparsifies (its
    partial-sparsification policy: biases, norms and small tensors travel dense)."""
    policy = SparsificationPolicy(0.01, min_compress_bytes=cfg.get("min_compress_bytes", 65536))
    routes = policy.plan(model.named_parameters())
    return [n for n, _ in model.named_parameters() if not routes[n].dense]


def loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over the classes, or over every position of a language model's output."""
    logits = model(x)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def union_density(grads: list[dict[str, torch.Tensor]], spec: dict, workers: list[int]) -> dict:
    """For each W: the union of the first W selections, over the tensors' elements, and the
    selections' own mean density (what one worker sends)."""
    compressor = create(spec)
    names = list(grads[0])
    sizes = {n: grads[0][n].numel() for n in names}
    picked = [{n: compressor.compress(g[n], n).flat_positions() for n in names} for g in grads]
    own = sum(p[n].numel() for p in picked for n in names) / (len(picked) * sum(sizes.values()))
    found = {}
    for w in workers:
        covered = 0
        for n in names:
            mask = torch.zeros(sizes[n], dtype=torch.bool)
            for p in picked[:w]:
                mask[p[n]] = True
            covered += int(mask.sum())
        found[w] = covered / sum(sizes.values())
    return {"own": own, "union": found}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, nargs="+", default=[2, 4, 8, 16, 32, 64, 128, 256])
    ap.add_argument("--at", type=int, nargs="+", default=[0, 300, 1500],
                    help="training steps (plain SGD, batch 32) at which the gradients are taken")
    ap.add_argument("--densities", type=float, nargs="+", default=[0.01, 0.001])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the last point's unions here")
    args = ap.parse_args()
    print("| step | compressor | d | one worker's | " +
          " | ".join(f"W={w}" for w in args.workers) + " |")
    print("|---|---|---|---|" + "---|" * len(args.workers))
    last: dict[str, dict[str, dict[int, float]]] = {}
    for at, grads in trained_gradients(CONFIG, args.at, max(args.workers), args.seed):
        for d in args.densities:
            print(f"| {at} | independent | {d} | {d:.4f} | " + " | ".join(
                f"{1 - (1 - d) ** w:.4f}" for w in args.workers) + " |", flush=True)
            for name in ("adtopk", "topk"):
                got = union_density(grads, {"compressor": name, "k": d}, args.workers)
                last.setdefault(str(d), {})[name] = {1: got["own"], **got["union"]}
                print(f"| {at} | {name} | {d} | {got['own']:.4f} | " + " | ".join(
                    f"{got['union'][w]:.4f}" for w in args.workers) + " |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(last, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
