"""Threshold-estimated global top-k with an adaptive refresh interval per layer.

An exact top-k every ``tau`` calls (and on every call of a warm-up) sets the
layer's threshold ``t = min |topk|``; in between, ``|g| > t`` is selected
without sorting. ``tau`` grows by one while the threshold is stable
(``|dt| < t / 10``) and halves (down to ``tau_min``) when it moves.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from adtopk_ps.compression.base import Compressor, flat_of, global_k
from adtopk_ps.compression.select import above, global_topk
from adtopk_ps.core.payload import Payload


@dataclass
class LayerThreshold:
    """One tensor's threshold and how often it is refreshed from an exact top-k."""

    threshold: float = 0.0
    tau: int = 5
    since_refresh: int = 0
    calls: int = 0
    refreshes: int = 0


class Threshold(Compressor):
    """Sends |g| above a per-layer threshold, refreshed from an exact top-k every ``tau`` calls."""

    name = "threshold"

    def __init__(self, ratio: float = 0.01, warmup: int = 15, tau: int = 5, tau_min: int = 5,
                 value_dtype: str | None = None):
        super().__init__(ratio, value_dtype)
        for what, v in (("warmup", warmup), ("tau", tau), ("tau_min", tau_min)):
            if isinstance(v, bool) or not isinstance(v, int) or v < (0 if what == "warmup" else 1):
                raise ValueError(f"{what} must be a {'non-negative' if what == 'warmup' else 'positive'} "
                                 f"integer, got {v!r}")
        self.warmup, self.tau, self.tau_min = warmup, max(tau, tau_min), tau_min
        self.layers: dict[str, LayerThreshold] = {}

    def compress(self, tensor: torch.Tensor, name: str, step: int = 0,
                 ratio: float | None = None) -> Payload:
        """A ``coo`` payload of the entries over this tensor's threshold."""
        flat = flat_of(tensor)
        layer = self.layers.setdefault(name, LayerThreshold(tau=self.tau))
        layer.calls += 1
        if layer.calls <= self.warmup or layer.since_refresh + 1 >= layer.tau or layer.refreshes == 0:
            positions = global_topk(flat, global_k(flat.numel(), self._ratio(ratio)))
            threshold = float(flat[positions].abs().min()) if positions.numel() else 0.0
            if math.isfinite(threshold):  # a NaN or an infinity must not become the layer's
                self._refresh(layer, threshold)
        else:
            layer.since_refresh += 1
            positions = above(flat, layer.threshold)
        return self._coo(tensor, flat, positions)

    def _refresh(self, layer: LayerThreshold, threshold: float) -> None:
        if layer.refreshes:
            if abs(threshold - layer.threshold) < layer.threshold / 10:
                layer.tau += 1
            else:
                layer.tau = max(self.tau_min, layer.tau // 2)
        layer.threshold = threshold
        layer.since_refresh = 0
        layer.refreshes += 1

    def state_dict(self) -> dict:
        """Each tensor's threshold and ``tau``, for a checkpoint."""
        return {"layers": {name: asdict(s) for name, s in self.layers.items()}}

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` saved."""
        self.layers = {name: LayerThreshold(**s) for name, s in state.get("layers", {}).items()}
