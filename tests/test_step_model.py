"""The scale study's step model (benchmarks/step_model.py): its fit finds the constants that
made a set of steps, it predicts runs it was not fit on, answers turn dense past half a
tensor, and a projection needs the servers the links say."""
import argparse
import dataclasses
import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("step_model", ROOT / "benchmarks" / "step_model.py")
step_model = importlib.util.module_from_spec(spec)
sys.modules["step_model"] = step_model
spec.loader.exec_module(step_model)

PARAMS = 1_000_000
DENSE_SHARE = 0.01


def record(system: str, w: int, s: int, width: float, truth, link: str, shaper: str = "netem") -> dict:
    """A run whose step is what the model says for ``truth``'s constants."""
    push = 80_000.0
    sparse = round(PARAMS * (1 - DENSE_SHARE))
    answer = 40_000 + step_model.COO_BYTES * width * sparse
    servers = {str(j): 1 / s for j in range(s)}
    rec = {"system": system, "workers": w, "servers": s, "compute_s": 0.02 * (1 + w / 8),
           "compress_s": 0.005, "params": PARAMS, "step_s": 0.0, "shaper": shaper, "link": link,
           "cores": 2, "model": "vgg-1024"}
    if system != "ddp-dense":
        rec.update(pushed_per_step={j: push * f for j, f in servers.items()},
                   pulled_per_step={j: answer * f for j, f in servers.items()},
                   answer_density=width, dense=[3, 10, DENSE_SHARE])
    rec["step_s"] = step_model.predict(step_model.Run.of(rec), truth)
    return rec


def synthetic(truth, link: str, shaper: str = "netem") -> list[dict]:
    widths = {"ps-topk": {2: 0.019, 4: 0.03, 8: 0.047}, "ps-adtopk": {2: 0.012, 4: 0.02, 8: 0.03},
              "ps-adtopk+server-topk": {2: 0.01, 4: 0.01, 8: 0.01}}
    out = [record("ddp-dense", w, 1, 0, truth, link, shaper) for w in (2, 4, 8)]
    for system, by_w in widths.items():
        out += [record(system, w, s, width, truth, link, shaper) for w, width in by_w.items()
                for s in (1, 2, 4)]
    return out


constants = st.builds(step_model.Constants, sigma=st.floats(0, 5e-9), kappa=st.floats(0, 5e-9),
                      rho=st.floats(0, 5e-9), tau=st.floats(0, 0.01), tau_ring=st.floats(0, 0.01))


@settings(max_examples=40, deadline=None)
@given(truth=constants, shaper=st.sampled_from(["netem", "tbf"]),
       links=st.sampled_from([["100mbit"], ["1gbit"], ["100mbit", "1gbit"]]))
def test_the_fit_on_w2_predicts_every_run_that_the_same_constants_made(truth, shaper, links):
    runs = [step_model.Run.of(r) for link in links for r in synthetic(truth, link, shaper)]
    fitted = step_model.fit(runs)
    for run in runs:  # W=4 and 8 were not in the fit
        assert step_model.predict(run, fitted) == pytest.approx(run.step, rel=1e-6)


def test_pushes_and_answers_overlap_and_a_tbf_bucket_sends_its_burst_at_once():
    rate = step_model.rate_of("100mbit")
    nothing = step_model.Constants(0.0, 0.0, 0.0, 0.0, 0.0)
    rec = record("ps-adtopk", 4, 1, 0.02, nothing, "100mbit", "netem")
    run = step_model.Run.of(rec)
    # four workers into one server: its link in (4 x 80 kB) and out (4 answers) overlap
    answer = 40_000 + 8 * 0.02 * round(PARAMS * (1 - DENSE_SHARE))
    link = max(4 * 80_000, 4 * answer) / rate
    assert run.step == pytest.approx(run.compute + run.compress + link + 2 * step_model.NETEM_HOP_S)
    tbf = step_model.Run.of({**rec, "shaper": "tbf"})
    free = min(step_model.TBF_BURST_BYTES, rate * (run.compute + run.compress))
    assert step_model.predict(tbf, nothing) == pytest.approx(
        run.compute + run.compress + (4 * answer - free) / rate)


def test_a_rate_is_the_links_less_its_headers():
    assert step_model.rate_of("1gbit") == pytest.approx(125e6 * 1448 / 1514)
    assert step_model.rate_of("500mbit") == pytest.approx(step_model.rate_of("1gbit") / 2)
    with pytest.raises(ValueError, match="1gbyte"):
        step_model.rate_of("1gbyte")


def test_an_answer_goes_dense_past_half_a_tensor_and_grows_along_the_union_curve():
    p = step_model.Profile("ps-adtopk", 0.02, 0.005, 80_000, 1_000, 1_000_000, {2: 0.01, 8: 0.03}, 0.0)
    assert step_model.answer_bytes(p, 0.1) == 1_000 + 8 * 0.1 * 1_000_000
    assert step_model.answer_bytes(p, 0.6) == step_model.answer_bytes(p, 0.9) == 1_000 + 4_000_000
    growth = {2: 0.02, 8: 0.05, 64: 0.10}
    assert step_model.width_at(p, 8, growth) == 0.03  # measured: as measured
    assert step_model.width_at(p, 64, growth) == pytest.approx(0.06)  # 0.03 * 0.10 / 0.05
    capped = dataclasses.replace(p, cap=0.02)  # servers that re-sparsify hold it there ...
    assert step_model.width_at(capped, 2, growth) == 0.01  # ... and below it, it is the union
    assert step_model.width_at(capped, 8, growth) == step_model.width_at(capped, 64, growth) == 0.02
    # a width of two pushes cuts nothing for two workers; one at the density cuts for any
    assert not step_model.resparsifies(step_model.WIDER, 2) and step_model.resparsifies(step_model.WIDER, 4)
    assert step_model.resparsifies(step_model.RESPARSIFIED, 2)
    assert not step_model.resparsifies("ps-adtopk", 8)
    with pytest.raises(ValueError, match="union_density.py --json"):
        step_model.width_at(p, 64, None)


def test_more_workers_need_more_servers_on_a_slow_link_and_fewer_on_a_fast_one():
    c = step_model.Constants(0.0, 0.0, 0.0, 0.001, 0.001)
    p = step_model.Profile("ps-adtopk", 0.02, 0.005, 200_000, 10_000, 3_000_000, {2: 0.02}, 0.0)
    slow = [step_model.servers_needed(p, c, w, step_model.rate_of("1gbit"), 0.02)[0] for w in (16, 64, 256)]
    assert slow == sorted(slow) and slow[-1] > slow[0]
    fast = step_model.servers_needed(p, c, 256, step_model.rate_of("100gbit"), 0.02)[0]
    assert fast < slow[-1]
    # a key holding a quarter of the elements: no server carries less, so past 4 servers
    # more buy nothing
    lumpy = dataclasses.replace(p, floor=0.25)
    assert step_model.servers_needed(lumpy, c, 256, step_model.rate_of("1gbit"), 0.02)[0] == 4
    assert step_model.project_ps(lumpy, c, 256, 256, step_model.rate_of("1gbit"), 0.02) > \
        8 * step_model.project_ps(p, c, 256, 256, step_model.rate_of("1gbit"), 0.02)


def test_the_largest_key_bounds_a_servers_share():
    # vgg-1024's Linear(2048, 1024) splits into 4 MB keys of 500 rows: 1,024,000 of the
    # 3,385,344 elements the policy sparsifies
    share = step_model.largest_key_share("vgg-1024", 4_096_000)
    assert share == pytest.approx(1_024_000 / 3_385_344, rel=0.01)
    assert step_model.largest_key_share("vgg-1024", 256 << 10) < share / 10


def test_the_report_names_its_worst_error_and_projects_every_link(tmp_path):
    truth = step_model.Constants(1e-9, 2e-9, 1e-9, 0.004, 0.007)
    records = synthetic(truth, "100mbit", "tbf") + synthetic(truth, "1gbit", "tbf")
    union = {"0.01": {"topk": {"1": 0.01, "2": 0.0175, "8": 0.047, "16": 0.066, "32": 0.087,
                               "64": 0.107, "128": 0.133, "256": 0.155},
                      "adtopk": {"1": 0.005, "2": 0.0097, "8": 0.027, "16": 0.042, "32": 0.06,
                                 "64": 0.08, "128": 0.106, "256": 0.132}}}
    (tmp_path / "union.json").write_text(json.dumps(union))
    args = argparse.Namespace(results=str(tmp_path), model="vgg-1024", batch=8,
                              ratio=0.01, union=str(tmp_path / "union.json"), out=str(tmp_path))
    text = step_model.report(records, args)
    assert len(re.findall(r"^Within 15%: 30 of 30 points; the largest error [+-]0%\.$", text, re.M)) == 2
    for gbit in step_model.PROJECT_LINKS_GBIT:
        for w in step_model.PROJECT_WORKERS:
            row = re.search(rf"^\| {gbit} \| {w} \| (\d+) \| (.*) \| ([\w+ ,-]+) \|$", text, re.M)
            assert row and "-" not in row.group(2).split(" | ")[0], (gbit, w)
    assert re.search(r"^\| 10 \| 256 \| ps-adtopk \| [\d.]+ \| \d+ \| \d+ \| \+\d+% \|$", text, re.M)
    assert (tmp_path / "scale-model.png").stat().st_size > 10_000
