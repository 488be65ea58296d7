"""overlap="auto": steps alternate between pushing during and after backward, the faster stays."""
import pytest
import torch

import adtopk_ps.torch as bps
from adtopk_ps.torch.overlap import OverlapTrial, steps_to_choose


def run_trial(with_overlap: float, without: float, steps: int = 3, warmup: int = 2, total: int = 20):
    """Modes chosen step by step when a step takes the given seconds in each mode."""
    now = [0.0]
    trial = OverlapTrial(steps=steps, warmup=warmup, clock=lambda: now[0])
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
    assert steps_to_choose(3, 2) == 9
    assert trial.choice is False and set(modes[9:]) == {False}
    trial, modes = run_trial(with_overlap=0.008, without=0.010)
    assert trial.choice is True and set(modes[9:]) == {True}


def test_medians_ignore_an_odd_slow_step():
    now = [0.0]
    trial = OverlapTrial(steps=3, warmup=0, clock=lambda: now[0])
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
    assert steps_to_choose() == 7 and len(set(modes[7:])) == 1  # then one of them stayed
    opt.set_overlap(True)  # an explicit choice ends the trial
    assert opt.overlap is True


def test_unknown_overlap_is_refused(session):
    model = torch.nn.Linear(3, 3)
    with pytest.raises(ValueError, match="overlap must be True, False or 'auto', got 'sometimes'"):
        bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), overlap="sometimes")
