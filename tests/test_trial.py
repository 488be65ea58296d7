"""Step trials: overlap="auto" alternates pushing during and after backward, and with the cost
model its routes take turns with every tensor dense; the fastest stays."""
import pytest
import torch

import adtopk_ps.torch as bps
from adtopk_ps.torch.trial import Trial


def run_trial(with_overlap: float, without: float, steps: int = 3, warmup: int = 2, total: int = 20):
    """Modes chosen step by step when a step takes the given seconds in each mode."""
    now = [0.0]
    trial = Trial([True, False], steps=steps, warmup=warmup, clock=lambda: now[0])
    modes = [True]  # the first step runs with overlap
    for _ in range(total):
        now[0] += with_overlap if modes[-1] else without
        modes.append(trial.next_mode())
    return trial, modes


def test_the_faster_mode_stays_after_alternating():
    trial, modes = run_trial(with_overlap=0.010, without=0.008)
    # 3 settling steps with overlap, then alternation until 3 of each are timed
    assert modes[:9] == [True, True, True, False, True, False, True, False, True]
    assert trial.times == {True: pytest.approx([0.010] * 3), False: pytest.approx([0.008] * 3)}
    assert trial.length == 9
    assert trial.choice is False and set(modes[9:]) == {False}
    trial, modes = run_trial(with_overlap=0.008, without=0.010)
    assert trial.choice is True and set(modes[9:]) == {True}


def test_medians_ignore_an_odd_slow_step():
    now = [0.0]
    trial = Trial([True, False], steps=3, warmup=0, clock=lambda: now[0])
    mode = trial.next_mode()
    durations = {True: iter([0.5, 0.010, 0.010]), False: iter([0.012, 0.012, 0.012])}
    while trial.choice is None:
        now[0] += next(durations[mode])
        mode = trial.next_mode()
    assert trial.choice is True  # one 500 ms hiccup does not decide it


def test_auto_trial_in_a_real_job_keeps_every_step_exact(session, monkeypatch):
    monkeypatch.setenv("PS_OVERLAP_TRIAL_STEPS", "2")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(40, 300), torch.nn.ReLU(), torch.nn.Linear(300, 3))
    opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                   compression="adtopk", overlap="auto")
    modes = []
    for _ in range(12):
        modes.append(opt.overlap)
        model(torch.randn(4, 40)).sum().backward()
        expected = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.synchronize()
        # one worker: the average is its own gradient, whichever way it travelled (ADTopk
        # sends the selected part, the residual the rest, so compare the dense tensors only)
        for n, p in model.named_parameters():
            if p.dim() == 1:
                assert torch.equal(p.grad, expected[n]), n
        with opt.skip_synchronize():
            opt.step()
        opt.zero_grad()
    assert modes[:3] == [True, True, True] and False in modes[3:7]  # both ways were tried
    assert opt.gradient_sync.trial.length == 7 and len(set(modes[7:])) == 1  # then one of them stayed
    assert not opt.choosing
    opt.set_overlap(True)  # an explicit choice ends the trial
    assert opt.overlap is True


def test_unknown_overlap_is_refused(session):
    model = torch.nn.Linear(3, 3)
    with pytest.raises(ValueError, match="overlap must be True, False or 'auto', got 'sometimes'"):
        bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), overlap="sometimes")


def test_modes_take_turns_and_every_workers_medians_decide_together():
    """Four modes (overlap either way, the cost model's routes or every tensor dense) take
    turns; this worker's own steps favour the first, but the medians every worker agrees on
    (here: another worker's, averaged in) pick the last."""
    modes = [(True, 0), (False, 0), (True, 1), (False, 1)]
    seconds = {(True, 0): 0.010, (False, 0): 0.011, (True, 1): 0.012, (False, 1): 0.013}
    seen = []

    def agree(medians):
        seen.append(medians)
        other = [0.030, 0.030, 0.030, 0.005]
        return [(a + b) / 2 for a, b in zip(medians, other)]
    now = [0.0]
    trial = Trial(modes, steps=2, warmup=1, clock=lambda: now[0], agree=agree)
    ran = [trial.mode]
    while trial.choice is None:
        now[0] += seconds[ran[-1]]
        ran.append(trial.next_mode())
    # the first step (never timed) and one to settle in, then the turns go round from the second
    assert ran[:2] == [(True, 0), (True, 0)] and ran[2:10] == (modes[1:] + modes[:1]) * 2
    assert trial.length == 10 == len(ran) - 1
    assert seen == [pytest.approx([seconds[m] for m in modes])]
    assert trial.choice == (False, 1)


def test_cost_model_routes_are_timed_against_every_tensor_dense_in_a_real_job():
    """Two workers with the cost model: during the trial both run the same modes step by
    step, the cost model's routes (12 of 16 tensors dense) and every tensor dense, then keep
    the same one, with identical parameters at every step. (Dense through the servers: on
    loopback an all-reduce can be fast enough that the model sends every tensor dense, and
    there is nothing to time against.)"""
    import re
    import sys
    from pathlib import Path

    from procs import bpslaunch
    program = Path(__file__).resolve().parent / "programs" / "hybrid_check.py"
    result = bpslaunch("--local", "--num-workers", "2", "--num-servers", "2", "--", sys.executable,
                       str(program), "ps", "1", "adtopk", "--cost", "--steps", "10",
                       env={"PS_OVERLAP_TRIAL_STEPS": "1"}, timeout=120)
    assert result.returncode == 0, result.stdout[-3000:]
    steps = {r: re.findall(rf"worker {r}: step \d+ (\w+) overlap=(\w+) dense=(\d+) choosing=(\w+)",
                           result.stdout) for r in "01"}
    assert len(steps["0"]) == 10 and steps["0"] == steps["1"], result.stdout[-3000:]
    modes = [(overlap, int(dense)) for _, overlap, dense, _ in steps["0"]]
    routed = modes[0][1]  # how many the cost model sends dense (measured: 12 here)
    assert routed < 16
    # 3 steps to settle in, then one step of each mode (the first comes round last); the
    # choice, made as the 7th step ends, from then on
    assert modes[:7] == [("True", routed)] * 3 + [("False", routed), ("True", 16), ("False", 16),
                                                  ("True", routed)]
    assert [c for *_, c in steps["0"]] == ["True"] * 6 + ["False"] * 4  # (read after each step)
    assert len(set(modes[7:])) == 1
    # both decided from the same medians (every worker's averaged), and kept the fastest mode
    decided = {r: re.search(rf"worker {r}: trial medians (.*) chose (.*)", result.stdout).groups()
               for r in "01"}
    assert decided["0"] == decided["1"], result.stdout[-3000:]
    medians = {(o, int(p)): float(t)
               for o, p, t in re.findall(r"\((\w+), (\d)\)=([\d.]+)", decided["0"][0])}
    fastest = min(medians, key=medians.get)
    assert len(medians) == 4 and decided["0"][1] == f"({fastest[0]}, {fastest[1]})"
    assert modes[7] == (fastest[0], 16 if fastest[1] else routed)


def test_in_blocks_each_turn_times_only_its_steps_after_the_first():
    """Crossing the barrier, a step waits for the answers of the step before: a turn of two
    steps times only the second, which pays for its own mode alone. Here each step costs
    its own mode's time plus a carry-over from the mode before it."""
    own = {"ordered": 0.010, "as they come": 0.014}
    carry = {"ordered": 0.000, "as they come": 0.008}  # what a step leaves to the next
    now = [0.0]
    trial = Trial(list(own), steps=3, warmup=1, clock=lambda: now[0], block=2)
    ran = [trial.mode]
    while trial.choice is None:
        previous = ran[-2] if len(ran) > 1 else ran[-1]
        now[0] += own[ran[-1]] + carry[previous]
        ran.append(trial.next_mode())
    # turns of two steps, alternating, after the first step and one to settle in
    assert ran[:2] == ["ordered", "ordered"]
    assert ran[2:14] == ["as they come"] * 2 + ["ordered"] * 2 + ["as they come"] * 2 + \
        ["ordered"] * 2 + ["as they come"] * 2 + ["ordered"] * 2
    assert trial.times == {"ordered": pytest.approx([0.010] * 3),
                           "as they come": pytest.approx([0.022] * 3)}
    assert trial.length == len(ran) - 1 == 14 and trial.choice == "ordered"


def test_crossing_the_barrier_times_ordering_by_need_and_keeps_one(session, monkeypatch):
    from adtopk_ps.torch.cross_barrier import CrossBarrier
    from adtopk_ps.torch.gradient_sync import AUTO_CREDIT
    monkeypatch.setenv("PS_OVERLAP_TRIAL_STEPS", "2")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(40, 300), torch.nn.ReLU(), torch.nn.Linear(300, 3))
    cb = CrossBarrier(model, torch.optim.SGD(model.parameters(), lr=0.1), compression="adtopk")
    credits = []
    for _ in range(16):
        model(torch.randn(4, 40)).sum().backward()
        cb.step()
        credits.append(bps.client().credit)
        cb.zero_grad()
    cb.synchronize()
    trial = cb.gradient_sync.trial
    assert {m.credit for m in trial.modes} == {0, AUTO_CREDIT} and trial.block == 2
    assert trial.length == 11 and trial.choice is not None
    assert {0, AUTO_CREDIT} <= set(credits[:11])  # both were run
    assert set(credits[11:]) == {trial.choice.credit}  # then one stayed
    bps.client().credit = 0


def test_a_bad_credit_is_refused(session):
    model = torch.nn.Linear(3, 3)
    from adtopk_ps.torch.gradient_sync import GradientSync, GradientCompression, NonFiniteGuard
    with pytest.raises(ValueError, match="credit must be bytes >= 0, 'auto' or None, got -1"):
        GradientSync(model.named_parameters(), GradientCompression.of("adtopk"),
                     NonFiniteGuard("stop"), credit=-1)
    with pytest.raises(ValueError, match="credit must be an integer number of bytes >= 0"):
        bps.client().credit = "lots"
