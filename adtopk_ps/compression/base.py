"""What every compressor shares: parameters, value casting, payload assembly."""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch

from adtopk_ps.compression.select import all_finite, fibre_topk_feedback
from adtopk_ps.core.dtypes import FLOAT_DTYPES, index_dtype
from adtopk_ps.core.payload import Payload

#: what ``value_dtype`` may name: the 16-bit wire dtypes, by their wire names or short aliases,
#: or None for the tensor's own dtype
VALUE_DTYPES: dict[str | None, torch.dtype | None] = {
    None: None,
    **{alias: FLOAT_DTYPES[name] for alias, name in (("fp16", "float16"), ("float16", "float16"),
                                                     ("bf16", "bfloat16"), ("bfloat16", "bfloat16"))},
}


def check_ratio(ratio: object, what: str = "ratio") -> float:
    """``ratio`` as a float in (0, 1]; anything else raises ``ValueError`` naming ``what``."""
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
        raise ValueError(f"{what} must be a number in (0, 1], got {ratio!r}")
    return float(ratio)


@dataclass(frozen=True)
class Request:
    """One tensor of a batch that :meth:`Compressor.start` compresses: the arguments of one
    :meth:`Compressor.compress` call."""
    tensor: torch.Tensor
    name: str
    step: int = 0
    ratio: float | None = None


def distinct(requests: list[Request]) -> None:
    """Refuse a batch that names a tensor twice: two rounds of one tensor are two batches
    (a second call would overwrite the first's staging and read its residual)."""
    names = [r.name for r in requests]
    if len(set(names)) < len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"a batch names {twice} more than once; compress each round of a "
                         f"tensor in a batch of its own")


def start_each(calls: list[tuple["Compressor", Request]]) -> Iterator[Payload]:
    """The payloads of ``calls`` in their order, each compressor handed all of its requests
    in one :meth:`Compressor.start` (started here, before this returns).

    Example::

        payloads = start_each([(sparse, Request(g1, "fc.weight")), (dense, Request(b1, "fc.bias"))])
        for payload in payloads:
            send(payload)
    """
    batches: dict[int, tuple[Compressor, list[Request]]] = {}
    for compressor, request in calls:
        batches.setdefault(id(compressor), (compressor, []))[1].append(request)
    started = {which: compressor.start(requests) for which, (compressor, requests) in batches.items()}
    return (next(started[id(compressor)]) for compressor, _ in calls)


class Compressor(ABC):
    """Turns one tensor into a :class:`Payload` and back (GRACE's "compressor").

    ``name`` identifies the tensor (per-layer state is keyed by it) and
    ``step`` the training step (for schedules and shared seeds). ``ratio``
    overrides the configured density for one call, which is how the
    partial-sparsification policy raises density per layer.

    A subclass implements :meth:`compress`; one whose selection can fold
    error feedback into the same pass also implements
    :meth:`compress_with_feedback`. What was not sent is kept by
    :class:`~adtopk_ps.compression.memory.ErrorFeedback`, not here.

    Example::

        class Largest(Compressor):            # global top-k, in brief
            name = "largest"

            def compress(self, tensor, name, step=0, ratio=None):
                flat = tensor.detach().reshape(-1)
                k = global_k(flat.numel(), self._ratio(ratio))
                positions = flat.abs().topk(k).indices
                return Payload("coo", tuple(tensor.shape), tensor.dtype, flat[positions], positions)

        comp = ErrorFeedback(Largest(ratio=0.01))  # what was not sent waits for the next call
    """

    name: str = ""
    sparse: bool = True
    ef: str = "none"  # the error feedback it carries, as ``create(ef=...)`` spells it

    def __init__(self, ratio: float = 0.01, value_dtype: str | None = None):
        self.ratio = check_ratio(ratio)
        if value_dtype not in VALUE_DTYPES:
            valid = [v for v in VALUE_DTYPES if v is not None]
            raise ValueError(f"value_dtype must be one of {valid} or None, got {value_dtype!r}")
        self.value_dtype = VALUE_DTYPES[value_dtype]

    @property
    def base(self) -> "Compressor":
        """The compressor that chooses what is sent: this one; a wrapper returns the one it wraps
        (error feedback's residuals are then left out, as a speed probe wants)."""
        return self

    def accepts(self, tensor: torch.Tensor) -> bool:
        """Whether :meth:`compress` takes ``tensor``'s shape (ADTopk needs two dimensions)."""
        return True

    @abstractmethod
    def compress(self, tensor: torch.Tensor, name: str, step: int = 0,
                 ratio: float | None = None) -> Payload:
        """The payload to send for ``tensor``, which is left unchanged.

        The payload has ``tensor``'s shape and dtype and lives on its device;
        ``decompress`` of it is the dense tensor the receiver adds.
        ``ratio`` overrides the configured density for this call.
        """
        ...

    def compress_with_feedback(self, tensor: torch.Tensor, residual: torch.Tensor, name: str,
                               step: int = 0, ratio: float | None = None) -> Payload | None:
        """Error feedback fused into the selection: the payload of ``tensor + residual``.

        An implementation leaves ``residual`` (same shape, dtype and device as
        ``tensor``) holding ``tensor + residual - decompress(payload)``, in
        place. None, with ``residual`` unchanged, means no fused path for this
        call: the caller compensates and calls :meth:`compress` itself. None
        here, for compressors that have no such path.
        """
        return None

    def start(self, requests: list[Request]) -> Iterator[Payload]:
        """The payloads of tensors ready at once, in order: one :meth:`compress` each, made
        when the caller asks for it (the engine sends each as it comes). A compressor that
        selects a batch in one pass (ADTopk's CUDA kernel) starts it here, before returning.

        Example::

            for payload in comp.start([Request(g1, "fc1.weight"), Request(g2, "fc2.weight")]):
                send(payload)
        """
        distinct(requests)
        return (self.compress(r.tensor, r.name, r.step, r.ratio) for r in requests)

    def start_with_feedback(self, requests: list[Request],
                            residuals: list[torch.Tensor]) -> Iterator[Payload | None]:
        """:meth:`start` with error feedback fused in, each request with its residual (see
        :meth:`compress_with_feedback`: None where there is no fused path)."""
        distinct(requests)
        return (self.compress_with_feedback(r.tensor, residual, r.name, r.step, r.ratio)
                for r, residual in zip(requests, residuals))

    def decompress(self, payload: Payload) -> torch.Tensor:
        """A dense tensor of the payload's shape, dtype and device: zeros where nothing was sent."""
        return payload.decompress()

    def restore(self, answer: torch.Tensor, name: str) -> None:
        """Undo, in place, what :meth:`compress` did to the values of the tensor called
        ``name`` once its answer has landed in ``answer`` (the engine calls this); nothing
        here: payload decoding restores every built-in codec."""

    def forget(self, names: Iterable[str]) -> None:
        """Drop the residual state kept for these tensor names, used when a NaN or an
        infinity was sent (a residual that took one would send it again); nothing here,
        for compressors that keep no residuals."""

    def state_dict(self) -> dict:
        """Per-layer state worth a checkpoint; stateless compressors have none."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` saved; stateless compressors refuse any state."""
        if state:
            raise ValueError(f"{self.name} keeps no state, got keys {sorted(state)}")

    def _ratio(self, ratio: float | None) -> float:
        return self.ratio if ratio is None else check_ratio(ratio)

    def _values(self, values: torch.Tensor) -> torch.Tensor:
        if self.value_dtype is None or values.dtype == self.value_dtype:
            return values
        if self.value_dtype == torch.float16:  # keep magnitudes finite; error feedback keeps the rest
            limit = torch.finfo(torch.float16).max
            values = values.clamp(-limit, limit)
        return values.to(self.value_dtype)

    def _coo(self, tensor: torch.Tensor, flat: torch.Tensor, positions: torch.Tensor) -> Payload:
        """The payload of the selected ``positions``; a selection that takes every NaN and
        infinity first (as top-k does) shows one, if there is any, among its values."""
        selected = flat[positions]
        return _coo_payload(tensor, self._values(selected), positions, not all_finite(selected))

    def _coo_with_feedback(self, tensor: torch.Tensor, residual: torch.Tensor,
                           ratio: float | None) -> Payload | None:
        """Global top-k with error feedback's compensate and update in the kernel's one pass
        (the whole tensor as one fibre); None, with nothing changed, where it does not apply."""
        if self.value_dtype not in (None, tensor.dtype) or not residual.is_contiguous():
            return None
        n = tensor.numel()
        found = fibre_topk_feedback(residual.view(1, n), tensor.detach().reshape(1, n),
                                    global_k(n, self._ratio(ratio)))
        if found is None:
            return None
        positions, values, _ = found
        return _coo_payload(tensor, values.view(-1), positions.view(-1), not all_finite(values))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(ratio={self.ratio})"


def _coo_payload(tensor: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                 nonfinite: bool) -> Payload:
    """Flat positions travel in the narrowest type that holds the tensor's size."""
    return Payload("coo", tuple(tensor.shape), tensor.dtype, values,
                   positions.to(index_dtype(tensor.numel())), nonfinite=nonfinite)


def global_k(numel: int, ratio: float) -> int:
    """Element budget of a global selection."""
    return min(numel, max(1, math.floor(numel * ratio)))


def flat_of(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as one flat view (a copy only where it is not contiguous)."""
    return tensor.detach().reshape(-1)
