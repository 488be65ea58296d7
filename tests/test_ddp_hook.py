"""The DDP communication hook on gloo gives the PS path's result for the same inputs."""
import os
import subprocess
import sys
from pathlib import Path

import torch

from procs import bpslaunch

PROGRAM = str(Path(__file__).resolve().parent / "programs" / "hook_vs_ps.py")


def test_ddp_hook_on_gloo_matches_the_parameter_server(tmp_path):
    threads = {"OMP_NUM_THREADS": "1"}  # bit-equal gradients need the same kernels on both sides
    ps = bpslaunch("--local", "--num-workers", "2", "--num-servers", "2", "--",
                   sys.executable, PROGRAM, "ps", str(tmp_path), env=threads)
    assert ps.returncode == 0, ps.stdout[-3000:]
    init = tmp_path / "init"
    ddp = [subprocess.Popen([sys.executable, PROGRAM, "ddp", str(tmp_path), str(r), "2", str(init)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **threads})
           for r in range(2)]
    for p in ddp:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0, out[-3000:]
    results = {name: torch.load(tmp_path / f"{name}.pt") for name in ("ps0", "ps1", "ddp0", "ddp1")}
    sparse_seen = False
    for step in range(2):
        reference = results["ps0"][step]
        for name, grad in reference.items():
            for other in ("ps1", "ddp0", "ddp1"):
                assert torch.equal(results[other][step][name], grad), (step, name, other)
            sparse_seen |= bool((grad == 0).float().mean() > 0.5)
    assert sparse_seen  # some layers really went through the sparse path
    # and the first Linear has dead units, other rows on each rank: payloads with row sets
    sys.path.insert(0, str(Path(PROGRAM).parent))
    from hook_vs_ps import model_and_inputs
    dead = []
    for rank in range(2):
        model, [(x, y), _] = model_and_inputs(rank)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        dead.append(set(torch.nonzero(model[3].weight.grad.abs().sum(1) == 0).view(-1).tolist()))
    assert dead[0] and dead[1] and dead[0] != dead[1], dead


def test_hook_takes_an_all_zero_gradient_and_its_state_survives_a_checkpoint(tmp_path):
    """A branch only rank 0 uses under find_unused_parameters=True (rank 1's gradient of a
    sparsified weight is all zeros); then PowerSGD's checkpoint pattern: save the hook state
    with the model, load both, register the loaded state on a new DDP model. Continuing
    from the loaded state gives the same parameters, bit for bit, as continuing with the
    original, on both ranks."""
    program = str(Path(PROGRAM).parent / "hook_checkpoint.py")
    init = tmp_path / "init"
    ranks = [subprocess.Popen([sys.executable, program, str(r), "2", str(init), str(tmp_path)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
             for r in range(2)]
    for p in ranks:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0, out[-3000:]
    got = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for r in got:
        assert r["original"].keys() == r["loaded"].keys()
        assert all(torch.equal(r["original"][n], r["loaded"][n]) for n in r["original"])
        sparse, loaded_steps = r["steps"]
        assert sparse == loaded_steps and set(sparse) == {"a.weight", "b.weight", "branch.weight"}
        assert r["group"] is None  # the default group after loading
        assert "load the model's state_dict from the same checkpoint" in r["refused"]
        assert r["parity"] < 1e-6  # uncompressed, the hook trains as plain DDP
    assert all(torch.equal(got[0]["loaded"][n], got[1]["loaded"][n]) for n in got[0]["loaded"])
    # the zero-gradient step: rank 1 pushed zeros for the branch, both hold rank 0's half
    assert torch.equal(got[0]["zero_step"]["branch.weight"], got[1]["zero_step"]["branch.weight"])
    assert got[0]["zero_step"]["branch.weight"].abs().sum() > 0
