"""The benchmarks run and report what they promise (figures are not asserted)."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from adtopk_ps.compression import COMPRESSORS
from adtopk_ps.testing import netns

SKIP = netns.unavailable()

ROOT = Path(__file__).resolve().parents[1]


def test_compression_benchmark_prints_a_row_per_compressor():
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "compression.py"), "--shapes", "32x600",
         "--densities", "0.01", "--budget", "0.01"],
        capture_output=True, text=True, timeout=120, check=True).stdout
    for name in COMPRESSORS:
        assert re.search(rf"^\| {re.escape(name)} \| [\d.]+ \|", out, re.M), name
    row = re.search(r"^\| \(32, 600\) \| 0.01 \| ([\d.]+) \| ([\d.]+) \|", out, re.M)
    assert row and float(row.group(1)) > 0
    # ADTopk keeps max(1, floor(600 * 0.01)) = 6 values per row with uint16 positions
    adtopk = re.search(r"^\| adtopk \|.*\| ([\d,]+) \|$", out, re.M)
    values_and_indices = 32 * 6 * (4 + 2)
    assert values_and_indices < int(adtopk.group(1).replace(",", "")) < values_and_indices + 200


def test_compression_benchmark_in_job_compares_adtopk_and_topk_on_the_job_partitions():
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "compression.py"), "--in-job", "vgg-1024",
         "--repeats", "2", "--densities", "0.01", "--cpu-time"],
        capture_output=True, text=True, timeout=300, check=True, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)}).stdout
    # every tensor the policy sends sparse, with the partitions the client cuts it into
    # (Linear(2048, 1024): 8 MiB in partitions of 500 rows, the last of 24)
    # (then each compressor's wire bytes per step)
    assert re.search(r"^\| classifier\.1\.weight \| \(1024, 2048\) \| \(24, 2048\), \(500, 2048\) "
                     r"\| [\d.]+ \([\d.]+-[\d.]+\) \| [\d.]+ \([\d.]+-[\d.]+\) \| [\d.]+ \| [\d,]+ \| [\d,]+ \|$",
                     out, re.M), out
    assert not re.search(r"^\| (features\.0|[\w.]+\.bias) ", out, re.M)  # dense: not compressed
    total = re.search(r"^\| total \| \| \| [\d.]+ .* \| [\d.]+ \([\d.]+-[\d.]+\) \| ([\d,]+) \| ([\d,]+) \|$",
                      out, re.M)
    assert total, out
    adtopk, topk = (int(v.replace(",", "")) for v in total.groups())
    assert 0 < adtopk < topk, out  # narrower positions per fibre, and no dead rows


@pytest.mark.skipif(SKIP is not None, reason=SKIP or "")
def test_e2e_benchmark_runs_both_kinds_side_by_side(tmp_path):
    # the smallest run that still crosses namespace hosts: PS systems and a DDP system
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "e2e.py"), "--models", "vgg-1024", "--links", "1gbit",
         "--systems", "ps-adtopk", "ps-adtopk+cost", "ps-adtopk+hybrid", "ddp-dense", "--trials", "1",
         "--steps", "2", "--warmup", "1",
         "--paired", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "PS_OVERLAP_TRIAL_STEPS": "1"})  # the shortest overlap trial
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    report = (tmp_path / "e2e-vgg-1024-paired.md").read_text()
    rows = {m.group(1): m for m in re.finditer(
        r"^\| ([\w+-]+)(?: \(chose (?:no )?overlap(?:, every tensor dense)?\))? \| ([\d.]+) \| (\d+) \| (\d+) \| (\d+) \| [^|]+ \| [^|]+ \| \d+ \| ([^|]+) \| ([\d.]+)x \|",
        report, re.M)}
    assert set(rows) == {"ps-adtopk", "ps-adtopk+cost", "ps-adtopk+hybrid", "ddp-dense"}, report
    assert float(rows["ps-adtopk"].group(6)) < 5  # MB per step: ADTopk's, not dense
    assert rows["ddp-dense"].group(7) == "1.00"  # the ratio's own baseline
    assert all(int(r.group(4)) > 0 for r in rows.values())  # the worker's CPU per step
    # the PS row says what its overlap trial chose; the other way ran in the same rounds, and
    # what overlap hides is reported
    chose = re.search(r"^\| ps-adtopk \(chose ((?:no )?overlap)\) \|", report, re.M).group(1)
    other = "overlap" if chose == "no overlap" else "no overlap"
    assert re.search(rf"^\| ps-adtopk, {other} \| [\d.]+ \| \d+ \|", report, re.M), report
    assert re.search(r"hidden by the backward pass: (-?\d+%|-) \(step \d+ ms with overlap, \d+ ms without, "
                     r"forward \+ backward alone \d+ ms", report), report
    # what the measured cost model decided, against partial sparsification alone; the hybrid
    # also timed the all-reduce among the workers and says which route dense tensors took
    for system, ring in (("ps-adtopk+cost", ""), ("ps-adtopk+hybrid", r", all-reduced among the workers at (\d+) MB/s")):
        cost = re.search(rf"Cost model \({re.escape(system)}\): dense push \+ pull measured at (\d+) MB/s through "
                         rf"the servers{ring}, ADTopk at ([\d.]+) ns per element, one more key at ([\d.]+) ms; "
                         rf"dense tensors went (by all-reduce|through the servers); it sent (\d+) of (\d+) tensors "
                         rf"dense \([\d.]+% of the parameters\), where partial sparsification alone sends (\d+)",
                         report)
        assert cost, report
        figures = [float(v) for v in cost.groups()[:-4]]
        n, total, partial = map(int, cost.groups()[-3:])
        assert all(v > 0 for v in figures) and partial <= n <= total, report
        if ring:  # the faster of the two measured routes
            assert cost.group(5) == ("by all-reduce" if figures[1] > figures[0] else "through the servers")
        else:
            assert cost.group(4) == "through the servers"
    # the trial-by-trial table: the step ratio and the same-compute ratio of the one trial
    assert re.search(r"^\| ps-adtopk \| [\d.]+x \([\d.]+x\) \| [\d.]+x \| [01] of 1 \|$", report, re.M), report
    # --paired: both PS systems also timed DDP dense in their own rounds, round by round
    paired = {}
    for system in ("ps-adtopk", "ps-adtopk+cost", "ps-adtopk+hybrid"):
        row = re.search(rf"^\| {re.escape(system)} \| (\d+) \| (\d+) \| (\d+) \| (\d+) \| ([\d.]+)x "
                        rf"\[([\d.]+), ([\d.]+)\] \(([\d.]+)x\) \| ([\d.]+)x \| ([012]) of 2 \|$", report, re.M)
        assert row and all(int(v) > 0 for v in row.groups()[:4]), report
        ratio = int(row.group(2)) / int(row.group(1))  # DDP step over PS step, as the report rounds them
        # (each side rounded to whole ms, the ratio to two decimals)
        assert float(row.group(5)) == pytest.approx(ratio, rel=0.03) and row.group(5) == row.group(8), report
        assert float(row.group(6)) <= float(row.group(5)) <= float(row.group(7)), report
        paired[system] = float(row.group(5))
    # every two PS systems against each other, each over DDP dense in its own rounds
    versus = {(m.group(1), m.group(2)): m for m in re.finditer(
        r"^\| ([\w+-]+) \| ([\w+-]+) \| ([\d.]+)x \[([\d.]+), ([\d.]+)\] \| 2 \+ 2 \|$", report, re.M)}
    assert set(versus) == {("ps-adtopk", "ps-adtopk+cost"), ("ps-adtopk", "ps-adtopk+hybrid"),
                           ("ps-adtopk+cost", "ps-adtopk+hybrid")}, report
    for (a, b), m in versus.items():
        assert float(m.group(3)) == pytest.approx(paired[a] / paired[b], rel=0.03), report
        assert float(m.group(4)) <= float(m.group(3)) <= float(m.group(5)), report
    assert (tmp_path / "e2e-vgg-1024-paired.png").stat().st_size > 0


@pytest.mark.skipif(SKIP is not None, reason=SKIP or "")
def test_e2e_benchmark_reports_what_crossing_the_barrier_hides(tmp_path):
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "e2e.py"), "--models", "vgg-1024", "--links", "1gbit",
         "--systems", "ps-adtopk+crossbarrier", "--trials", "1", "--steps", "2", "--warmup", "1",
         "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    report = (tmp_path / "e2e-vgg-1024.md").read_text()
    for row in ("ps-adtopk+crossbarrier", "ps-adtopk+crossbarrier, ordered by need (256 KiB credit)",
                "ps-adtopk+crossbarrier, at the barrier with overlap",
                "ps-adtopk+crossbarrier, at the barrier without overlap"):
        m = re.search(rf"^\| {re.escape(row)} \| [\d.]+ \| (\d+) \| (\d+) \| (\d+) \| [^|]+ \| [^|]+ "
                      rf"\| \d+ \| ([\d.]+) \|", report, re.M)
        assert m and all(int(v) > 0 for v in m.groups()[:3]), report
        assert float(m.group(4)) < 5  # MB per step: ADTopk's, not dense
    assert re.search(r"Crossing the barrier \(ps-adtopk\+crossbarrier\): ADTopk compression \+ communication "
                     r"hidden by the backward and the next forward pass: (-?\d+%|-) with the pushes as they "
                     r"come, (-?\d+%|-) with them ordered by need behind a 256 KiB credit window; by the "
                     r"backward pass alone, at the barrier: (-?\d+%|-) \(step \d+ ms crossing the barrier, "
                     r"\d+ ms crossing it ordered, \d+ ms with overlap at the barrier, \d+ ms without, "
                     r"forward \+ backward alone \d+ ms.*crossing ordered against the barrier with "
                     r"overlap: [\d.]+x", report), report


def test_e2e_benchmark_runs_over_loopback_where_namespaces_cannot_be_made(tmp_path):
    """--links loopback: every role on this machine, unshaped (a GPU container without the
    privilege to make namespaces); PS and DDP systems both run."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "e2e.py"), "--models", "vgg-1024", "--links", "loopback",
         "--systems", "ps-adtopk", "ddp-dense", "--trials", "1", "--steps", "2", "--warmup", "1",
         "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    report = (tmp_path / "e2e-vgg-1024.md").read_text()
    for system in ("ps-adtopk", "ddp-dense"):
        assert re.search(rf"^\| {system}( \(chose [^)]*\))? \| [\d.]+ \|", report, re.M), report
    assert "loopback" in report


def test_paired_interval_brackets_the_pooled_ratio_and_widens_with_noise():
    from adtopk_ps.testing import stats
    steady = [(0.5, 0.6)] * 30  # (PS step, DDP step): DDP always 1.2x slower
    assert stats.interval(steady) == pytest.approx((1.2, 1.2))
    noisy = [(0.5 + 0.2 * (i % 3), 0.6 + 0.15 * (i % 5)) for i in range(30)]
    low, high = stats.interval(noisy)
    assert low < stats.speed_of(noisy) < high
    assert stats.interval(noisy) == (low, high)  # seeded: the report does not move between renders
    fewer_low, fewer_high = stats.interval(noisy[:10])
    assert fewer_high - fewer_low > high - low  # fewer rounds, less certainty
    # one system against another: each over DDP dense in its own rounds, both resampled
    level = [(0.6, 0.6)] * 30
    assert stats.interval(steady, level) == pytest.approx((1.2, 1.2))
    low, high = stats.interval(noisy, noisy[::-1])
    assert low < 1 < high and stats.interval(noisy, noisy[::-1]) == (low, high)
    assert stats.interval(noisy, level)[1] - stats.interval(noisy, level)[0] < high - low


def test_convergence_study_resumes_and_reports(tmp_path):
    """Two short runs stored, a second call that skips them, and a report with bands."""
    argv = [sys.executable, "benchmarks/convergence.py", "--tasks", "fashion", "--densities", "0.01",
            "--compressors", "none", "adtopk", "--seeds", "0", "1", "--results", str(tmp_path / "runs"),
            "--out", str(tmp_path), "--workers", "2", "--servers", "1", "--set", "steps=8",
            "--set", "eval_every=4", "--set", "dataset_args={train_limit: 512, test_limit: 256}"]
    first = subprocess.run(argv, capture_output=True, text=True, timeout=400, cwd=ROOT)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    assert "4 run(s) pending" in first.stdout
    stored = sorted(p.name for p in (tmp_path / "runs").iterdir())
    assert stored == ["fashion-adtopk-d0.01-s0.json", "fashion-adtopk-d0.01-s1.json",
                      "fashion-dense-s0.json", "fashion-dense-s1.json"]
    record = json.loads((tmp_path / "runs" / stored[0]).read_text())
    assert record["summary"]["steps"] == 8 and [p["step"] for p in record["curve"]] == [4, 8]
    again = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert again.returncode == 0 and "0 run(s) pending" in again.stdout
    other = subprocess.run([*argv, "--set", "optimizer.lr=0.01"], capture_output=True, text=True,
                           timeout=120, cwd=ROOT)  # stored runs of other settings are not this study's
    assert other.returncode == 2 and "was made with other settings" in other.stderr
    damaged = tmp_path / "runs" / "fashion-dense-s1.json"
    damaged.write_text(damaged.read_text()[:300])  # a record cut short: named, and run again
    redo = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert redo.returncode == 0 and "1 run(s) pending" in redo.stdout
    assert f"{damaged}: unreadable" in redo.stderr and json.loads(damaged.read_text())["seed"] == 1
    missing = subprocess.run([sys.executable, "benchmarks/convergence.py", "--report", "--results",
                              str(tmp_path / "typo"), "--out", str(tmp_path)], capture_output=True,
                             text=True, timeout=120, cwd=ROOT)
    assert missing.returncode == 2 and "no such folder" in missing.stderr
    report = (tmp_path / "convergence.md").read_text()
    assert "| adtopk | 2 |" in report and "| dense | 2 |" in report
    assert "- adtopk vs dense:" in report
    assert (tmp_path / "convergence-fashion-0.01.png").stat().st_size > 10_000


def test_compression_benchmark_times_a_gradient_set_on_a_device():
    # --device prints the whole-set table with its reference columns, the per-tensor path's
    # ratios and the batched path's apart (cpu here: no kernel, so no batched row)
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "compression.py"), "--device", "cpu",
         "--sets", "tiny", "--densities", "0.01", "--budget", "0.01"],
        capture_output=True, text=True, timeout=120, check=True).stdout
    row = re.search(r"^\| tiny \(0\.5 M\) \| 3 \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) "
                    r"\| ([\d.]+) \| ([\d.]+) \| - \| - \| - \|$", out, re.M)
    assert row and all(float(v) > 0 for v in row.groups()), out


def _fashion_missing() -> str | None:
    from worker.data import DatasetUnavailable, fashion_files
    try:
        fashion_files()
    except DatasetUnavailable as exc:
        return str(exc)
    return None


@pytest.mark.skipif(SKIP is not None or _fashion_missing() is not None, reason=SKIP or _fashion_missing() or "")
def test_time_to_accuracy_runs_both_kinds_to_a_target(tmp_path):
    # the smallest run that still trains a PS system and a DDP system across namespace hosts
    target, every, cap_steps = 0.15, 5, 10
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "time_to_accuracy.py"), "--systems", "ps-adtopk", "ddp-dense",
         "--hidden", "64", "--width", "8", "--batch", "16", "--target", str(target), "--eval-every", str(every),
         "--max-steps", str(cap_steps), "--cap", "60", "--train-limit", "1000", "--test-limit", "200",
         "--out", str(tmp_path), "--stem", "tta"],
        capture_output=True, text=True, timeout=240,
        env={**os.environ, "PS_OVERLAP_TRIAL_STEPS": "1"})  # the shortest overlap trial
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    report = (tmp_path / "tta.md").read_text()
    assert "evaluation time is excluded from the wall clock" in report
    assert "    sudo python benchmarks/time_to_accuracy.py --systems ps-adtopk ddp-dense" in report
    for system in ("ps-adtopk", "ddp-dense"):
        reached = re.search(rf"^\| {system} \| ([\d.]+) \| (\d+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| "
                            rf"(?:[\d.]+x sooner|-) \|$", report, re.M)
        missed = re.search(rf"^\| {system} \| not reached in the step cap \| not reached in {cap_steps} steps \| "
                           rf"- \| ([\d.]+) \| ([\d.]+) \| - \|$", report, re.M)
        assert reached or missed, report
        if reached:  # at an evaluation, with the target's accuracy, having sent something
            wall, steps, mib, accuracy = (float(v) for v in reached.groups()[:4])
            assert wall > 0 and steps % every == 0 and 0 < steps <= cap_steps and mib > 0, report
            assert accuracy >= target, report
        else:
            assert float(missed.group(1)) < target, report
    if re.search(r"^\| ddp-dense \| [\d.]+ \|", report, re.M):
        assert re.search(r"^\| ddp-dense \|.* 1\.00x sooner \|$", report, re.M), report  # its own baseline
    assert (tmp_path / "tta.png").stat().st_size > 10_000


def test_time_to_accuracy_report_sets_each_system_against_dense_ddp():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import time_to_accuracy as tta
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    args = tta.argparse.Namespace(target=0.5, link="1gbit", width=8, hidden=64, workers=2, servers=2,
                                  batch=16, lr=0.05, momentum=0.9, ratio=0.01, device="cpu", seed=0,
                                  test_limit=200, eval_every=10, cap=30.0, max_steps=100, note="", stem="t")

    def run(end, *points):
        return {"end": end, "params": 1000, "device": "cpu",
                "curve": [{"step": 0, "wall_s": 0.0, "accuracy": 0.1}] +
                         [{"step": s, "wall_s": w, "sent": b, "accuracy": a} for s, w, b, a in points]}
    results = {"ddp-dense": run("reached", (10, 5.0, 2**20, 0.3), (20, 10.0, 2**21, 0.55)),
               "ps-adtopk": run("reached", (10, 4.0, 2**19, 0.6)),
               "ps-topk": run("cap", (10, 31.0, 2**19, 0.4)),
               "ps-dense": {"error": "server0 exited with 1"}}
    report = tta.report(results, args, "cmd")
    assert "| ddp-dense | 10.0 | 20 | 2.0 | 0.550 | 0.500 | 1.00x sooner |" in report
    assert "| ps-adtopk | 4.0 | 10 | 0.5 | 0.600 | 0.400 | 2.50x sooner |" in report
    assert "| ps-topk | not reached in 31 s | not reached in 10 steps | - | 0.400 | 3.100 | - |" in report
    assert "| ps-dense | failed: server0 exited with 1 ||||||" in report


def test_convergence_shards_split_the_whole_plan_the_same_way_every_sitting():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import convergence
    finally:
        sys.path.pop(0)
    runs = convergence.plan(["fashion"], [0.01], [0, 1], ["none", "adtopk"])
    assert len(runs) == 4
    first = convergence.shard(runs, runs, 1, 2) + convergence.shard(runs, runs, 2, 2)
    assert sorted(first, key=runs.index) == runs  # every run in exactly one shard
    done_by_one = convergence.shard(runs, runs, 1, 2)
    left = [r for r in runs if r not in done_by_one]
    assert convergence.shard(runs, left, 2, 2) == convergence.shard(runs, runs, 2, 2)
    assert convergence.shard(runs, left, 1, 2) == []


def test_convergence_matches_densities_on_real_payloads():
    """Every sparsifier's density is found so that its payloads, on the task's real gradients,
    weigh ADTopk's; ADTopk's own (and refill's) is the density itself."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import convergence
        from union_density import trained_gradients
    finally:
        sys.path.pop(0)
    grads = [g for _, gs in trained_gradients(convergence.TASKS["fashion"], [0, 40], 2, 0) for g in gs]
    target = convergence.sparse_bytes("adtopk", 0.01, grads)
    for name in ("topk", "adtopk-i"):
        # where the target falls between two of a compressor's sizes (ADTopk-I keeps whole
        # values per fibre), the ratio sits at the step between them
        ratio = convergence.matching_ratio(name, 0.01, grads)
        below, above = (convergence.sparse_bytes(name, ratio * f, grads) for f in (0.99, 1.01))
        assert below <= target <= above, (name, below, target, above)
    topk = convergence.sparse_bytes("topk", convergence.matching_ratio("topk", 0.01, grads), grads)
    assert topk == pytest.approx(target, rel=0.01)
    assert convergence.matching_ratio("adtopk+refill", 0.01, grads) == 0.01


def test_union_density_grows_with_the_workers_and_stays_within_the_independent_bound(tmp_path):
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "union_density.py"), "--workers", "1", "2", "8",
         "--at", "0", "--densities", "0.01", "--json", str(tmp_path / "union.json")],
        capture_output=True, text=True, timeout=300, check=True, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)}).stdout
    rows = {m[1]: [float(v) for v in m[3].split(" | ")] for m in
            re.finditer(r"^\| 0 \| (\w+) \| 0.01 \| ([\d.]+) \| (.*) \|$", out, re.M)}
    assert set(rows) == {"independent", "adtopk", "topk"}, out
    for name in ("adtopk", "topk"):
        one, two, eight = rows[name]
        assert 0.009 < one < 0.012 and one < two < eight, (name, rows[name])  # W=1: its own
        assert eight <= 8 * one + 1e-9  # a union holds at most all the selections
    # --json: the same unions, for the step model to grow answers along
    curves = json.loads((tmp_path / "union.json").read_text())["0.01"]
    for name in ("adtopk", "topk"):
        assert [round(curves[name][w], 4) for w in ("2", "8")] == rows[name][1:], (name, curves)


def test_answer_balance_weighs_the_plans_by_the_unions_it_counts():
    """Two plans of the same sparse tensors against the same later answers: both ratios are
    the busiest server over the mean, and each tensor's measured answer is a fraction of the
    estimate near 1 or below (the estimate's union is rounded down, so a narrow fibre's
    measured union may pass it by a little)."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "answer_balance.py"), "--configs",
         str(ROOT / "configs" / "fashion-cnn.yaml"), "--workers", "4", "--at", "0", "2"],
        capture_output=True, text=True, timeout=300, check=True, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)}).stdout
    fractions = [float(v) for v in re.findall(r"step \d+ ([\d.]+)", out)]
    assert len(fractions) == 4 and all(0 < f < 1.5 for f in fractions), out  # 2 tensors x 2 steps
    plans = re.search(r"fashion-cnn W=S=4: .* estimate plan ([\d.]+)x \((\d+) keys\), plan weighed by "
                      r"step 0's answers ([\d.]+)x \((\d+) keys\)", out)
    assert plans, out
    assert float(plans[1]) >= 1.0 and float(plans[3]) >= 1.0 and int(plans[2]) >= 4, out
    assert out.rstrip().endswith(f"worst measured-plan busiest/mean: {plans[3]}x"), out


@pytest.mark.skipif(SKIP is not None, reason=SKIP or "")
def test_scale_benchmark_measures_models_and_resumes(tmp_path):
    cmd = [sys.executable, str(ROOT / "benchmarks" / "scale.py"), "--workers", "2", "--servers", "1",
           "--steps", "2", "--warmup", "1", "--trials", "1", "--results", str(tmp_path / "runs"),
           "--out", str(tmp_path), "--union", str(tmp_path / "none.json"), "--link", "1gbit"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "6 run(s) to go" in out.stdout
    report = (tmp_path / "scale-model.md").read_text()
    for system in ("ddp-dense", "ps-topk", "ps-adtopk", "ps-adtopk+server-topk", "ps-adtopk+256k-keys",
                   "ps-adtopk+server-2x"):
        row = re.search(rf"^\| 2 \| [-\d]+ \| [\d.]+ \| [\d.]+x(?: saturated)? \| {re.escape(system)} \| "
                        rf"(\d+) \([\d-]+\) \| (\d+) \| "
                        r"([+-]\d+)% \|", report, re.M)
        assert row and int(row.group(1)) > 0 and int(row.group(2)) > 0, (system, report)
    record = json.loads((tmp_path / "runs" / "1gbit-W2-S1-ps-adtopk-t0.json").read_text())
    assert 0 < record["answer_density"] < 0.1 and record["pushed_per_step"]["0"] > 0
    # without a union curve the projection and the load generator's check name what is missing
    assert report.count("No union curve (none.json") == 2
    assert record["shaper"] in ("netem", "tbf") and record["cores"] >= 1
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert again.returncode == 0 and "0 run(s) to go" in again.stdout, again.stdout[-2000:]
