"""Partial sparsification: what goes dense, and the budget mode's volume."""
import math

import pytest
import torch

from adtopk_ps.compression import SparsificationPolicy, fibre_k
from adtopk_ps.core.env import EnvError


def _model():
    return [("conv.weight", torch.zeros(64, 32, 3, 3)), ("conv.bias", torch.zeros(64)),
            ("fc.weight", torch.zeros(1000, 512)), ("fc.bias", torch.zeros(1000)),
            ("tiny.weight", torch.zeros(10, 10)), ("norm.weight", torch.zeros(512))]


def test_dense_for_one_dim_and_small_tensors():
    routes = SparsificationPolicy(0.01, environ={}).plan(_model())
    assert routes["conv.bias"].dense and routes["fc.bias"].dense and routes["norm.weight"].dense
    assert routes["tiny.weight"].dense  # 400 bytes < 65536
    assert not routes["conv.weight"].dense and not routes["fc.weight"].dense
    assert routes["fc.weight"].ratio == 0.01


def test_threshold_comes_from_the_environment():
    env = {"BYTEPS_MIN_COMPRESS_BYTES": "100"}
    policy = SparsificationPolicy(0.01, environ=env)
    assert policy.min_compress_bytes == 100
    assert not policy.route(torch.zeros(10, 10)).dense  # 400 bytes >= 100
    assert policy.route(torch.zeros(10, 10, dtype=torch.float16)).dense is False
    assert policy.route(torch.zeros(4, 4)).dense  # 64 bytes


@pytest.mark.parametrize("raw", ["lots", "-1"])
def test_bad_environment_value_names_the_variable(raw):
    with pytest.raises(EnvError, match="BYTEPS_MIN_COMPRESS_BYTES"):
        SparsificationPolicy(0.01, environ={"BYTEPS_MIN_COMPRESS_BYTES": raw})


def test_budget_mode_keeps_total_volume():
    model = _model()
    total = sum(t.numel() for _, t in model)
    policy = SparsificationPolicy(0.05, min_compress_bytes=65536, budget=True)
    routes = policy.plan(model)
    sent = sum(t.numel() if routes[n].dense else t.numel() * routes[n].ratio for n, t in model)
    assert math.isclose(sent, 0.05 * total, rel_tol=1e-9)
    assert policy.sparse_ratio < 0.05  # dense tensors took part of the budget


def test_budget_mode_refuses_a_budget_the_dense_tensors_exceed():
    with pytest.raises(ValueError, match="over the budget"):
        SparsificationPolicy(0.001, min_compress_bytes=65536, budget=True).plan(_model())


def test_route_ratio_drives_the_compressor():
    from adtopk_ps.compression import ADTopk
    policy = SparsificationPolicy(0.05, min_compress_bytes=0, budget=True)
    routes = policy.plan([("w", torch.zeros(100, 400)), ("b", torch.zeros(100))])
    p = ADTopk(0.05).compress(torch.randn(100, 400), "w", ratio=routes["w"].ratio)
    assert p.values.shape[1] == fibre_k(400, routes["w"].ratio) < fibre_k(400, 0.05)


def test_cost_model_sends_dense_where_sparsifying_does_not_pay():
    from adtopk_ps.compression import CostModel
    fast_link = CostModel(bytes_per_s=10e9, compress_s_per_element=5e-9, workers=2)
    slow_link = CostModel(bytes_per_s=100e6, compress_s_per_element=5e-9, workers=2)
    big = torch.zeros(4096, 4096)
    # 64 MB: dense 12.8 ms on the fast link, compression alone 84 ms: send it dense
    assert SparsificationPolicy(0.01, cost_model=fast_link).route(big).dense
    # on a slow link the 1.3 s of dense transfer dwarfs the compression
    assert not SparsificationPolicy(0.01, cost_model=slow_link).route(big).dense
    assert fast_link.sparse_pays(10**6, 4, 0.01) is False and slow_link.sparse_pays(10**6, 4, 0.01)


def test_a_key_of_its_own_is_charged_to_tensors_a_bucket_would_carry_dense():
    from adtopk_ps.compression import CostModel
    # 657 MB/s through the servers, 1.3 ns an element (an e2e run at 10 Gbit/s); a key 0.5 ms
    link = dict(bytes_per_s=657e6, compress_s_per_element=1.3e-9, workers=2)
    free, keyed = CostModel(**link), CostModel(**link, key_s=5e-4, fusion_bytes=4 << 20)
    conv = 64 * 64 * 3 * 3  # 147 KB: dense 0.45 ms, sparse 0.06 ms before its key
    assert free.sparse_pays(conv, 4, 0.01) and not keyed.sparse_pays(conv, 4, 0.01)
    assert keyed.sparse_pays(4 * conv, 4, 0.01)  # 590 KB: dense 1.8 ms, sparse 0.7 with its key
    # too big for a bucket, it is a key of its own either way: no charge
    assert CostModel(**link, key_s=1.0, fusion_bytes=4 << 20).sparse_pays(2 << 20, 4, 0.01)


def test_compression_speed_is_measured(device):
    """On the device named: the gradients' own, whose speed the routes depend on."""
    from adtopk_ps.compression import compression_speed, create

    class Where:  # adtopk, noting where it was asked to compress
        def __init__(self):
            self.inner, self.seen = create("adtopk", ratio=0.01), set()

        def compress(self, tensor, name, step=0, ratio=None):
            self.seen.add(tensor.device)
            return self.inner.compress(tensor, name, step, ratio)
    probe = Where()
    speed = compression_speed(probe, elements=1 << 16, device=device)
    assert 0 < speed < 1e-5  # seconds per element
    assert probe.seen == {torch.device(device.type, 0) if device.type == "cuda" else device}
