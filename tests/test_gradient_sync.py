"""GradientSync's set-up refusals, the pending-result protocol both transports follow, the
non-finite guard through it, and GradientCompression's figures without I/O. (The averaging
itself runs on real clusters: test_torch_api.py, test_parallel.py, test_ddp_hook.py.)"""
from __future__ import annotations

import types

import pytest
import torch

from adtopk_ps.client.handle import Handle
from adtopk_ps.torch.dense_lane import Reduction
from adtopk_ps.torch.gradient_compression import Figures, GradientCompression
from adtopk_ps.torch.gradient_sync import GradientSync, for_wrapper
from adtopk_ps.torch.nonfinite import NonFiniteGradient, NonFiniteGuard
from adtopk_ps.torch.pending import Pending


def params(*names: str) -> list[tuple[str, torch.Tensor]]:
    return [(name, torch.nn.Parameter(torch.zeros(3))) for name in names]


@pytest.mark.parametrize("named, settings, message", [
    (params("a", "b", "a"), {}, r"named twice: \['a'\]"),
    (params("a"), {"backward_passes_per_step": 0}, "backward_passes_per_step must be an integer >= 1"),
    (params("a"), {"backward_passes_per_step": True}, "must be an integer >= 1, got True"),
    (params("a"), {"overlap": "sometimes"}, "overlap must be True, False or 'auto'"),
])
def test_bad_settings_are_refused_before_anything_is_pushed(named, settings, message):
    # no cluster here: a refusal that came after the start-up agreement would fail on the client
    with pytest.raises(ValueError, match=message):
        GradientSync(named, GradientCompression(), NonFiniteGuard(), **settings)


def test_a_wrapper_of_a_model_without_trainable_parameters_is_refused_by_name():
    with pytest.raises(ValueError, match="ddp: the model has no parameters that require gradients"):
        for_wrapper("ddp", [], None)


def test_both_transports_follow_the_pending_protocol():
    owner = types.SimpleNamespace(size=2, timeout=1.0, engine=None)
    handle = Handle(owner, "w", torch.zeros(2), 1, True)
    lane = types.SimpleNamespace(find_flagging=lambda local: [[1] if local[0] else []])
    reduction = Reduction("b", torch.tensor([1.0, float("nan")]), lane)
    assert isinstance(handle, Pending) and isinstance(reduction, Pending)
    assert not handle.nonfinite and handle.flagging_ranks() == []
    handle.flagged.update({3, 1})
    assert handle.nonfinite and handle.flagging_ranks() == [1, 3]
    assert reduction.flagging_ranks() == [1]  # its own part held the NaN


class _Answered:
    """A pending average already in, as either transport leaves one."""

    def __init__(self, name: str, ranks: list[int] | None):
        self.name, self._ranks = name, ranks

    def wait(self, timeout=None) -> torch.Tensor:
        return torch.zeros(1)

    @property
    def nonfinite(self) -> bool:
        return self._ranks is not None

    def flagging_ranks(self) -> list[int]:
        return list(self._ranks)


def test_the_guard_reads_any_pending_average_alike():
    waited = [("a", _Answered("a", None)), ("fused.0", _Answered("fused.0", [0, 2])),
              ("b", _Answered("b", []))]
    assert all(isinstance(p, Pending) for _, p in waited)
    guard = NonFiniteGuard("stop")
    with pytest.raises(NonFiniteGradient) as err:
        guard.inspect(waited, 7, 1, lambda name: ["x", "y"] if name == "fused.0" else [])
    message = str(err.value)
    assert "at step 7" in message and "'fused.0' (holding x, y) from worker(s) [0, 2]" in message
    assert "'b' from no single worker (the sum overflowed)" in message and "'a'" not in message
    skipping = NonFiniteGuard("skip")
    skipping.inspect(waited, 8, 1, lambda name: [])
    assert skipping.found == {"fused.0": [0, 2], "b": []}


def test_calibrate_takes_figures_and_does_no_io():
    # no client exists in this process: the figures alone decide
    compression = GradientCompression("adtopk", measure_costs=True, dense_transport="auto")
    assert compression.wants_figures
    costs = compression.calibrate(Figures(link_s=0.02, ring_s=0.01, compress_s_per_element=1e-9,
                                          key_s=1e-4, probe_bytes=1 << 20), workers=4, fusion=4096)
    assert compression.allreduce  # the ring was faster
    assert costs.bytes_per_s == pytest.approx(2 * (1 << 20) / 0.02)
    assert costs.dense_bytes_per_s == pytest.approx(2 * (1 << 20) / 0.01)
    assert costs.workers == 4 and costs.fusion_bytes == 4096 and compression.policy.cost_model is costs
    slower_ring = GradientCompression("adtopk", dense_transport="auto")
    assert slower_ring.wants_figures  # "auto" wants them without the cost model
    slower_ring.calibrate(Figures(0.01, 0.02, 1e-9, 1e-4, 1 << 20), workers=4)
    assert not slower_ring.allreduce and slower_ring.costs.dense_bytes_per_s == 0.0
    assert slower_ring.policy.cost_model is None  # routes by the policy alone
    no_group = GradientCompression("adtopk", dense_transport="auto")
    no_group.calibrate(Figures(0.01, 0.0, 1e-9, 1e-4, 1 << 20), workers=4)
    assert not no_group.allreduce and no_group.allreduce_bytes_per_s == 0.0
    assert not GradientCompression("adtopk").wants_figures


def test_gradient_compression_of_keeps_one_and_makes_the_rest():
    mine = GradientCompression("topk")
    assert GradientCompression.of(mine) is mine
    assert GradientCompression.of(None).compressor is None
    assert GradientCompression.of({"compressor": "adtopk", "k": 0.05}).compressor.base.ratio == 0.05
    with pytest.raises(ValueError, match="dense_transport must be one of"):
        GradientCompression(dense_transport="carrier pigeon")
