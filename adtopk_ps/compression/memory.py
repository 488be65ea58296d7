"""Error feedback, kept apart from the compressors it wraps (GRACE's "memory").

``c = g + r``; send ``compress(c)``; ``r = c - decompress(compress(c))``.
Subtracting the sent values in place keeps ``decompress(p) + r == c``
exact: selected entries are either equal to ``c`` or (for fp16 values) within
a factor of two of it, and such differences are exact in floating point.
"""
from __future__ import annotations

from typing import Iterable, Iterator

import torch

from adtopk_ps.compression.base import Compressor, Request, distinct
from adtopk_ps.core.payload import Payload

EF_KINDS = ("vanilla",)


class ResidualMemory:
    """Residuals keyed by tensor name; saved with checkpoints."""

    def __init__(self) -> None:
        self.residuals: dict[str, torch.Tensor] = {}

    def prepared(self, name: str, grad: torch.Tensor) -> torch.Tensor:
        """The residual of ``name`` ready to take ``grad``: zeros for a new name, moved or cast
        to ``grad``'s device and dtype; one of another shape is refused."""
        residual = self.residuals.get(name)
        if residual is None:
            residual = self.residuals[name] = torch.zeros(grad.shape, dtype=grad.dtype, device=grad.device)
        elif residual.shape != grad.shape:
            raise ValueError(f"residual for {name!r} has shape {tuple(residual.shape)}, "
                             f"gradient has {tuple(grad.shape)}")
        elif residual.device != grad.device or residual.dtype != grad.dtype:
            residual = self.residuals[name] = residual.to(grad.device, grad.dtype)
        return residual

    def compensate(self, name: str, grad: torch.Tensor) -> torch.Tensor:
        """``g + r``, written into the residual's own buffer.

        Updating in place (here and in :meth:`update`) allocates nothing per
        step: a fresh tensor of a large layer costs page faults every step.
        """
        return self.prepared(name, grad).add_(grad.detach())

    def update(self, name: str, compensated: torch.Tensor, payload: Payload) -> torch.Tensor:
        """``r = c - decompress(payload)``, in ``c``'s buffer unless the payload still reads it."""
        residual = compensated
        if payload.values.untyped_storage().data_ptr() == compensated.untyped_storage().data_ptr():
            residual = compensated.clone()  # a dense payload may be a view of c
        payload.accumulate_into(residual, alpha=-1.0)
        self.residuals[name] = residual
        return residual

    def forget(self, names: Iterable[str]) -> None:
        """Drop these residuals (one that took a NaN or an infinity would send it again);
        each starts afresh from its next gradient."""
        for name in names:
            self.residuals.pop(name, None)

    def state_dict(self) -> dict:
        """The residuals, by tensor name, for a checkpoint."""
        return {name: r.detach().cpu().clone() for name, r in self.residuals.items()}

    def load_state_dict(self, state: dict) -> None:
        """Restore residuals saved by :meth:`state_dict`."""
        self.residuals = {name: torch.as_tensor(r).clone() for name, r in state.items()}


class ErrorFeedback(Compressor):
    """A compressor whose dropped mass is carried to the next call of the same tensor.

    It is a :class:`Compressor` like the one it wraps: callers ask
    :attr:`base` for the wrapped one, :meth:`accepts` and ``name``, ``ratio``
    and ``sparse`` answer as it does, and :attr:`memory` holds the residuals.

    Example::

        comp = ErrorFeedback(ADTopk(ratio=0.01))     # or create("adtopk", ratio=0.01, ef="vanilla")
        payload = comp.compress(grad, name="fc.weight", step=0)   # what was not sent waits for step 1
        comp.base                                    # the ADTopk it wraps, without the residuals
    """

    ef = "vanilla"

    def __init__(self, base: Compressor, memory: ResidualMemory | None = None):
        if not isinstance(base, Compressor):
            raise TypeError(f"ErrorFeedback wraps a Compressor, got {type(base).__name__}")
        if base.ef != "none":
            raise ValueError(f"{base!r} already carries error feedback (ef={base.ef!r}); "
                             f"wrap the compressor it wraps, {base.base!r}, instead")
        self._base = base
        self.memory = memory if memory is not None else ResidualMemory()
        self.name, self.sparse = base.name, base.sparse
        self.ratio, self.value_dtype = base.ratio, base.value_dtype

    @property
    def base(self) -> Compressor:
        """The wrapped compressor, which chooses what is sent."""
        return self._base

    def accepts(self, tensor: torch.Tensor) -> bool:
        """As the wrapped compressor."""
        return self._base.accepts(tensor)

    def compress(self, tensor: torch.Tensor, name: str, step: int = 0,
                 ratio: float | None = None) -> Payload:
        """Compress ``g + r`` and keep what was not sent as the new ``r``: in the wrapped
        compressor's fused pass where it has one for this call, else in three steps."""
        return next(self.start([Request(tensor, name, step, ratio)]))

    def start(self, requests: list[Request]) -> Iterator[Payload]:
        """A batch, as :meth:`compress` does each: every request goes to the wrapped
        compressor's fused pass with its residual (zeros for a new tensor), which starts here
        (one kernel launch for the batch on CUDA); a batch it refuses is refused before any
        residual changes."""
        distinct(requests)
        new = [r.name for r in requests if r.name not in self.memory.residuals]
        residuals = [self.memory.prepared(r.name, r.tensor) for r in requests]
        try:
            got = self._base.start_with_feedback(requests, residuals)
        except BaseException:
            self.memory.forget(new)  # a refused batch leaves no residual behind
            raise
        return self._completed(requests, got)

    def _completed(self, requests: list[Request], got: Iterator[Payload | None]) -> Iterator[Payload]:
        """Each request's payload, in order: the fused pass's, or where it had none,
        compensate, compress and update in three steps."""
        for r in requests:
            payload = next(got)
            if payload is None:
                compensated = self.memory.compensate(r.name, r.tensor)
                payload = self._base.compress(compensated, r.name, r.step, r.ratio)
                self.memory.update(r.name, compensated, payload)
            yield payload

    def restore(self, answer: torch.Tensor, name: str) -> None:
        """The wrapped compressor's (ADTopk frees the staging the payload was sent from)."""
        self._base.restore(answer, name)

    def forget(self, names: Iterable[str]) -> None:
        """Drop the residuals of these tensor names and of their partitions (``name#i``):
        each starts afresh from its next gradient."""
        names = set(names)
        self.memory.forget([kept for kept in self.memory.residuals
                            if kept in names or kept.rpartition("#")[0] in names])

    def decompress(self, payload: Payload) -> torch.Tensor:
        """The wrapped compressor's decompression."""
        return self._base.decompress(payload)

    def state_dict(self) -> dict:
        """The residuals and the wrapped compressor's per-layer state."""
        return {"compressor": self._base.state_dict(), "residuals": self.memory.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` saved."""
        self._base.load_state_dict(state.get("compressor", {}))
        self.memory.load_state_dict(state.get("residuals", {}))

    def __repr__(self) -> str:
        return f"ErrorFeedback({self._base!r})"
