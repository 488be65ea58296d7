"""Checking that every worker holds the same parameters.

Data-parallel workers apply the same averaged gradients, so their parameters
are equal after every step; when they are not (a parameter stepped locally,
a buffer updated on one worker only, a bug), training goes on silently with
models that drift apart. A digest of each parameter, gathered from every
worker, finds that cheaply; the first parameter that differs is named.
"""
from __future__ import annotations

import hashlib

import torch

from adtopk_ps.torch.objects import allgather_object


class ReplicasDiverged(RuntimeError):
    """The workers' parameters differ (raised alike on every worker)."""


def _digest(tensor: torch.Tensor) -> str:
    return hashlib.blake2b(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8)
                           .numpy().tobytes(), digest_size=8).hexdigest()


def verify_replicas(module: torch.nn.Module, step: int | None = None,
                    name: str = "replicas") -> None:
    """Raise :class:`ReplicasDiverged` on every worker when the workers' parameters differ,
    naming the first that does and each worker's digest of it; every worker must call it at
    the same point (a collective). Buffers are left out: batch norm's running statistics
    are each worker's own, as in horovod and DDP without SyncBatchNorm.

    Example::

        if step % 100 == 0:
            bps.verify_replicas(model, step)
    """
    mine = [(n, _digest(p)) for n, p in module.named_parameters()]
    every = allgather_object(mine, name=name)
    for index, (tensor_name, _) in enumerate(mine):
        held = [theirs[index][1] if index < len(theirs) else "(none)" for theirs in every]
        if len(set(held)) > 1:
            when = f" after step {step}" if step is not None else ""
            raise ReplicasDiverged(
                f"the workers' copies of {tensor_name!r} differ{when}: "
                + ", ".join(f"worker {r} {d}" for r, d in enumerate(held))
                + "; the models have drifted apart (a parameter stepped on some workers only?)")
    if len({len(theirs) for theirs in every}) > 1:
        raise ReplicasDiverged(f"the workers hold different numbers of parameters: "
                               f"{[len(theirs) for theirs in every]}")
