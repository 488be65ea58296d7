"""The scale study's step model (benchmarks/step_model.py) and its projection
(benchmarks/scale_projection.py): the fit finds the constants that made a set of steps and
predicts runs it was not fit on, DDP's ring hides behind backward, answers turn dense past
half a tensor, servers beside the workers carry the all-reduce's bytes, and the placement
code balances the projected models' keys."""
import argparse
import dataclasses
import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("step_model", ROOT / "benchmarks" / "step_model.py")
step_model = importlib.util.module_from_spec(spec)
sys.modules["step_model"] = step_model
spec.loader.exec_module(step_model)
import scale_projection  # noqa: E402  (step_model put benchmarks/ on the path)

PARAMS = 1_000_000
DENSE_SHARE = 0.01


KEYS = {"ps-adtopk+256k-keys": 63}  # the others: 17


def record(system: str, w: int, s: int, width: float, truth, link: str, shaper: str = "netem") -> dict:
    """A run whose step is what the model says for ``truth``'s constants."""
    push = 80_000.0
    sparse = round(PARAMS * (1 - DENSE_SHARE))
    answer = 40_000 + step_model.COO_BYTES * width * sparse
    servers = {str(j): 1 / s for j in range(s)}
    rec = {"system": system, "workers": w, "servers": s, "compute_s": 0.02 * (1 + w / 8),
           "compress_s": 0.005, "params": PARAMS, "step_s": 0.0, "shaper": shaper, "link": link,
           "cores": 2, "model": "vgg-1024", "keys": KEYS.get(system, 17)}
    if system != "ddp-dense":
        rec.update(pushed_per_step={j: push * f for j, f in servers.items()},
                   pulled_per_step={j: answer * f for j, f in servers.items()},
                   answer_density=width, dense=[3, 10, DENSE_SHARE])
    rec["step_s"] = step_model.predict(step_model.Run.of(rec), truth)
    return rec


def synthetic(truth, link: str, shaper: str = "netem") -> list[dict]:
    widths = {"ps-topk": {2: 0.019, 4: 0.03, 8: 0.047}, "ps-adtopk": {2: 0.012, 4: 0.02, 8: 0.03},
              "ps-adtopk+server-topk": {2: 0.01, 4: 0.01, 8: 0.01},
              "ps-adtopk+256k-keys": {2: 0.012, 4: 0.02, 8: 0.03}}
    out = [record("ddp-dense", w, 1, 0, truth, link, shaper) for w in (2, 4, 8)]
    for system, by_w in widths.items():
        out += [record(system, w, s, width, truth, link, shaper) for w, width in by_w.items()
                for s in (1, 2, 4)]
    return out


def constants(**kw):
    values = dict(sigma=0.0, mu=0.0, kappa=0.0, rho=0.0, tau=0.0, chi=0.0, tau_ring=0.0)
    return step_model.Constants(**{**values, **kw})


@pytest.mark.parametrize("truth", [
    constants(sigma=1e-9, kappa=2e-9, rho=1e-9, tau=0.004, chi=3e-4),
    constants(kappa=9e-9, rho=1e-9, tau=0.0035, chi=4e-4),
    constants(sigma=3e-9, kappa=1e-9, tau=0.008, chi=1e-4)])
@pytest.mark.parametrize("shaper", ["netem", "tbf"])
def test_the_fit_on_w2_predicts_every_run_that_the_same_constants_made(truth, shaper):
    # both links: the slow one's steps are the link's, the fast one's show the CPU's terms
    runs = [step_model.Run.of(r) for link in ("100mbit", "1gbit") for r in synthetic(truth, link, shaper)]
    fitted = step_model.fit(runs)
    for run in runs:  # W=4 and 8 were not in the fit
        assert step_model.predict(run, fitted) == pytest.approx(run.step, rel=0.02)


def test_pushes_and_answers_overlap_the_workers_cpu_and_a_tbf_bucket_sends_its_burst_at_once():
    rate = step_model.rate_of("100mbit")
    nothing = constants()
    rec = record("ps-adtopk", 4, 1, 0.02, nothing, "100mbit", "netem")
    run = step_model.Run.of(rec)
    # four workers into one server: its link in (4 x 80 kB) and out (4 answers) overlap
    answer = 40_000 + 8 * 0.02 * round(PARAMS * (1 - DENSE_SHARE))
    link = max(4 * 80_000, 4 * answer) / rate
    assert run.step == pytest.approx(run.compute + run.compress + link + 2 * step_model.NETEM_HOP_S)
    # the worker's keys and decoding hide behind the link until they outlast it
    busy = constants(chi=link / 17 / 2)
    assert step_model.predict(run, busy) == pytest.approx(run.step)
    slow = constants(chi=2 * link / 17)
    assert step_model.predict(run, slow) == pytest.approx(run.step - link + 2 * link)
    tbf = step_model.Run.of({**rec, "shaper": "tbf"})
    free = min(step_model.TBF_BURST_BYTES, rate * (run.compute + run.compress))
    assert step_model.predict(tbf, nothing) == pytest.approx(
        run.compute + run.compress + (4 * answer - free) / rate)


def test_a_rate_is_the_links_less_its_headers():
    assert step_model.rate_of("1gbit") == pytest.approx(125e6 * 1448 / 1514)
    assert step_model.rate_of("500mbit") == pytest.approx(step_model.rate_of("1gbit") / 2)
    with pytest.raises(ValueError, match="1gbyte"):
        step_model.rate_of("1gbyte")


def test_ddps_ring_hides_behind_backward_most_for_vgg16_whose_bytes_are_ready_first():
    rate, hop = step_model.rate_of("10gbit"), 25e-6
    hidden = {}
    for model in ("vgg16", "bert-base"):
        tensors = scale_projection.layer_profile.tensors(model)
        params = sum(t.numel for t in tensors)
        after = 2 * 63 / 64 * 4 * params / rate  # the whole ring after backward
        step = step_model.ring_step(tensors, 0.1, 64, rate, hop)
        assert 0.1 < step < 0.1 + after + 2 * 63 * hop * 30
        hidden[model] = 1 - (step - 0.1) / after
    # VGG-16's classifier, most of its bytes, is differentiated first; BERT-base's word
    # embedding, a fifth of its bytes, last
    assert hidden["vgg16"] > hidden["bert-base"] > 0
    # with no compute there is nothing to hide behind: the buckets back to back
    tensors = scale_projection.layer_profile.tensors("resnet50")
    bare = step_model.ring_step(tensors, 0.0, 8, rate, 0.0)
    assert bare == pytest.approx(2 * 7 / 8 * 4 * sum(t.numel for t in tensors) / rate)


def test_an_answer_goes_dense_past_half_a_tensor_and_grows_along_the_union_curve():
    wl = scale_projection.Workload("x", 0.02, 0.001, 80_000, 1_000, 1_000_000, 0.01, 1_001_000, 0.01)
    assert scale_projection.answer_bytes(wl, 0.1) == 1_000 + 8 * 0.1 * 1_000_000
    assert scale_projection.answer_bytes(wl, 0.6) == scale_projection.answer_bytes(wl, 0.9) == 1_000 + 4_000_000
    growth = {1: 0.005, 2: 0.01, 64: 0.08}
    assert scale_projection.width_at(wl, 64, growth) == pytest.approx(0.16)  # 0.01 * 0.08 / 0.005
    assert scale_projection.width_at(wl, 64, growth, cap=2.0) == pytest.approx(0.02)
    assert scale_projection.width_at(wl, 2, growth, cap=2.0) == pytest.approx(0.02)
    assert not step_model.resparsifies(step_model.WIDER, 2) and step_model.resparsifies(step_model.WIDER, 4)
    assert step_model.resparsifies(step_model.RESPARSIFIED, 2)


def test_servers_beside_the_workers_carry_the_all_reduces_bytes_and_the_placement_balances_them():
    c = constants()
    rate = step_model.rate_of("10gbit")
    wl = scale_projection.workload("resnet50", 0.01, 32, 30e12)
    keys, share, _ = scale_projection.placed("resnet50", 0.01, 64)
    assert share <= 1.10 / 64 and keys > 64  # the placement code's own, cut finer for 64
    # dense answers both ways (width past half): each host sends about 2 (W-1)/W of it
    step = scale_projection.project_ps(wl, c, 64, 64, rate, 0.6)
    answer = scale_projection.answer_bytes(wl, 0.6)
    assert step.link == pytest.approx((wl.push + 63 * answer * share) / rate, rel=0.02)
    assert 63 / 64 * (wl.push + answer) / rate <= step.link <= 1.1 * 63 / 64 * (wl.push + answer) / rate
    # servers apart carry W answers each, and are never more than W
    apart = scale_projection.project_apart(wl, constants(tau=0.001), 64, rate, 0.05)
    assert 1 <= apart.servers <= 64
    # one message a server instead of one a key: less of chi's cost, never more
    costly = constants(chi=4e-4)
    assert scale_projection.project_ps(wl, costly, 64, 64, rate, 0.05, batched=True).total < \
        scale_projection.project_ps(wl, costly, 64, 64, rate, 0.05).total


def test_the_report_says_where_the_cpu_saturated_and_projects_every_point(tmp_path, monkeypatch):
    truth = constants(sigma=1e-9, kappa=2e-9, rho=1e-9, tau=0.004, chi=3e-4, tau_ring=0.007)
    records = synthetic(truth, "100mbit", "tbf") + synthetic(truth, "1gbit", "tbf")
    union = {"0.01": {"topk": {"1": 0.01, "2": 0.0175, "8": 0.047, "16": 0.066, "32": 0.087,
                               "64": 0.107, "128": 0.133, "256": 0.155},
                      "adtopk": {"1": 0.005, "2": 0.0097, "8": 0.027, "16": 0.042, "32": 0.06,
                                 "64": 0.08, "128": 0.106, "256": 0.132}}}
    (tmp_path / "union.json").write_text(json.dumps(union))
    monkeypatch.setattr(scale_projection, "MODELS", ("resnet50",))  # the report's size, not its logic
    monkeypatch.setattr(scale_projection, "PROJECT_WORKERS", [8, 64])
    args = argparse.Namespace(results=str(tmp_path), model="vgg-1024", batch=8, ratio=0.01,
                              union=str(tmp_path / "union.json"), out=str(tmp_path),
                              loadgen=str(tmp_path / "none.json"), gpu_batch=32, gpu_tflops=30e12)
    text = step_model.report(records, args)
    found = re.findall(r"^(Not saturated|Saturated): within 15% at (\d+) of (\d+) points", text, re.M)
    assert sum(int(n) for _, n, _ in found) == 2 * 39  # DDP at 3 W, 4 PS systems at 3 W x 3 S
    assert all(n == m for _, n, m in found)
    assert "No figures yet" in text
    for gbit in scale_projection.PROJECT_LINKS_GBIT:
        for w in (8, 64):
            row = re.search(rf"^\| {gbit} \| {w} \| [\d.]+ \| \d+ \| (.*) \| ([\w ,:()]+) \|$", text, re.M)
            assert row and row.group(2).strip() in scale_projection.ASKED, (gbit, w)
    assert (tmp_path / "scale-model.png").stat().st_size > 10_000
