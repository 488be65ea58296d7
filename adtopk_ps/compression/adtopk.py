"""ADTopk: top-k along axis 1, so every fibre (no dimension) is left out.

For a Linear weight ``[out, in]`` each output row keeps its own
``k_f = max(1, floor(in * ratio))`` largest |g|; for a Conv ``[out, in, kh, kw]``
each (out, kh, kw) fibre over the input channels does. Positions along axis 1
are small, so they travel as uint8/uint16 and the row positions are implicit;
rows that selected only zeros (units dead for the batch) are left out of the
payload, which then names the rows it carries.
"""
from __future__ import annotations

import math

import torch

from ..dtypes import index_dtype
from . import fibre_triton
from .base import Compressor, flat_of, global_k
from .payload import Payload
from .select import all_finite, fibre_topk, fibre_topk_feedback, global_topk, live_rows
from .staging import Stage

LAYOUTS = ("axis", "rows")


def fibre_k(length: int, ratio: float) -> int:
    """Entries a fibre of ``length`` keeps at density ``ratio``: at least one, so no fibre is left out."""
    return max(1, math.floor(length * ratio))


class ADTopk(Compressor):
    """All-dimension top-k: every fibre along axis 1 keeps its own ``fibre_k(shape[1], ratio)`` largest |g|.

    Example::

        comp = ADTopk(ratio=0.01)
        payload = comp.compress(torch.randn(512, 1024), name="fc.weight")   # 10 per row, uint16 positions
        grad = comp.decompress(payload)
    """

    name = "adtopk"

    def __init__(self, ratio: float = 0.01, layout: str = "axis", value_dtype: str | None = None):
        super().__init__(ratio, value_dtype)
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {list(LAYOUTS)}, got {layout!r}")
        self.layout = layout
        self._stages: dict[str, Stage] = {}  # the CUDA kernel's buffers, per tensor name

    def view_of(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape whose axis 1 the fibres run along."""
        if self.layout == "rows":
            return (shape[0], math.prod(shape[1:]))
        return tuple(shape)

    def accepts(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` has fibres: two dimensions or more."""
        return tensor.dim() >= 2

    def compress(self, tensor: torch.Tensor, name: str, step: int = 0,
                 ratio: float | None = None) -> Payload:
        """A ``fibre`` payload of each fibre's largest entries; tensors under two dimensions are refused."""
        if not self.accepts(tensor):
            raise ValueError(
                f"adtopk needs a tensor with dim() >= 2, got {tuple(tensor.shape)} for {name!r}; "
                "the sparsification policy sends such tensors dense")
        view, k = self._fibres(tensor, ratio)
        x = tensor.detach().reshape(view)
        if fibre_triton.applies(x) and self.value_dtype in (None, x.dtype):
            return self._staged(tensor, view, fibre_triton.Item(x, None, k), name)
        positions = fibre_topk(x, k)
        selected = x.gather(1, positions)  # every fibre's NaN and infinities come first
        values = self._values(selected)
        rows = live_rows(values)  # as sent: a value fp16 rounds to zero counts as zero
        if rows is not None:
            values, positions = values.index_select(0, rows), positions.index_select(0, rows)
        return self._payload(tensor, view, positions, values, not all_finite(selected), rows)

    def compress_with_feedback(self, tensor: torch.Tensor, residual: torch.Tensor, name: str,
                               step: int = 0, ratio: float | None = None) -> Payload | None:
        """Error feedback's compensate, compress and update in one pass (the compiled kernel).

        ``residual`` becomes ``residual + tensor`` less what the payload
        carries. None, with nothing changed, where the kernel does not apply
        (other devices or dtypes, values cast for the wire, dense shares).
        """
        if not self.accepts(tensor) or self.value_dtype not in (None, tensor.dtype):
            return None
        view, k = self._fibres(tensor, ratio)
        grad = tensor.detach().reshape(view)
        if residual.is_contiguous() and fibre_triton.applies(residual.view(view), grad) and \
                (residual.shape, residual.dtype, residual.device) == \
                (tensor.shape, tensor.dtype, tensor.device):
            return self._staged(tensor, view, fibre_triton.Item(residual.view(view), grad, k), name)
        found = fibre_topk_feedback(residual.view(view), grad, k, live_only=True)
        if found is None:
            return None
        positions, values, rows = found
        return self._payload(tensor, view, positions, values, not all_finite(values), rows)

    def _fibres(self, tensor: torch.Tensor, ratio: float | None) -> tuple[tuple[int, ...], int]:
        """The view whose axis 1 the fibres run along, and how many entries each keeps."""
        view = self.view_of(tuple(tensor.shape))
        return view, fibre_k(view[1], self._ratio(ratio))

    def _staged(self, tensor: torch.Tensor, view: tuple[int, ...], item: "fibre_triton.Item",
                name: str) -> Payload:
        """The fused kernel's payload: device views, and their bytes already in pinned host
        memory (valid until ``name`` is compressed again)."""
        stage = self._stages.get(name)
        if stage is None or stage.device != tensor.device:
            stage = self._stages[name] = Stage(tensor.device)
        got = fibre_triton.select([item], stage)[0]
        return Payload("fibre", tuple(tensor.shape), tensor.dtype, got.values, got.indices, view=view,
                       rows=got.rows, nonfinite=got.nonfinite, host=(got.host_values, got.host_indices))

    @staticmethod
    def _payload(tensor: torch.Tensor, view: tuple[int, ...], positions: torch.Tensor,
                 values: torch.Tensor, nonfinite: bool, rows: torch.Tensor | None) -> Payload:
        """``rows``: the rows of the view carried, where the others selected only zeros."""
        return Payload("fibre", tuple(tensor.shape), tensor.dtype, values,
                       positions.to(index_dtype(view[1])), view=view, rows=rows, nonfinite=nonfinite)


class ADTopkInterleaved(ADTopk):
    """ADTopk-I: per layer, even calls use ADTopk and odd calls global top-k.

    The counter is the layer's own, so layers that skip a step (or are
    compressed more than once per step) still alternate.
    """

    name = "adtopk-i"

    def __init__(self, ratio: float = 0.01, layout: str = "axis", value_dtype: str | None = None):
        super().__init__(ratio, layout, value_dtype)
        self.calls: dict[str, int] = {}

    def compress(self, tensor: torch.Tensor, name: str, step: int = 0,
                 ratio: float | None = None) -> Payload:
        """ADTopk on this tensor's even calls, global top-k on its odd ones."""
        turn = self.calls.get(name, 0)
        self.calls[name] = turn + 1
        if turn % 2 == 0:
            return super().compress(tensor, name, step, ratio)
        flat = flat_of(tensor)
        k = global_k(flat.numel(), self._ratio(ratio))
        return self._coo(tensor, flat, global_topk(flat, k))

    def compress_with_feedback(self, tensor: torch.Tensor, residual: torch.Tensor, name: str,
                               step: int = 0, ratio: float | None = None) -> Payload | None:
        """As :meth:`compress`, with error feedback fused into the selection (see ``ErrorFeedback``)."""
        turn = self.calls.get(name, 0)
        if turn % 2:
            payload = self._coo_with_feedback(tensor, residual, ratio)
        else:
            payload = super().compress_with_feedback(tensor, residual, name, step, ratio)
        if payload is not None:
            self.calls[name] = turn + 1
        return payload

    def state_dict(self) -> dict:
        """Each tensor's turn, so a resumed job alternates where it left off."""
        return {"calls": dict(self.calls)}

    def load_state_dict(self, state: dict) -> None:
        """Restore the turns saved by :meth:`state_dict`."""
        self.calls = {str(k): int(v) for k, v in state.get("calls", {}).items()}
