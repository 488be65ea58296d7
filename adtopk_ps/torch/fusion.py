"""Small dense gradients fused into flat buckets, each pushed as one key.

A ResNet or Transformer has dozens of biases and norms; one key each costs a
message, a server round and an answer apiece, which measured slower than
DDP's bucketed all-reduce on a fast link. Gradients the policy sends dense
and that are smaller than a bucket are packed, in the order the backward pass
produces them (the model's order reversed), into buckets of at most
``capacity`` bytes of one dtype and device. A bucket leaves as soon as its
last member's gradient is in.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

import torch

from adtopk_ps.core.env import env_int

DEFAULT_FUSION_BYTES = 4 << 20


def fusion_bytes() -> int:
    """``PS_FUSION_BYTES``: bucket capacity in bytes; 0 turns fusion off."""
    return env_int("PS_FUSION_BYTES", DEFAULT_FUSION_BYTES, minimum=0)


@dataclass
class Bucket:
    """One fusion bucket: a flat buffer, its members' offsets, and which members' gradients are in."""

    name: str
    buffer: torch.Tensor  # flat
    members: list[tuple[torch.Tensor, int]]  # (parameter, offset into buffer)
    ready: set[int] = field(default_factory=set)  # ids of members whose gradient is in
    offsets: dict[int, int] = field(init=False)  # by the member's id

    def __post_init__(self) -> None:
        self.offsets = {id(p): offset for p, offset in self.members}

    def put(self, p: torch.Tensor, grad: torch.Tensor | None) -> bool:
        """Copy one member's gradient in (zeros for none); True when the bucket is full."""
        if id(p) in self.ready:
            raise RuntimeError(f"a gradient in {self.name!r} was pushed twice before step(); with "
                               f"gradient accumulation set backward_passes_per_step")
        view = self.buffer.narrow(0, self.offsets[id(p)], p.numel())
        if grad is None:
            view.zero_()
        else:
            view.copy_(grad.reshape(-1))
        self.ready.add(id(p))
        return len(self.ready) == len(self.members)

    def unpack(self, averaged: torch.Tensor) -> None:
        """The averaged bucket's slices become the members' gradients."""
        for p, offset in self.members:
            part = averaged.narrow(0, offset, p.numel()).view_as(p)
            if p.grad is None:
                p.grad = part.clone()
            else:
                p.grad.copy_(part)
        self.ready.clear()


def plan_buckets(named: Iterable[tuple[str, torch.Tensor]], dense: set[str],
                 capacity: int, prefix: str = "fused.") -> list[Bucket]:
    """Buckets for the dense parameters smaller than ``capacity``, in backward order, named
    ``prefix`` and their index."""
    buckets: list[Bucket] = []
    group: list[torch.Tensor] = []
    used = 0

    def close() -> None:
        nonlocal group, used
        if len(group) > 1:  # a lone tensor gains nothing from a bucket
            total = sum(p.numel() for p in group)
            buffer = torch.zeros(total, dtype=group[0].dtype, device=group[0].device)
            offsets = [sum(q.numel() for q in group[:i]) for i in range(len(group))]
            buckets.append(Bucket(f"{prefix}{len(buckets)}", buffer, list(zip(group, offsets))))
        group, used = [], 0

    for name, p in reversed(list(named)):
        nbytes = p.numel() * p.element_size()
        if name not in dense or nbytes >= capacity:
            continue
        if group and (used + nbytes > capacity or p.dtype != group[0].dtype
                      or p.device != group[0].device):
            close()
        group.append(p)
        used += nbytes
    close()
    return buckets
