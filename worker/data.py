"""Datasets that need no download: scikit-learn's digits, Fashion-MNIST from Debian's
package, Python's own source as text, and synthetic inputs for throughput runs. Every
worker trains on its own shard."""
from __future__ import annotations

import inspect
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.nn.functional import pad as nn_pad

from .idx import read_idx

FASHION_MNIST = "/usr/share/datasets/fashion-mnist"
FASHION_FILES = ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz",
                 "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")
# the training images' mean and standard deviation, over all 60,000 of them
FASHION_MEAN, FASHION_STD = 0.2860, 0.3530
MAX_SIDE = 256  # padding beyond this is a typo, not a model's input size


class DatasetUnavailable(ValueError):
    """A dataset whose files are not on this machine."""


@dataclass
class Dataset:
    """A task's train and test tensors, and whether it is classification or a language model."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    task: str  # "classify" or "lm"

    def shard(self, rank: int, size: int) -> "Dataset":
        """Every ``size``-th training example from ``rank`` on; refused where some worker would
        get none (it would push zero gradients and train nothing)."""
        if len(self.x_train) < size:
            raise DatasetUnavailable(f"the dataset has {len(self.x_train)} training example(s), "
                                     f"fewer than the {size} workers")
        return Dataset(self.x_train[rank::size], self.y_train[rank::size], self.x_test,
                       self.y_test, self.task)

    def to(self, device: torch.device) -> "Dataset":
        """Every tensor on ``device`` once, so that no step copies its batch from the host."""
        return Dataset(self.x_train.to(device), self.y_train.to(device), self.x_test.to(device),
                       self.y_test.to(device), self.task)

    def batches_per_epoch(self, batch_size: int) -> int:
        """Whole batches of ``batch_size`` in the training set (at least one)."""
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
    """scikit-learn's 8x8 digits, as a classification task."""
    from sklearn.datasets import load_digits
    raw = load_digits()
    x = torch.tensor(raw.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(raw.target, dtype=torch.int64)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    test = order[:360]
    train = order[360:]
    return Dataset(x[train], y[train], x[test], y[test], "classify")


def fashion_files(root: str = FASHION_MNIST) -> list[Path]:
    """Fashion-MNIST's four IDX files; raises :class:`DatasetUnavailable` naming the package
    that installs them when any is missing."""
    paths = [Path(root) / name for name in FASHION_FILES]
    odd = [p for p in paths if p.exists() and not p.is_file()]
    if odd:
        raise DatasetUnavailable(f"Fashion-MNIST: {odd[0]} is not a regular file")
    missing = [p.name for p in paths if not p.is_file()]
    if missing:
        how = ("install Debian's package: apt-get install dataset-fashion-mnist"
               if root == FASHION_MNIST else "point dataset_args.root at a folder that holds them")
        raise DatasetUnavailable(f"Fashion-MNIST: {', '.join(missing)} not found in {root}; {how}")
    return paths


def fashion_mnist(root: str = FASHION_MNIST, train_limit: int = 60000, test_limit: int = 10000,
                  side: int = 28) -> Dataset:
    """Fashion-MNIST's 28x28 grey images of 10 kinds of clothing, normalised.

    ``train_limit`` and ``test_limit`` keep the first so many of each set (tests train on a
    slice); ``side`` > 28 pads the images with the background, for models laid out for 32x32.
    """
    check_available("fashion-mnist", {"root": root, "side": side})
    paths = fashion_files(root)
    train_x, train_y, test_x, test_y = (read_idx(p) for p in paths)
    for images, labels, (image_path, label_path) in ((train_x, train_y, paths[:2]),
                                                     (test_x, test_y, paths[2:])):
        if images.dtype != torch.uint8 or images.dim() != 3 or tuple(images.shape[1:]) != (28, 28) \
                or len(images) == 0:
            raise DatasetUnavailable(f"{image_path}: expected uint8 images [N, 28, 28], got "
                                     f"{images.dtype} {list(images.shape)}")
        if labels.dtype != torch.uint8 or labels.dim() != 1 or len(labels) != len(images):
            raise DatasetUnavailable(f"{label_path}: expected {len(images)} uint8 labels, got "
                                     f"{labels.dtype} {list(labels.shape)}")
        outside = (labels > 9).nonzero()
        if len(outside):
            at = int(outside[0])
            raise DatasetUnavailable(f"{label_path}: label {int(labels[at])} at index {at} is "
                                     "outside the 10 classes 0..9")

    def prepared(images: torch.Tensor, limit: int) -> torch.Tensor:
        x = (images[:limit].to(torch.float32).unsqueeze(1) / 255.0 - FASHION_MEAN) / FASHION_STD
        pad = side - 28
        if pad:
            background = -FASHION_MEAN / FASHION_STD
            x = nn_pad(x, (pad // 2, pad - pad // 2, pad // 2, pad - pad // 2), value=background)
        return x.contiguous()

    return Dataset(prepared(train_x, train_limit), train_y[:train_limit].to(torch.int64),
                   prepared(test_x, test_limit), test_y[:test_limit].to(torch.int64), "classify")


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
    """Random images and labels, for throughput runs that need no dataset."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(count, 3, side, side, generator=gen)
    y = torch.randint(0, classes, (count,), generator=gen)
    return Dataset(x, y, x[:256], y[:256], "classify")


DATASETS = {"digits": digits, "fashion-mnist": fashion_mnist, "pysource": python_source, "synthetic-images": synthetic_images}


def check_available(name: str, spec: dict) -> None:
    """Raise :class:`DatasetUnavailable` where the dataset's files or arguments cannot work, so
    that a worker says so before it joins the cluster rather than after."""
    if name == "fashion-mnist":
        fashion_files(spec.get("root", FASHION_MNIST))
        if not 28 <= spec.get("side", 28) <= MAX_SIDE:
            raise DatasetUnavailable(f"Fashion-MNIST: side={spec['side']} must be from 28 (the "
                                     f"images' own) to {MAX_SIDE}")


def load(name: str, seed: int, spec: dict | None = None) -> Dataset:
    """``spec``: the loader's keyword arguments; a loader that takes a seed gets ``seed``."""
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; valid: {sorted(DATASETS)}")
    loader = DATASETS[name]
    seeded = {"seed": seed} if "seed" in inspect.signature(loader).parameters else {}
    return loader(**seeded, **(spec or {}))

