"""Per-layer schedules: ADTopk-I alternation and the threshold compressor's refreshes."""
import torch

from adtopk_ps.compression import ADTopkInterleaved, Threshold, create


def test_interleaving_alternates_per_layer():
    comp = ADTopkInterleaved(0.05)
    a, b = torch.randn(16, 64), torch.randn(8, 32, 3, 3)
    codecs = {"a": [], "b": []}
    # layer b is compressed half as often as a; each keeps its own turn
    for step in range(6):
        codecs["a"].append(comp.compress(a, "a", step).codec)
        if step % 2 == 0:
            codecs["b"].append(comp.compress(b, "b", step).codec)
    assert codecs["a"] == ["fibre", "coo"] * 3
    assert codecs["b"] == ["fibre", "coo", "fibre"]
    odd = comp.compress(b, "b", 99)  # the global step does not matter, the layer's turn does
    assert odd.codec == "coo" and odd.count == max(1, int(b.numel() * 0.05))


def test_interleaving_turns_survive_a_checkpoint():
    comp = ADTopkInterleaved(0.05)
    x = torch.randn(16, 64)
    comp.compress(x, "a")
    again = ADTopkInterleaved(0.05)
    again.load_state_dict(comp.state_dict())
    assert again.compress(x, "a").codec == comp.compress(x, "a").codec == "coo"


def _exact_refreshes(comp, grads, name="w"):
    """Calls (1-based) at which the layer ran an exact top-k."""
    calls = []
    for i, g in enumerate(grads, 1):
        before = comp.layers[name].refreshes if name in comp.layers else 0
        comp.compress(g, name, i)
        if comp.layers[name].refreshes > before:
            calls.append(i)
    return calls


def test_threshold_refreshes_on_schedule_and_tau_adapts():
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(64, 64, generator=gen)
    # stable magnitudes: every refresh (warm-up ones too) grows tau by one,
    # so after warm-up calls 1-3 tau is 7, then 8, then 9
    comp = Threshold(0.05, warmup=3, tau=5, tau_min=5)
    calls = _exact_refreshes(comp, [base * (1 + 0.001 * i) for i in range(40)])
    assert calls[:3] == [1, 2, 3]
    gaps = [b - a for a, b in zip(calls[2:], calls[3:])]
    assert gaps[:3] == [7, 8, 9], calls
    # a jump in magnitude at call 13 (a refresh) moves the threshold: tau
    # halves from 12 to 6, then grows again while the threshold is stable
    comp2 = Threshold(0.05, warmup=1, tau=12, tau_min=5)
    calls2 = _exact_refreshes(comp2, [base] * 12 + [base * 50] * 30)
    assert calls2[:4] == [1, 13, 19, 26]
    # and halving never goes below the floor
    comp3 = Threshold(0.05, warmup=1, tau=6, tau_min=5)
    _exact_refreshes(comp3, [base * 10 ** (i // 6 % 2 * 2) for i in range(30)])
    assert comp3.layers["w"].tau == 5


def test_threshold_compares_magnitudes_not_signed_values():
    comp = Threshold(0.01, warmup=1, tau=10)
    g = torch.zeros(100, 100)
    g[0, :100] = 1.0
    comp.compress(g, "w")  # exact: sets t = 1.0 (min of the top 100)
    neg = torch.zeros(100, 100)
    neg[5, :10] = -3.0  # only large negative entries, all above t in magnitude
    p = comp.compress(neg, "w")
    assert comp.layers["w"].refreshes == 1  # this call used the threshold
    assert p.count == 10 and bool((p.values == -3.0).all())


def test_threshold_layers_are_independent_and_checkpointed():
    comp = Threshold(0.05, warmup=2, tau=5)
    for i in range(4):
        comp.compress(torch.randn(32, 32), "a", i)
    comp.compress(torch.randn(32, 32) * 10, "b", 0)
    assert comp.layers["a"].calls == 4 and comp.layers["b"].calls == 1
    assert comp.layers["a"].threshold != comp.layers["b"].threshold
    again = create("threshold", ratio=0.05, warmup=2, tau=5)
    again.load_state_dict(comp.state_dict())
    assert again.layers == comp.layers
