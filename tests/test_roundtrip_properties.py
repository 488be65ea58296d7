"""Round trips for every compressor: decompression, error feedback, wire size."""
import pytest
import torch
from hypothesis import given, strategies as st

from adtopk_ps import wire
from adtopk_ps.compression import COMPRESSORS, ErrorFeedback, create
from adtopk_ps.compression.base import VALUE_DTYPES

from strategies import encoded_payload_bytes, gradients, ratios

SPARSE = sorted(n for n in COMPRESSORS if n != "none")
ALL = sorted(COMPRESSORS)


def _make(name, ratio, value_dtype=None):
    params = {} if name == "none" else {"ratio": ratio}
    return create(name, value_dtype=value_dtype, **params)


def _selected(p):
    """Flat positions a payload carries."""
    if p.codec == "dense":
        return torch.arange(p.numel)
    if p.codec == "fibre":
        flat = torch.arange(p.numel).view(p.view)
        if p.rows is not None:  # the rows carried; the others selected only zeros
            flat = flat[p.rows]
        return flat.gather(1, p.indices.long()).reshape(-1)
    return p.positions().reshape(-1)


@given(st.sampled_from(ALL), gradients(), ratios, st.integers(0, 5))
def test_decompress_keeps_exactly_the_selected_entries(name, x, ratio, step):
    comp = _make(name, ratio)
    p = comp.compress(x, "layer", step)
    d = comp.decompress(p)
    assert d.shape == x.shape and d.dtype == x.dtype and d.device == x.device
    pos = _selected(p)
    assert pos.unique().numel() == pos.numel()
    flat_d, flat_x = d.reshape(-1), x.reshape(-1)
    assert torch.equal(flat_d[pos], flat_x[pos])
    rest = torch.ones(flat_x.numel(), dtype=torch.bool)
    rest[pos] = False
    assert not bool(flat_d[rest].any())


@given(st.sampled_from(ALL), gradients(), ratios, st.sampled_from([None, "fp16"]),
       st.integers(1, 4))
def test_error_feedback_invariant_is_exact(name, x, ratio, value_dtype, steps):
    ef = ErrorFeedback(_make(name, ratio, value_dtype))
    residual = torch.zeros_like(x)
    for step in range(steps):
        grad = x * (step + 1) if step % 2 else -x
        compensated = grad + residual
        p = ef.compress(grad, "layer", step)
        residual = ef.memory.residuals["layer"]
        assert torch.equal(ef.decompress(p) + residual, compensated)


@given(st.sampled_from(ALL), gradients(), ratios, st.sampled_from([None, "fp16", "bf16"]))
def test_nbytes_is_the_encoded_size_and_frames_decode_back(name, x, ratio, value_dtype):
    comp = _make(name, ratio, value_dtype)
    p = comp.compress(x, "layer", 3)
    frames = wire.encode(wire.Op.PUSH, key=1, round=3, sender=0, payload=p)
    assert encoded_payload_bytes(frames) == wire.payload_nbytes(p)
    back = wire.decode([bytes(f) for f in frames]).payload
    assert torch.equal(back.decompress(), p.decompress())
    if value_dtype is not None:
        assert p.values.dtype == VALUE_DTYPES[value_dtype]


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_result_follows_input_dtype_and_device(name, dtype, device):
    x = torch.randn(32, 700, device=device).to(dtype)
    comp = _make(name, 0.01)
    p = comp.compress(x, "w", 0)
    assert p.values.device == x.device
    d = comp.decompress(p)
    assert (d.dtype, d.device, d.shape) == (dtype, x.device, x.shape)


def test_sparse_payloads_are_smaller_than_dense():
    x = torch.randn(256, 1024)
    dense = wire.payload_nbytes(_make("none", 1.0).compress(x, "w"))
    for name in SPARSE:
        assert wire.payload_nbytes(_make(name, 0.01).compress(x, "w")) < dense / 20, name


def test_adtopk_indices_are_narrower_than_global_topk():
    x = torch.randn(512, 256)
    a = _make("adtopk", 0.01).compress(x, "w")
    t = _make("topk", 0.01).compress(x, "w")
    assert a.indices.element_size() == 1 and t.indices.element_size() == 4


@pytest.mark.parametrize("value_dtype", [None, "fp16"])
def test_rows_that_select_only_zeros_on_the_wire_are_left_out_and_kept_in_the_residual(value_dtype):
    """A row whose selected values are zero as sent (a dead unit, or magnitudes below fp16's
    smallest) costs no bytes; error feedback keeps what it held, and the next step of a live
    row sends it."""
    x = torch.randn(16, 256, generator=torch.Generator().manual_seed(5))
    x[[2, 9]] = 0
    x[12] = 1e-9  # zero in fp16
    ef = ErrorFeedback(_make("adtopk", 0.02, value_dtype))
    p = ef.compress(x, "w", 0)
    dead = [2, 9, 12] if value_dtype else [2, 9]
    assert p.rows.tolist() == [r for r in range(16) if r not in dead]
    back = wire.decode([bytes(f) for f in wire.encode(wire.Op.PUSH, key=1, payload=p)]).payload
    assert torch.equal(back.decompress(), p.decompress())
    assert torch.equal(ef.decompress(p) + ef.memory.residuals["w"], x)
    full = _make("adtopk", 0.02, value_dtype).compress(x + 1, "w", 0)  # no row of zeros
    assert full.rows is None and p.count * 16 == full.count * (16 - len(dead))
    assert wire.payload_nbytes(p) < wire.payload_nbytes(full)
