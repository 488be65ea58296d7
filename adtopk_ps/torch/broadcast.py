"""Making every worker start from the root's parameters and optimizer state.

A broadcast is a push_pull in which only the root contributes: the others
push zeros, so the sum is the root's value. Integer and boolean tensors
travel as float64, exact for every value below 2**53.
"""
from __future__ import annotations

from typing import Iterable, Mapping

import torch

from ..client import Handle
from .objects import broadcast_object
from .runtime import client

_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _start(value: torch.Tensor, name: str, root_rank: int) -> Handle:
    c = client()
    wire = value.detach()
    if wire.dtype not in _FLOATS:
        wire = wire.to(torch.float64)
    send = wire.contiguous() if c.rank == root_rank else torch.zeros_like(wire)
    return c.push_pull(send, name, average=False)


def _broadcast_tensor(value: torch.Tensor, name: str, root_rank: int) -> torch.Tensor:
    return _start(value, name, root_rank).wait().to(value.dtype)


def broadcast_parameters(params: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                         root_rank: int = 0, prefix: str = "broadcast") -> None:
    """Overwrite ``params`` (a state_dict or named_parameters) in place with the root's."""
    items = sorted(params.items() if isinstance(params, Mapping) else params, key=lambda kv: kv[0])
    handles = [(value, _start(value, f"{prefix}.{name}", root_rank)) for name, value in items]
    with torch.no_grad():
        for value, handle in handles:
            value.copy_(handle.wait().to(value.dtype))


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0) -> None:
    """Load the root's optimizer state (buffers, step counts, hyper-parameters) everywhere."""
    state = broadcast_object(optimizer.state_dict(), root_rank, "broadcast.optimizer")
    if client().rank != root_rank:
        optimizer.load_state_dict(state)
