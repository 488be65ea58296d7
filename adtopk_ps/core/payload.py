"""The compressed form of one tensor: what a compressor makes and a server adds up.

A payload holds its codec, the shape and dtype of the tensor it stands for, and
the values (and positions) it carries. The same ``accumulate_into`` serves
decompression, error feedback and server-side aggregation. How a payload goes
on the wire, and the checks on one that came from a peer, are the wire
package's (adtopk_ps/wire/frames.py and checks.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from adtopk_ps.core import sparse_write
from adtopk_ps.core.seeded import seeded_indices

#: Codecs a payload may carry.
#:  dense  - every element, in order
#:  fibre  - ``values``/``indices`` of shape ``[view[0], k, *view[2:]]``, indices
#:           are positions along axis 1 of ``view`` (ADTopk). Where some rows
#:           ``view[0]`` selected only zeros (dead units), ``rows`` lists the rows
#:           carried and the shape is ``[rows, k, *view[2:]]`` (on the wire, a third
#:           frame names them: see adtopk_ps/wire/frames.py)
#:  coo    - flat positions into the tensor and their values
#:  seeded - values only; positions are regenerated from ``seed`` (random-k, see seeded.py)
CODECS = ("dense", "fibre", "coo", "seeded")


class PayloadError(ValueError):
    """A payload is malformed (or, from a peer, fails the wire's checks); the message says how."""


@dataclass
class Payload:
    """One compressed tensor: its codec, shape and dtype, and the value (and index) buffers that go on the wire."""

    codec: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    values: torch.Tensor
    indices: torch.Tensor | None = None
    view: tuple[int, ...] | None = None
    seed: int | None = None
    # fibre payloads only: the rows of ``view`` carried (int64, increasing), where the others
    # selected nothing but zeros; None when every row is carried
    rows: torch.Tensor | None = None
    # the compressor saw a NaN or an infinity in its input (not part of the encoding: a push
    # carries it as a header flag)
    nonfinite: bool = field(default=False, compare=False)
    # values and indices already copied to host memory (the CUDA kernel's pinned buffer), which
    # the wire sends instead of staging them again
    host: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, compare=False, repr=False)

    @property
    def numel(self) -> int:
        """Elements of the tensor the payload stands for (not of what it carries)."""
        return math.prod(self.shape)

    @property
    def count(self) -> int:
        """Number of values carried."""
        return self.values.numel()

    def positions(self) -> torch.Tensor:
        """Flat or axis-1 positions as int64, ready for scatter."""
        if self.codec == "seeded":
            return seeded_indices(self.seed, self.numel, self.count, self.values.device)
        return self.indices.long()

    def flat_positions(self) -> torch.Tensor:
        """Positions into the flattened tensor (fibre payloads carry axis-1 ones)."""
        if self.codec == "dense":
            raise PayloadError("a dense payload has no positions")
        pos = self.positions()
        if self.codec != "fibre":
            return pos.view(-1)
        lead, k = self.values.shape[:2]
        n, rest = self.view[1], math.prod(self.view[2:])
        rows = torch.arange(lead, device=pos.device) if self.rows is None else self.rows.to(pos.device)
        row = rows.view(lead, 1, 1) * (n * rest)
        col = torch.arange(rest, device=pos.device).view(1, 1, rest)
        return (row + pos.reshape(lead, k, rest) * rest + col).view(-1)

    def accumulate_into(self, out: torch.Tensor, alpha: float = 1.0, divisor: int = 1) -> torch.Tensor:
        """``out += alpha * decompress(self) / divisor`` in place, without a dense expansion.

        Sparse values are scaled before they land, so averaging costs ``count``
        divisions instead of a pass over ``out``; a dense tensor divided after
        the fact gets the same bits, as every position receives one value.
        """
        self._check_target(out)
        vals = self.values.to(device=out.device, dtype=out.dtype)
        if alpha != 1.0:
            vals = vals * alpha
        if divisor != 1:
            vals = vals / divisor
        if self.codec == "dense":
            out.add_(vals.view(self.shape))
        elif self.codec == "fibre" and self.rows is None:
            out.view(self.view).scatter_add_(1, self.positions().to(out.device), vals)
        elif self.codec == "fibre":
            out.view(-1).scatter_add_(0, self.flat_positions().to(out.device), vals.reshape(-1))
        else:
            out.view(-1).scatter_add_(0, self.positions().to(out.device), vals)
        return out

    def write_into(self, out: torch.Tensor, divisor: int = 1) -> torch.Tensor:
        """``out[:] = decompress(self) / divisor``, on ``out``'s device, in one pass: dense
        payloads by a copy, sparse ones into a CPU tensor by the compiled walk of
        :mod:`adtopk_ps.core.sparse_write` where it applies (torch's zero and scatter elsewhere)."""
        self._check_target(out)
        if self.codec != "dense":
            parts = (self.codec, self.values, self.indices, self.view, self.rows)
            if (type(divisor) is int and divisor >= 1 and sparse_write.applies(out, *parts)
                    and sparse_write.write(out, *parts, divisor)):  # zeroes and places in one pass
                return out
            return self.accumulate_into(out.zero_(), divisor=divisor)
        vals = self.values.view(self.shape)
        if divisor == 1:
            return out.copy_(vals)
        if vals.dtype == out.dtype and vals.device == out.device:
            return torch.div(vals, divisor, out=out)
        return out.copy_(vals).div_(divisor)

    def _check_target(self, out: torch.Tensor) -> None:
        if tuple(out.shape) != self.shape:
            raise PayloadError(f"payload shape {self.shape} does not match buffer {tuple(out.shape)}")

    def decompress(self) -> torch.Tensor:
        """The dense tensor: zeros with the sent entries in place."""
        out = torch.empty(self.shape, dtype=self.dtype, device=self.values.device)
        return self.write_into(out)
