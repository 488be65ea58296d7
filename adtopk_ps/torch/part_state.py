"""Compressor state by whole tensor in checkpoints, by partition in memory.

A compressor keeps its state (error feedback's residuals, ADTopk-I's turns) under each
partition's name, ``name#i``. Which rows partition ``i`` holds depends on the job: the
placement cuts an agreed tensor by the servers configured, the density and the other
tensors (``cluster/placement.py``). A checkpoint therefore keeps each tensor's state whole,
``name#*``: the partitions' residuals joined in row order, a count the partitions share
kept once. Loading cuts them again by the blocks this job laid out, so a job resumed with
other servers or partitions goes on from the same residuals.
"""
from __future__ import annotations

import re
from typing import Callable

import torch

from adtopk_ps.cluster.membership import part_name

_PART = re.compile(r"^(.*)#(\d+)$")
WHOLE = "#*"  # the suffix of a tensor's state kept whole

#: a tensor's shape and blocks as this job laid it out, or None where it pushes no such name
Layouts = Callable[[str], "tuple[tuple[int, ...], list[tuple[int, int]]] | None"]


def whole(state: object) -> object:
    """``state`` with every set of partitions' entries ``name#0..name#n-1`` joined into one
    ``name#*`` (tensors flattened and joined in order; other values kept once where every
    partition has the same), in every dict it holds.

    Example::

        whole({"residuals": {"w#0": torch.zeros(2, 3), "w#1": torch.ones(1, 3)}})
        # {"residuals": {"w#*": tensor of 9 values: six zeros, then three ones}}
    """
    if not isinstance(state, dict):
        return state
    groups: dict[str, dict[int, object]] = {}
    for key, value in state.items():
        match = _PART.match(key) if isinstance(key, str) else None
        if match:
            groups.setdefault(match[1], {})[int(match[2])] = value
    out = {}
    for key, value in state.items():
        match = _PART.match(key) if isinstance(key, str) else None
        parts = groups.get(match[1]) if match else None
        if parts is None or sorted(parts) != list(range(len(parts))):
            out[key] = whole(value)
            continue
        joined = _joined([parts[i] for i in range(len(parts))])
        if joined is None:
            out[key] = whole(value)
        elif int(match[2]) == 0:
            out[match[1] + WHOLE] = joined
    return out


def _joined(values: list[object]) -> object | None:
    if all(isinstance(v, torch.Tensor) for v in values):
        return torch.cat([v.detach().reshape(-1) for v in values])
    if all(not isinstance(v, (dict, torch.Tensor)) and v == values[0] for v in values):
        return values[0]
    return None


def parted(state: object, layouts: Layouts) -> object:
    """``state`` with every ``name#*`` entry cut again into this job's partitions of
    ``name``; one for a name this job does not push stays as it is. Raises ``ValueError``
    where a tensor's saved size is not its size here.

    Example::

        parted({"w#*": torch.arange(9.0)}, lambda name: ((3, 3), [(0, 2), (2, 1)]))
        # {"w#0": the first two rows (2, 3), "w#1": the last row (1, 3)}
    """
    if not isinstance(state, dict):
        return state
    out = {}
    for key, value in state.items():
        laid = layouts(key[:-len(WHOLE)]) if isinstance(key, str) and key.endswith(WHOLE) else None
        if laid is None:
            out[key] = parted(value, layouts)
            continue
        name, (shape, blocks) = key[:-len(WHOLE)], laid
        unit = (int(torch.Size(shape).numel()) // shape[0]) if len(shape) >= 2 and shape[0] else 1
        rest = tuple(shape[1:]) if len(shape) >= 2 else ()
        if isinstance(value, torch.Tensor):
            if value.numel() != torch.Size(shape).numel():
                raise ValueError(f"the checkpoint's state for {name!r} holds {value.numel()} "
                                 f"values; the tensor here has shape {tuple(shape)}")
            flat = value.reshape(-1)
            for index, (start, length) in enumerate(blocks):
                out[part_name(name, index)] = \
                    flat[start * unit:(start + length) * unit].reshape(length, *rest).clone()
        else:
            for index in range(len(blocks)):
                out[part_name(name, index)] = value
    return out
