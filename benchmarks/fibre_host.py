"""The host's share of a batched fibre selection, measured without a GPU.

``fibre_triton.launch(...).results()`` does Python and torch work around the
kernel launches: it checks and views each tensor, lays out the buffer, builds
and uploads the table, and after the copy reads each tensor's flags and live
rows from the host bytes and makes its views; the compressor's batch call
(``ErrorFeedback(ADTopk).start``, what the engine calls) adds its residuals,
checks and payloads. The goal is at most about 20 us a tensor. This script
times both on the CPU for the gradient sets of
benchmarks/compression.py, with the kernel launches, the spreading of programs
to tensors and the copy to host left out (on a GPU they are queued, not done,
by the host), so it measures the Python and torch work alone;
``benchmarks/gpu_kernel.py`` measures the whole host time on a GPU.

    python benchmarks/fibre_host.py                     # ResNet-50, VGG-16, BERT-base
    python benchmarks/fibre_host.py --sets resnet50 --repeats 50
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # CPU tensors: the interpreter's path, launched by no one
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import compression as sets  # noqa: E402
from adtopk_ps.compression import create, fibre_k, fibre_triton  # noqa: E402
from adtopk_ps.compression.base import Request  # noqa: E402
from adtopk_ps.compression.staging import Stage  # noqa: E402

SHAPES = {"resnet50": sets._resnet50_shapes, "vgg16": sets._vgg16_shapes, "bert-base": sets._bert_base_shapes}


class _NoLaunch:
    """The kernel, launched by no one: ``kernel[grid](...)`` does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def _queued_copy(self: Stage, nbytes: int) -> torch.Tensor:
    """Stage.to_host as the host sees it on a GPU: the copy is queued, not done (the host
    bytes say every fibre is live and nothing is flagged)."""
    if self._host.numel() < nbytes:
        self._host = torch.ones(nbytes + nbytes // 4, dtype=torch.uint8)
    return self._host[:nbytes]


def per_tensor_us(name: str, repeats: int) -> tuple[int, list[float], list[float]]:
    """(tensors, microseconds a tensor for each repeat of one batch over set ``name``: the
    selection alone, and the whole compressor call the engine makes)."""
    grads = [torch.randn(shape) for shape in sets.sparsified(SHAPES[name](), torch.float32)]
    items = [fibre_triton.Item(torch.zeros_like(g), g, fibre_k(g.shape[1], 0.01)) for g in grads]
    stage = Stage(torch.device("cpu"))
    compressor = create({"compressor": "adtopk", "k": 0.01, "ef": "vanilla"})
    requests = [Request(g, f"{name}.{i}") for i, g in enumerate(grads)]

    def selection():
        fibre_triton.launch(items, stage).results()

    def compressor_call():
        assert all(p.host is not None for p in compressor.start(requests))  # every one the kernel's

    return len(items), *(_timed(run, repeats, len(items)) for run in (selection, compressor_call))


def _timed(run, repeats: int, tensors: int) -> list[float]:
    for _ in range(3):
        run()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append((time.perf_counter() - started) / tensors * 1e6)
    return sorted(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sets", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    fibre_triton.CPU_TENSORS = True
    _, tl = fibre_triton._triton()
    fibre_triton._triton = lambda: (_NoLaunch(), tl)
    # on a GPU each program's tensor is spread out by a kernel the host only queues; on the
    # CPU it would be work proportional to the programs, which is not the host's share
    torch.repeat_interleave = lambda values, repeats, output_size: torch.empty(output_size, dtype=torch.int64)
    Stage.to_host = _queued_copy  # the compressor's stages too
    print(f"host work of one batch, error feedback, density 0.01 ({args.repeats} repeats; "
          f"kernel and copy left out)")
    for name in args.sets:
        tensors, selection, whole = per_tensor_us(name, args.repeats)
        print(f"{name:<10} {tensors:>3} tensors, us a tensor (median; min-max): selection "
              f"{statistics.median(selection):5.1f} ({selection[0]:.1f}-{selection[-1]:.1f}), "
              f"compressor call {statistics.median(whole):5.1f} ({whole[0]:.1f}-{whole[-1]:.1f})",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
