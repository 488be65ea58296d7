"""GradientCompression: which compressor a model's gradients get, and which tensors it gets.

A compressor, the policy that routes each tensor (sparse at some density, or
dense) and how dense tensors travel (through the servers, or all-reduced among
the workers). It does no I/O: :class:`~.gradient_sync.GradientSync` times the
links and the compressor and hands it the figures (:meth:`calibrate`).
"""
from __future__ import annotations

from typing import Iterable, Mapping, NamedTuple

import torch

from adtopk_ps.compression import Compressor, CostModel, Route, SparsificationPolicy
from adtopk_ps.torch.compressors import EveryTensor, compressor_of, is_cast

#: how tensors sent dense travel: through the servers, all-reduced among the workers
#: (:mod:`.dense_lane`), or whichever of the two measures faster at start-up
TRANSPORTS = ("ps", "allreduce", "auto")


def check_transport(transport: str) -> str:
    """``transport`` if it is one of :data:`TRANSPORTS`; anything else raises ``ValueError``."""
    if transport not in TRANSPORTS:
        raise ValueError(f"dense_transport must be one of {list(TRANSPORTS)}, got {transport!r}")
    return transport


class Figures(NamedTuple):
    """What the workers measured at start-up, averaged over them (seconds are the fastest of
    a few tries): a dense round trip of ``probe_bytes`` through the servers (``link_s``) and
    all-reduced among the workers (``ring_s``, 0 where there is no group), compression
    seconds per element, and a tiny key's round trip."""

    link_s: float
    ring_s: float
    compress_s_per_element: float
    key_s: float
    probe_bytes: int


class GradientCompression:
    """One compressor plus the policy that says which tensors it gets, and at what density.

    Example::

        compression = bps.GradientCompression(
            {"compressor": "adtopk", "k": 0.01, "ef": "vanilla"},
            SparsificationPolicy(0.01, min_compress_bytes=65536), dense_transport="auto")
        opt = bps.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                       compression=compression)
    """

    def __init__(self, compression: Compressor | str | Mapping | None = None,
                 policy: SparsificationPolicy | None = None, measure_costs: bool = False,
                 dense_transport: str = "ps"):
        """``measure_costs``: time the link and the compressor when the optimizer starts, and
        send dense every tensor for which sparsifying would not pay (:class:`CostModel`).
        ``dense_transport``: how tensors sent dense travel: through the servers (``"ps"``),
        all-reduced among the workers (``"allreduce"``, :mod:`.dense_lane`), or whichever of the
        two measures faster when the optimizer starts (``"auto"``)."""
        self.compressor = compressor_of(compression)
        ratio = self.compressor.ratio if self.compressor is not None else 1.0
        # a cast (Compression.fp16) goes to every tensor; a sparsifier where it pays
        self.policy = policy or (EveryTensor(ratio) if is_cast(self.compressor)
                                 else SparsificationPolicy(ratio))
        self.measure_costs = measure_costs and self.compressor is not None
        self.dense_transport = check_transport(dense_transport)
        self.allreduce = dense_transport == "allreduce"  # "auto" decides in calibrate()
        self.costs: CostModel | None = None  # what calibrate() was given
        self.allreduce_bytes_per_s = 0.0  # likewise, where the workers' all-reduce was timed
        self.routes: dict[str, Route] = {}

    @classmethod
    def of(cls, compression: object) -> GradientCompression:
        """``compression`` itself where it is one, else one made from it (a compressor, a
        name, a byteps-style dict, ``Compression.fp16``, None).

        Example::

            GradientCompression.of("adtopk").compressor   # ADTopk(ratio=0.01)
        """
        return compression if isinstance(compression, cls) else cls(compression)

    @property
    def wants_figures(self) -> bool:
        """Whether :meth:`calibrate` must be given measured figures before routes are planned."""
        return self.measure_costs or self.dense_transport == "auto"

    def calibrate(self, figures: Figures, workers: int, fusion: int = 0) -> CostModel:
        """Take the figures every worker measured (the same on each: their mean), decide
        ``dense_transport="auto"`` and, with ``measure_costs``, the cost model the policy
        routes by. ``fusion``: the bucket capacity in bytes."""
        if self.dense_transport == "auto":
            self.allreduce = 0 < figures.ring_s < figures.link_s
        moved = 2 * figures.probe_bytes
        self.allreduce_bytes_per_s = moved / figures.ring_s if figures.ring_s else 0.0
        self.costs = CostModel(moved / figures.link_s, figures.compress_s_per_element, workers,
                               key_s=figures.key_s, fusion_bytes=fusion,
                               dense_bytes_per_s=self.allreduce_bytes_per_s if self.allreduce else 0.0)
        if self.measure_costs:
            self.policy.cost_model = self.costs
        return self.costs

    def plan(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Route every named tensor (dense or sparse, and at what density) before the first push."""
        self.routes = self.policy.plan(named)

    def dense(self, name: str) -> bool:
        """Whether ``name`` travels dense."""
        return self.compressor is None or self.routes[name].dense

    def for_tensor(self, name: str) -> tuple[Compressor | None, float | None]:
        """The compressor and density for ``name``; ``(None, None)`` where it travels dense."""
        if self.dense(name):
            return None, None
        return self.compressor, self.routes[name].ratio

    def state_dict(self) -> dict:
        """The compressor's state (residuals, per-layer state) for a checkpoint."""
        return self.compressor.state_dict() if self.compressor is not None else {}

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` saved."""
        if self.compressor is not None:
            self.compressor.load_state_dict(state)
