"""The servers' residuals, into a checkpoint and back out of one.

A server that re-sparsifies its answers (``BYTEPS_SERVER_COMPRESSOR``) keeps, per sparse
key, what its answers have left out so far, as a worker's error feedback keeps what its
pushes left out. A job resumed without it would not continue the run it stopped: the
servers would start with nothing held. So a checkpoint takes the servers' residuals too
(fetched as of the step it saves), and a resumed job puts them back before any round of
theirs completes.

Keys are named in a checkpoint by tensor name and partition, not only by key id: a job
resumed with other partitions (``BYTEPS_PARTITION_BYTES``, another ``DMLC_NUM_SERVER`` or
density, by which the placement cuts) or another model has other keys, and a residual that
fits none of them is refused, naming it.
"""
from __future__ import annotations

import threading
from typing import Callable

import torch

from adtopk_ps.cluster.membership import KeyLayout


class Replies:
    """Residuals fetched from the servers, or put back on them: one request per key,
    waiting for each key's reply on the engine thread."""

    def __init__(self, keys: list[int]) -> None:
        self.waiting = set(keys)
        self.residuals: dict[int, torch.Tensor] = {}
        self.error: BaseException | None = None
        self._done = threading.Event()
        if not self.waiting:
            self._done.set()

    def answered(self, key: int, residual: torch.Tensor | None) -> None:
        """A server's reply for ``key``: the residual fetched, or None (none held, or one
        put back taken)."""
        if residual is not None:
            self.residuals[key] = residual
        self.waiting.discard(key)
        if not self.waiting:
            self._done.set()

    def fail(self, error: BaseException) -> None:
        """The requests cannot complete (a server refused one, or the engine ended)."""
        if self.error is None:
            self.error = error
        self._done.set()

    def wait(self, timeout: float) -> dict[int, torch.Tensor]:
        """The residuals fetched, by key, once every server replied; raises what failed the
        requests, or ``TimeoutError``."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"the servers did not reply for the residuals of {len(self.waiting)} "
                               f"key(s) within {timeout:.1f} s")
        if self.error is not None:
            raise self.error
        return self.residuals


def keys_of(layouts: dict[tuple, KeyLayout]) -> dict[int, tuple[str, torch.dtype, tuple, int]]:
    """Every key of the tensors declared so far: key -> (tensor name, dtype, shape, partition)."""
    return {key: (name, dtype, shape, part) for (name, dtype, shape), layout in layouts.items()
            for part, key in enumerate(layout.keys)}


def saved(residuals: dict[int, torch.Tensor], keys: dict[int, tuple]) -> list[dict]:
    """What a checkpoint holds of the fetched ``residuals``: one entry per key, with the
    tensor it is a partition of."""
    return [{"key": key, "name": keys[key][0], "dtype": str(keys[key][1]).removeprefix("torch."),
             "shape": list(keys[key][2]), "part": keys[key][3], "residual": residual}
            for key, residual in sorted(residuals.items())]


def part_shape(layout: KeyLayout, part: int) -> tuple[int, ...]:
    """The shape of partition ``part`` of a tensor laid out as ``layout``, as pushed."""
    length = layout.blocks[part][1]
    return (length, *layout.shape[1:]) if len(layout.shape) >= 2 else (length,)


def to_restore(entries: object, layout_of: Callable[[str, torch.dtype, tuple], KeyLayout]
               ) -> dict[int, torch.Tensor]:
    """The residuals of a checkpoint's ``entries`` (:func:`saved`) by key, each checked to be
    the key its tensor's partition has in this job (``layout_of`` lays a tensor out as the
    client would); ``ValueError`` names the first that is not."""
    if not isinstance(entries, list):
        raise ValueError(f"the servers' residuals must be a list of entries, got {type(entries).__name__}")
    out: dict[int, torch.Tensor] = {}
    for entry in entries:
        try:
            key, name, part, residual = entry["key"], entry["name"], entry["part"], entry["residual"]
            dtype, shape = getattr(torch, entry["dtype"]), tuple(entry["shape"])
            if not isinstance(residual, torch.Tensor) or not isinstance(dtype, torch.dtype) \
                    or not all(type(n) is int and n >= 0 for n in shape):
                raise TypeError
        except (TypeError, KeyError, AttributeError, ValueError):
            raise ValueError(f"a server residual entry must hold key, name, dtype, shape, part "
                             f"and a tensor, got {entry!r:.160}") from None
        try:
            layout = layout_of(name, dtype, shape)
        except (ValueError, RuntimeError) as exc:  # too many partitions, too large a shape
            raise ValueError(f"the servers' residual of {name!r} names a tensor of shape {shape}, "
                             f"which cannot be laid out: {exc}") from None
        keys = layout.keys
        if not (type(part) is int and 0 <= part < len(keys) and keys[part] == key
                and tuple(residual.shape) == part_shape(layout, part)):
            raise ValueError(f"the servers' residual of {name!r} (partition {part}, key {key}) fits "
                             f"no key of this job: its partitions differ from the job that saved "
                             f"it (the placement cuts by BYTEPS_PARTITION_BYTES, DMLC_NUM_SERVER, "
                             f"PS_PLACEMENT and the densities; resume with the same)")
        what = f"the servers' residual of {name!r} (partition {part})"
        if residual.layout != torch.strided or residual.is_meta or residual.dtype != dtype:
            raise ValueError(f"{what} must be a {dtype} tensor with values, got {residual.dtype} "
                             f"{residual.layout} on {residual.device}")
        if not bool(torch.isfinite(residual).all()):
            raise ValueError(f"{what} holds a NaN or an infinity")
        out[key] = residual
    return out
