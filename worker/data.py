"""Datasets that need no download: scikit-learn's digits, Python's own source as text,
and synthetic inputs for throughput runs. Every worker trains on its own shard."""
from __future__ import annotations

import inspect
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass
class Dataset:
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    task: str  # "classify" or "lm"

    def shard(self, rank: int, size: int) -> "Dataset":
        return Dataset(self.x_train[rank::size], self.y_train[rank::size], self.x_test,
                       self.y_test, self.task)

    def to(self, device: torch.device) -> "Dataset":
        """Every tensor on ``device`` once, so that no step copies its batch from the host."""
        return Dataset(self.x_train.to(device), self.y_train.to(device), self.x_test.to(device),
                       self.y_test.to(device), self.task)

    def batches_per_epoch(self, batch_size: int) -> int:
        return max(1, len(self.x_train) // batch_size)

    def batch(self, step: int, batch_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch for a global step: the same on a resumed run as on an uninterrupted one."""
        per_epoch = self.batches_per_epoch(batch_size)
        epoch, index = divmod(step, per_epoch)
        order = torch.randperm(len(self.x_train), generator=torch.Generator().manual_seed(seed + epoch))
        # the order is drawn on the CPU on every device alike, so a batch is the same anywhere
        picked = order[index * batch_size:(index + 1) * batch_size].to(self.x_train.device)
        return self.x_train[picked], self.y_train[picked]


def digits(seed: int) -> Dataset:
    from sklearn.datasets import load_digits
    raw = load_digits()
    x = torch.tensor(raw.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(raw.target, dtype=torch.int64)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    test = order[:360]
    train = order[360:]
    return Dataset(x[train], y[train], x[test], y[test], "classify")


def python_source(context: int = 64, limit_bytes: int = 2_000_000) -> Dataset:
    """Byte-level language modelling on the standard library's own .py files."""
    root = Path(sysconfig.get_paths()["stdlib"])
    text = bytearray()
    for path in sorted(root.glob("*.py")):
        text += path.read_bytes()
        if len(text) >= limit_bytes:
            break
    tokens = torch.tensor(list(text[:limit_bytes]), dtype=torch.int64)
    n = (len(tokens) - 1) // context
    x = tokens[:n * context].view(n, context)
    y = tokens[1:n * context + 1].view(n, context)
    cut = max(1, n // 20)
    return Dataset(x[cut:], y[cut:], x[:cut], y[:cut], "lm")


def synthetic_images(seed: int, count: int = 2048, side: int = 32, classes: int = 10) -> Dataset:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(count, 3, side, side, generator=gen)
    y = torch.randint(0, classes, (count,), generator=gen)
    return Dataset(x, y, x[:256], y[:256], "classify")


DATASETS = {"digits": digits, "pysource": python_source, "synthetic-images": synthetic_images}


def load(name: str, seed: int, spec: dict | None = None) -> Dataset:
    """``spec``: the loader's keyword arguments; a loader that takes a seed gets ``seed``."""
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; valid: {sorted(DATASETS)}")
    loader = DATASETS[name]
    seeded = {"seed": seed} if "seed" in inspect.signature(loader).parameters else {}
    return loader(**seeded, **(spec or {}))

