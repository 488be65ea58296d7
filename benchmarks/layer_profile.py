"""Where a model's backward pass produces its gradient bytes, for the step model's overlapped
ring (benchmarks/step_model.py): each parameter in forward order with the multiply-adds one
sample costs where it is applied.

DDP starts all-reducing a bucket as soon as backward has produced every gradient in it, so
how much of the ring hides behind backward depends on when the bytes become ready: VGG-16's
classifier (most of its bytes, few of its multiply-adds) is ready early, BERT-base's word
embedding (a fifth of its bytes, no multiply-adds) last. Backward is taken to spend its
time on each weight in proportion to that weight's multiply-adds.

The three projected models are written out from their weight shapes (benchmarks/placement.py's
``parameters``: a weight, then the vector beside it): a convolution is applied at each
position of its output (ImageNet's 224 x 224 input), a linear layer once an image or once a
token (BERT-base: 128 tokens), an embedding not at all (a gather). A model that can be built
here (benchmarks' MODELS) is measured instead, with hooks on one forward pass.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

BERT_TOKENS = 128  # tokens a sample (BERT-base's pre-training sequence length)
# output positions of VGG-16's 13 convolutions at 224 x 224
VGG16_POSITIONS = [224 ** 2] * 2 + [112 ** 2] * 2 + [56 ** 2] * 3 + [28 ** 2] * 3 + [14 ** 2] * 3
RESNET50_STAGES = ((64, 3, 56), (128, 4, 28), (256, 6, 14), (512, 3, 7))  # planes, blocks, side


@dataclass(frozen=True)
class Tensor:
    """One parameter: its shape and the multiply-adds a sample costs in its layer's forward."""

    shape: tuple[int, ...]
    macs: float

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _resnet50_positions() -> list[int]:
    out = [112 ** 2]  # the stem
    for _, blocks, side in RESNET50_STAGES:
        for b in range(blocks):
            out += [side * side] * (4 if b == 0 else 3)  # three convolutions, and a shortcut
    return out + [1]  # the classifier


def _positions(model: str) -> list[int]:
    if model == "vgg16":
        return VGG16_POSITIONS + [1, 1, 1]
    if model == "resnet50":
        return _resnet50_positions()
    if model == "bert-base":
        return [0, 0, 0] + [BERT_TOKENS] * 72 + [1]  # embeddings, 12 layers of 6, the pooler
    raise ValueError(f"no layer profile for {model!r}")


def tensors(model: str) -> list[Tensor]:
    """A projected model's parameters in forward order (placement.py's ``parameters``), each
    with its multiply-adds a sample; the vector beside a weight costs nothing.

    Example::

        sum(t.macs for t in tensors("resnet50")) / 1e9   # about 4.1
    """
    from placement import parameters
    shapes = parameters(model)
    weights = shapes[0::2]
    positions = _positions(model)
    if len(weights) != len(positions):
        raise ValueError(f"{model}: {len(weights)} weights, a profile of {len(positions)} "
                         "(torchvision's shapes differ from the ones written out here)")
    out = []
    for weight, vector, where in zip(weights, shapes[1::2], positions):
        out += [Tensor(weight, float(math.prod(weight) * where)), Tensor(vector, 0.0)]
    return out


def measured(model: str) -> list[Tensor]:
    """A buildable model's parameters (benchmarks' MODELS) in their order, each with the
    multiply-adds of one sample (e2e's: a 32 x 32 image, 64 tokens) in its layer, from hooks
    on a forward."""
    import torch

    from adtopk_ps.testing.systems import MODELS
    from worker.models import build
    arch, spec, inputs = MODELS[model]
    sample = torch.zeros((1, 3, 32, 32)) if inputs == "images" else torch.zeros((1, 64), dtype=torch.long)
    torch.manual_seed(0)
    net = build(arch, spec)
    macs: dict[int, float] = {}

    def hook(module, _inputs, output):
        weight = getattr(module, "weight", None)
        if weight is not None and weight.dim() >= 2:
            positions = output[0].numel() / weight.shape[0]  # per sample, per output unit
            macs[id(weight)] = float(weight.numel() * positions)
    handles = [m.register_forward_hook(hook) for m in net.modules()]
    with torch.no_grad():
        net(sample)
    for h in handles:
        h.remove()
    return [Tensor(tuple(p.shape), macs.get(id(p), 0.0)) for p in net.parameters()]
