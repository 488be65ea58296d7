"""The datasets the training job reads: the IDX reader refuses damaged files, Fashion-MNIST
loads from Debian's package (or says which package installs it), and trains on a slice."""
import gzip
import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from procs import train_job
from worker import config
from worker import data as data_module
from worker.data import FASHION_FILES, FASHION_MNIST, DatasetUnavailable, fashion_mnist
from worker.idx import IdxError, parse_idx, read_idx
from worker.validate import ConfigError

ROOT = Path(__file__).resolve().parents[1]
FASHION = str(ROOT / "configs" / "fashion-cnn.yaml")
installed = all((Path(FASHION_MNIST) / name).is_file() for name in FASHION_FILES)
needs_fashion = pytest.mark.skipif(not installed, reason="Debian's dataset-fashion-mnist is not "
                                   "installed (apt-get install dataset-fashion-mnist; .ci/run does)")

# (IDX type code, torch dtype, big-endian struct letter)
TYPES = [(0x08, torch.uint8, "B"), (0x09, torch.int8, "b"), (0x0B, torch.int16, "h"),
         (0x0C, torch.int32, "i"), (0x0D, torch.float32, "f"), (0x0E, torch.float64, "d")]


def idx_bytes(code: int, letter: str, shape: tuple, values: list) -> bytes:
    """An IDX file written independently of the reader, with struct."""
    return (bytes([0, 0, code, len(shape)]) + struct.pack(f">{len(shape)}I", *shape)
            + struct.pack(f">{len(values)}{letter}", *values))


@st.composite
def idx_files(draw):
    code, dtype, letter = draw(st.sampled_from(TYPES))
    shape = tuple(draw(st.lists(st.integers(0, 5), min_size=1, max_size=4)))
    count = 1
    for size in shape:
        count *= size
    if dtype.is_floating_point:
        values = draw(st.lists(st.floats(-1e6, 1e6, width=32), min_size=count, max_size=count))
    else:
        info = torch.iinfo(dtype)
        values = draw(st.lists(st.integers(info.min, info.max), min_size=count, max_size=count))
    return idx_bytes(code, letter, shape, values), dtype, shape, values


@settings(max_examples=150, deadline=None)
@given(idx_files())
def test_idx_reads_what_was_written(case):
    raw, dtype, shape, values = case
    got = parse_idx(raw)
    assert got.dtype == dtype and tuple(got.shape) == shape
    assert got.flatten().tolist() == pytest.approx(values) if dtype.is_floating_point \
        else got.flatten().tolist() == values


@settings(max_examples=100, deadline=None)
@given(idx_files(), st.data())
def test_idx_refuses_any_cut_or_extra_bytes(case, data):
    raw = case[0]
    cut = data.draw(st.integers(0, len(raw) - 1))
    with pytest.raises(IdxError):
        parse_idx(raw[:cut])
    with pytest.raises(IdxError, match="announces shape"):
        parse_idx(raw + b"\0" * data.draw(st.integers(1, 9)))


@pytest.mark.parametrize("raw, words", [
    (b"\x01\x00\x08\x01" + struct.pack(">I", 0), "not an IDX file"),
    (b"\x00\x00\x07\x01" + struct.pack(">I", 0), "unknown IDX type code 0x07"),
    (b"\x00\x00\x08\x00", "no dimensions"),
    (b"\x00\x00\x08\x03\x00\x00", "header is cut short"),
    (b"", "not an IDX file"),
])
def test_idx_refuses_bad_headers(raw, words):
    with pytest.raises(IdxError, match=words):
        parse_idx(raw)


def test_damaged_gzip_is_named(tmp_path):
    good = gzip.compress(idx_bytes(0x08, "B", (2, 3), list(range(6))))
    path = tmp_path / "x-idx3-ubyte.gz"
    path.write_bytes(good)
    assert read_idx(path).tolist() == [[0, 1, 2], [3, 4, 5]]
    path.write_bytes(good[:-6])
    with pytest.raises(IdxError, match=f"{path}: not a readable gzip file"):
        read_idx(path)


def test_missing_package_names_it_and_the_install_line(tmp_path, monkeypatch):
    monkeypatch.setattr(data_module, "FASHION_MNIST", str(tmp_path))  # where the package would be
    with pytest.raises(DatasetUnavailable, match="install Debian's package: apt-get install "
                       "dataset-fashion-mnist"):
        data_module.fashion_files(str(tmp_path))
    monkeypatch.undo()
    with pytest.raises(DatasetUnavailable, match=f"not found in {tmp_path}; point dataset_args.root"):
        fashion_mnist(root=str(tmp_path))


def test_a_missing_dataset_fails_the_config_before_joining(tmp_path):
    args = config.parse_args(["--config", FASHION, "--set", f"dataset_args={{root: {tmp_path}}}"])
    with pytest.raises(ConfigError, match=f"train-images-idx3-ubyte.gz.*not found in {tmp_path}"):
        config.load(args)
    run = subprocess.run([sys.executable, "-m", "worker", "--config", FASHION, "--set",
                          f"dataset_args={{root: {tmp_path}}}"], capture_output=True, text=True,
                         timeout=60, cwd=ROOT)  # no cluster at all: it must not try to join one
    assert run.returncode == 2, run.stderr
    assert "Fashion-MNIST" in run.stderr and "not found" in run.stderr


@pytest.mark.parametrize("override, words", [
    ("dataset_args={side: 20}", "side=20 must be from 28"),
    ("dataset_args={side: 100000}", "side=100000 must be from 28 .* to 256"),
    ("dataset_args={root: 7}", "dataset_args.root=7: must be a string"),
    ("dataset_args={train_limit: 0}", "dataset_args.train_limit=0: must be an integer >= 1"),
    ("dataset_args={trian_limit: 5}", "did you mean 'train_limit'"),
])
def test_bad_dataset_args_are_named(override, words):
    with pytest.raises(ConfigError, match=words):
        config.load(config.parse_args(["--config", FASHION, "--set", override]))


@needs_fashion
def test_fashion_mnist_is_the_real_dataset():
    data = fashion_mnist()
    assert data.x_train.shape == (60000, 1, 28, 28) and data.x_test.shape == (10000, 1, 28, 28)
    assert torch.bincount(data.y_train).tolist() == [6000] * 10
    assert torch.bincount(data.y_test).tolist() == [1000] * 10
    assert abs(float(data.x_train.mean())) < 0.01 and abs(float(data.x_train.std()) - 1) < 0.01
    padded = fashion_mnist(train_limit=5, test_limit=3, side=32)
    assert padded.x_train.shape == (5, 1, 32, 32) and padded.x_test.shape == (3, 1, 32, 32)
    assert torch.equal(padded.x_train[:, :, 2:30, 2:30], data.x_train[:5])
    assert torch.all(padded.x_train[:, :, :2] == padded.x_train[0, 0, 0, 0])  # the background


@needs_fashion
def test_the_job_learns_fashion_mnist_on_a_slice(tmp_path):
    summary = tmp_path / "summary.json"
    run = train_job(2, 1, "--steps", "60", "--set", "progress=false", "--set",
                    "dataset_args={train_limit: 4000, test_limit: 1000}", "--metrics-out",
                    str(summary), config=FASHION, timeout=180)
    assert run.returncode == 0, run.stdout[-3000:]
    result = json.loads(summary.read_text())
    assert result["accuracy"] > 0.6, result  # 10 classes: chance is 0.1
    assert result["bytes_pushed"] > 0


def fake_fashion(root: Path, train: int = 40, test: int = 20, labels=None, images=None) -> Path:
    """A small dataset in Fashion-MNIST's four files (``labels``/``images``: replacements for
    the training set's, as (code, letter, shape, values))."""
    root.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    for prefix, count in (("train", train), ("t10k", test)):
        pixels = torch.randint(0, 256, (count * 28 * 28,), generator=gen).tolist()
        image = idx_bytes(0x08, "B", (count, 28, 28), pixels)
        label = idx_bytes(0x08, "B", (count,), [i % 10 for i in range(count)])
        if prefix == "train" and images is not None:
            image = idx_bytes(*images)
        if prefix == "train" and labels is not None:
            label = idx_bytes(*labels)
        (root / f"{prefix}-images-idx3-ubyte.gz").write_bytes(gzip.compress(image))
        (root / f"{prefix}-labels-idx1-ubyte.gz").write_bytes(gzip.compress(label))
    return root


def test_a_small_dataset_in_the_same_files_loads(tmp_path):
    data = fashion_mnist(root=str(fake_fashion(tmp_path / "ok")))
    assert data.x_train.shape == (40, 1, 28, 28) and data.y_test.tolist() == [i % 10 for i in range(20)]


@pytest.mark.parametrize("change, words", [
    ({"labels": (0x08, "B", (40,), [200] + [1] * 39)}, "label 200 at index 0 is outside the 10 classes"),
    ({"labels": (0x09, "b", (40,), [1] * 39 + [-3])}, "expected 40 uint8 labels, got torch.int8"),
    ({"labels": (0x08, "B", (39,), [1] * 39)}, "expected 40 uint8 labels, got torch.uint8 \\[39\\]"),
    ({"images": (0x0C, "i", (40, 28, 28), [100000] * (40 * 28 * 28))}, "expected uint8 images \\[N, 28, 28\\], got torch.int32"),
    ({"images": (0x08, "B", (40, 32, 32), [0] * (40 * 32 * 32))}, "expected uint8 images \\[N, 28, 28\\], got torch.uint8 \\[40, 32, 32\\]"),
])
def test_foreign_contents_are_refused_naming_the_file(tmp_path, change, words):
    root = fake_fashion(tmp_path / "bad", **change)
    with pytest.raises(DatasetUnavailable, match=words) as err:
        fashion_mnist(root=str(root))
    assert str(root) in str(err.value)


def test_a_corrupt_stream_and_a_folder_for_a_file_are_named(tmp_path):
    root = fake_fashion(tmp_path / "flip")
    path = root / "train-labels-idx1-ubyte.gz"
    raw = bytearray(path.read_bytes())
    raw[10] ^= 0xFF  # inside the deflate stream: zlib's own error
    path.write_bytes(bytes(raw))
    with pytest.raises(IdxError, match=f"{path}: not a readable gzip file"):
        fashion_mnist(root=str(root))
    path.unlink()
    path.mkdir()
    with pytest.raises(DatasetUnavailable, match=f"{path} is not a regular file"):
        fashion_mnist(root=str(root))


def test_a_damaged_dataset_stops_the_worker_before_it_joins(tmp_path):
    root = fake_fashion(tmp_path / "bad", labels=(0x08, "B", (40,), [12] * 40))
    run = subprocess.run([sys.executable, "-m", "worker", "--config", FASHION, "--set",
                          f"dataset_args={{root: {root}}}"], capture_output=True, text=True,
                         timeout=60, cwd=ROOT)  # no cluster at all: it must not try to join one
    assert run.returncode == 2, run.stderr
    assert "label 12 at index 0 is outside the 10 classes" in run.stderr


def test_fewer_examples_than_workers_is_refused_by_every_worker(tmp_path):
    root = fake_fashion(tmp_path / "tiny")
    run = train_job(2, 1, "--steps", "3", "--set", "progress=false", "--set",
                    f"dataset_args={{root: {root}, train_limit: 1}}", config=FASHION, timeout=120)
    assert run.returncode == 2, run.stdout[-2000:]
    assert "the dataset has 1 training example(s), fewer than the 2 workers" in run.stdout
