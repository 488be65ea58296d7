"""ADTopk: top-k along axis 1, so every fibre (no dimension) is left out.

For a Linear weight ``[out, in]`` each output row keeps its own
``k_f = max(1, floor(in * ratio))`` largest |g|; for a Conv ``[out, in, kh, kw]``
each (out, kh, kw) fibre over the input channels does. Positions along axis 1
are small, so they travel as uint8/uint16 and the row positions are implicit;
rows that selected only zeros (units dead for the batch) are left out of the
payload, which then names the rows it carries.

With ``refill=True`` the entries the dead rows leave unused go to the live ones: each
tensor's fibres keep ``fibre_k(shape[1], ratio / live)``, where ``live`` is the share of
its rows that were live in its previous call (all, at first), so that the payload comes
back to about the density's bytes.
"""
from __future__ import annotations

import math
from typing import Iterator

import torch

from adtopk_ps.compression import fibre_triton
from adtopk_ps.compression.base import Compressor, Request, distinct, flat_of, global_k
from adtopk_ps.compression.select import (all_finite, fibre_topk, fibre_topk_feedback, global_topk,
                                          live_rows)
from adtopk_ps.compression.staging import StagePool
from adtopk_ps.core.dtypes import index_dtype
from adtopk_ps.core.payload import Payload

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

    def __init__(self, ratio: float = 0.01, layout: str = "axis", value_dtype: str | None = None,
                 refill: bool = False):
        super().__init__(ratio, value_dtype)
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {list(LAYOUTS)}, got {layout!r}")
        if not isinstance(refill, bool):
            raise ValueError(f"refill must be true or false, got {refill!r}")
        self.layout, self.refill = layout, refill
        self._live: dict[str, float] = {}  # refill: each tensor's share of live rows, last call
        self._stages = StagePool()  # the CUDA kernel's buffers, reused once their payloads are answered

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
        request = Request(tensor, name, step, ratio)
        self._refuse(request)
        item = self._item(request, None)
        if item is not None:
            return next(self._launched([request], {0: item}))
        view, k = self._fibres(tensor, name, ratio)
        x = tensor.detach().reshape(view)
        positions = fibre_topk(x, k)
        selected = x.gather(1, positions)  # every fibre's NaN and infinities come first
        values = self._values(selected)
        rows = live_rows(values)  # as sent: a value fp16 rounds to zero counts as zero
        if rows is not None:
            values, positions = values.index_select(0, rows), positions.index_select(0, rows)
        return self._payload(tensor, name, view, positions, values, not all_finite(selected), rows)

    def compress_with_feedback(self, tensor: torch.Tensor, residual: torch.Tensor, name: str,
                               step: int = 0, ratio: float | None = None) -> Payload | None:
        """Error feedback's compensate, compress and update in one pass (the compiled kernel).

        ``residual`` becomes ``residual + tensor`` less what the payload
        carries. None, with nothing changed, where the kernel does not apply
        (other devices or dtypes, values cast for the wire, dense shares).
        """
        if not self.accepts(tensor) or self.value_dtype not in (None, tensor.dtype):
            return None
        request = Request(tensor, name, step, ratio)
        item = self._item(request, residual)
        if item is not None:
            return next(self._launched([request], {0: item}))
        view, k = self._fibres(tensor, name, ratio)
        found = fibre_topk_feedback(residual.view(view), tensor.detach().reshape(view), k, live_only=True)
        if found is None:
            return None
        positions, values, rows = found
        return self._payload(tensor, name, view, positions, values, not all_finite(values), rows)

    def start(self, requests: list[Request]) -> Iterator[Payload]:
        """A batch: every tensor the CUDA kernel takes is selected in one launch per kernel
        variant (started here), the others one call each as their payloads are asked for."""
        self._check(requests)
        return self._launched(requests, self._items(requests, [None] * len(requests)))

    def start_with_feedback(self, requests: list[Request],
                            residuals: list[torch.Tensor]) -> Iterator[Payload | None]:
        """:meth:`start` with error feedback fused in (see :meth:`compress_with_feedback`)."""
        self._check(requests)
        return self._launched(requests, self._items(requests, residuals), residuals)

    def restore(self, answer: torch.Tensor, name: str) -> None:
        """The answer of ``name`` landed: the staging its payload was sent from is free."""
        self._stages.release(name)

    def _check(self, requests: list[Request]) -> None:
        """Refuse a batch before any of it runs (the kernel updates every residual of the batch
        at once): a tensor named twice, or one without fibres."""
        distinct(requests)
        for r in requests:
            self._refuse(r)

    def _refuse(self, request: Request) -> None:
        if not self.accepts(request.tensor):
            raise ValueError(
                f"adtopk needs a tensor with dim() >= 2, got {tuple(request.tensor.shape)} for "
                f"{request.name!r}; the sparsification policy sends such tensors dense")

    def _items(self, requests: list[Request],
               residuals: list[torch.Tensor | None]) -> dict[int, "fibre_triton.Item"]:
        return {i: item for i, (r, residual) in enumerate(zip(requests, residuals))
                if (item := self._item(r, residual)) is not None}

    def _item(self, request: Request, residual: torch.Tensor | None) -> "fibre_triton.Item | None":
        """The kernel's item for one call, or None where the kernel does not take it."""
        tensor = request.tensor
        if not self.accepts(tensor) or self.value_dtype not in (None, tensor.dtype):
            return None
        view, k = self._fibres(tensor, request.name, request.ratio)
        grad = tensor.detach()
        if grad.shape != view:  # (a view costs as much as the rest of the kernel's host work)
            grad = grad.reshape(view)
        if residual is None:
            return fibre_triton.item(grad, None, k)
        if residual.is_contiguous() and residual.shape == tensor.shape:  # dtype, device: item's
            return fibre_triton.item(residual if residual.shape == view else residual.view(view), grad, k)
        return None

    def _launched(self, requests: list[Request], items: dict[int, "fibre_triton.Item"],
                  residuals: list[torch.Tensor | None] | None = None) -> Iterator[Payload | None]:
        """Launch ``items`` (one batch a device and dtype, in a stage of the pool), then yield each
        request's payload in order: the kernel's (device views, their bytes already in
        pinned host memory, valid until the answer is restored or the name staged again),
        or one call's."""
        batches: dict[tuple[torch.device, torch.dtype], list[int]] = {}
        for i in items:  # a launch takes one device and one dtype
            batches.setdefault((requests[i].tensor.device, requests[i].tensor.dtype), []).append(i)
        launched = {where: (members, fibre_triton.launch(
            [items[i] for i in members],
            self._stages.take(where[0], [requests[i].name for i in members])))
            for where, members in batches.items()}
        return self._yielded(requests, items, residuals, launched)

    def _yielded(self, requests: list[Request], items: dict[int, "fibre_triton.Item"],
                 residuals: list[torch.Tensor | None] | None,
                 launched: dict[tuple[torch.device, torch.dtype], tuple[list[int], "fibre_triton.Launched"]]
                 ) -> Iterator[Payload | None]:
        got: dict[int, fibre_triton.Selected] = {}
        for i, r in enumerate(requests):
            if i in items:
                if i not in got:  # the first of its batch: wait for the batch's copy
                    members, batch = launched[r.tensor.device, r.tensor.dtype]
                    got.update(zip(members, batch.results()))
                view = tuple(items[i].x.shape)
                s = got.pop(i)
                self._note_live(r.name, view, s.rows)
                yield Payload("fibre", tuple(r.tensor.shape), r.tensor.dtype, s.values, s.indices,
                              view=view, rows=s.rows, nonfinite=s.nonfinite,
                              host=(s.host_values, s.host_indices))
            elif residuals is None or residuals[i] is None:
                yield self.compress(r.tensor, r.name, r.step, r.ratio)
            else:
                yield self.compress_with_feedback(r.tensor, residuals[i], r.name, r.step, r.ratio)

    def _fibres(self, tensor: torch.Tensor, name: str,
                ratio: float | None) -> tuple[tuple[int, ...], int]:
        """The view whose axis 1 the fibres run along, and how many entries each keeps."""
        view = self.view_of(tuple(tensor.shape))
        density = self._ratio(ratio)
        if self.refill:
            density = min(1.0, density / self._live.get(name, 1.0))
        return view, min(view[1], fibre_k(view[1], density))

    def state_dict(self) -> dict:
        """Refill: each tensor's share of live rows, so a resumed job keeps its sizes."""
        return {"live": dict(self._live)} if self._live else {}

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` saved."""
        unknown = sorted(set(state) - {"live"})
        if unknown:
            raise ValueError(f"{self.name} state has unknown keys {unknown}")
        self._live = {str(k): float(v) for k, v in state.get("live", {}).items()}

    def _note_live(self, name: str, view: tuple[int, ...], rows: torch.Tensor | None) -> None:
        """Refill: the share of ``name``'s rows carried this call (at least one row's)."""
        if self.refill and view[0]:
            carried = view[0] if rows is None else max(1, rows.shape[0])
            self._live[name] = carried / view[0]

    def _payload(self, tensor: torch.Tensor, name: str, view: tuple[int, ...],
                 positions: torch.Tensor, values: torch.Tensor, nonfinite: bool,
                 rows: torch.Tensor | None) -> Payload:
        """``rows``: the rows of the view carried, where the others selected only zeros."""
        self._note_live(name, view, rows)
        return Payload("fibre", tuple(tensor.shape), tensor.dtype, values,
                       positions.to(index_dtype(view[1])), view=view, rows=rows, nonfinite=nonfinite)


class ADTopkInterleaved(ADTopk):
    """ADTopk-I: per layer, even calls use ADTopk and odd calls global top-k.

    The counter is the layer's own, so layers that skip a step (or are
    compressed more than once per step) still alternate.
    """

    name = "adtopk-i"
    # each call takes its own turn: a batch is one call each, in order
    start, start_with_feedback = Compressor.start, Compressor.start_with_feedback

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
