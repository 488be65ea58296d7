"""Error-feedback state: residuals carry over and survive a checkpoint."""
import io

import pytest
import torch

from adtopk_ps.compression import ErrorFeedback, TopK, create


def test_residual_carries_the_dropped_mass():
    ef = create("topk", ratio=0.1, ef="vanilla")
    g = torch.arange(1.0, 11.0)
    p = ef.compress(g, "w")
    assert p.values.tolist() == [10.0]
    r = ef.memory.residuals["w"]
    assert r[-1] == 0 and torch.equal(r[:-1], g[:-1])
    p2 = ef.compress(torch.zeros(10), "w")  # what was held back is sent next
    assert p2.values.tolist() == [9.0]


def test_state_round_trips_through_torch_save():
    ef = create({"compressor": "threshold", "k": 0.05, "ef": "vanilla"})
    grads = [torch.randn(40, 40) for _ in range(6)]
    for i, g in enumerate(grads[:3]):
        ef.compress(g, "w", i)
    buf = io.BytesIO()
    torch.save(ef.state_dict(), buf)
    buf.seek(0)
    restored = create({"compressor": "threshold", "k": 0.05, "ef": "vanilla"})
    restored.load_state_dict(torch.load(buf))
    for i, g in enumerate(grads[3:], 3):
        a, b = ef.compress(g, "w", i), restored.compress(g, "w", i)
        assert torch.equal(a.decompress(), b.decompress())
    assert torch.equal(ef.memory.residuals["w"], restored.memory.residuals["w"])


def test_residual_shape_mismatch_is_reported():
    ef = create("adtopk", ef="vanilla")
    ef.compress(torch.randn(8, 8), "w")
    try:
        ef.compress(torch.randn(8, 9), "w")
    except ValueError as e:
        assert "'w'" in str(e) and "(8, 8)" in str(e)
    else:
        raise AssertionError("mismatched residual accepted")


def test_forget_drops_a_tensors_residual_and_its_partitions_only():
    ef = create("topk", ratio=0.1, ef="vanilla")
    for name in ("w", "w#0", "w#1", "wide#0", "v#0"):
        ef.compress(torch.randn(10), name)
    ef.forget(["w", "v"])
    assert sorted(ef.memory.residuals) == ["wide#0"]
    plain = create("topk", ratio=0.1)
    plain.forget(["w"])  # no residuals to drop: nothing happens
    assert plain.compress(torch.arange(1.0, 11.0), "w").values.tolist() == [10.0]


def test_error_feedback_refuses_a_compressor_that_already_has_it():
    ef = ErrorFeedback(TopK(ratio=0.1))
    with pytest.raises(ValueError, match="already carries error feedback"):
        ErrorFeedback(ef)
    assert ErrorFeedback(ef.base).base is ef.base
