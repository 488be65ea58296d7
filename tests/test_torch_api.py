"""adtopk_ps.torch in one worker process against real scheduler and server processes."""
import pytest
import torch

import adtopk_ps.torch as bps


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(40, 300), torch.nn.ReLU(), torch.nn.Linear(300, 3))


def test_identity_and_push_pull(session):
    assert (bps.rank(), bps.size(), bps.local_rank(), bps.local_size()) == (0, 1, 0, 1)
    x = torch.arange(6.0)
    assert torch.equal(bps.push_pull(x, name="x"), x)
    assert torch.equal(bps.synchronize(bps.push_pull_async(x * 2, average=False, name="x")), x * 2)


def test_gradient_accumulation_pushes_once_per_step(session):
    model = _model()
    opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   model.named_parameters(), backward_passes_per_step=2)
    batches = [torch.randn(4, 40) for _ in range(2)]
    for i, x in enumerate(batches):
        model(x).sum().backward()
        if i == 0:  # the first pass's gradients are part of the step: not to be dropped
            with pytest.raises(RuntimeError, match="between the 2 backward passes"):
                opt.zero_grad()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt.synchronize()
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, expected[n])  # the two micro-batches, summed; W=1 averages to it
    with opt.skip_synchronize():
        opt.step()


def test_parameters_without_gradients_still_push(session):
    model = _model()
    unused = torch.nn.Linear(5, 5)  # never used in the forward pass
    params = list(model.named_parameters()) + [(f"unused.{n}", p) for n, p in unused.named_parameters()]
    opt = bps.DistributedOptimizer(torch.optim.SGD([p for _, p in params], lr=0.1), params)
    frozen = torch.nn.Parameter(torch.ones(3), requires_grad=False)
    model(torch.randn(2, 40)).sum().backward()
    opt.step()
    assert torch.equal(unused.weight.grad, torch.zeros(5, 5))
    assert frozen.grad is None


def test_misuse_is_refused(session):
    model = _model()
    opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                   compression="adtopk")
    with pytest.raises(RuntimeError, match="needs synchronize"):
        with opt.skip_synchronize():
            opt.step()
    model(torch.randn(2, 40)).sum().backward()
    with pytest.raises(RuntimeError, match="in flight"):
        opt.zero_grad()
    opt.step()
    with pytest.raises(ValueError, match="unknown compressor 'zip'"):
        bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), compression="zip")


def test_overlap_switches_between_steps(session):
    model = _model()
    opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
    x = torch.randn(4, 40)
    for overlap in (True, False, True):
        opt.set_overlap(overlap)
        model(x).sum().backward()
        expected = {n: p.grad.clone() for n, p in model.named_parameters()}
        if overlap:  # the pushes left during backward
            with pytest.raises(RuntimeError, match="in flight"):
                opt.set_overlap(False)
        else:
            opt.zero_grad()  # nothing in flight: a local backward, the gradients dropped
            model(x).sum().backward()
        opt.synchronize()
        assert all(torch.equal(p.grad, expected[n]) for n, p in model.named_parameters())  # W=1
        with opt.skip_synchronize():
            opt.step()
        opt.zero_grad()


def test_wrapped_optimizer_keeps_its_class_and_checkpoints_residuals(session):
    model = torch.nn.Sequential(torch.nn.Linear(40, 500), torch.nn.ReLU(), torch.nn.Linear(500, 3))
    opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   model.named_parameters(),
                                   compression={"compressor": "adtopk", "k": 0.01, "ef": "vanilla"})
    assert isinstance(opt, torch.optim.SGD)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model(torch.randn(2, 40)).sum().backward()
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == 0.05
    state = opt.state_dict()
    residuals = state["adtopk_ps"]["compression"]["residuals"]
    # the 500x40 weight (80 KB) is sparsified; what it did not send waits in its residual,
    # kept whole in a checkpoint
    assert "0.weight#*" in residuals and residuals["0.weight#*"].abs().sum() > 0
    assert residuals["0.weight#*"].numel() == 500 * 40
    assert "0.bias#*" not in residuals  # 1-D tensors travel dense, with no residual


def test_measured_costs_decide_routes(session):
    from adtopk_ps.torch.fusion import fusion_bytes
    model = torch.nn.Sequential(torch.nn.Linear(40, 500), torch.nn.ReLU(), torch.nn.Linear(500, 3))
    compression = bps.GradientCompression("adtopk", measure_costs=True)
    bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                             compression)
    cost = compression.policy.cost_model
    assert cost is not None and cost.bytes_per_s > 1e6 and cost.compress_s_per_element > 0
    assert 0 < cost.key_s < 1 and cost.fusion_bytes == fusion_bytes()
    weight = model[0].weight
    expected_dense = not cost.sparse_pays(weight.numel(), 4, compression.compressor.ratio)
    assert compression.routes["0.weight"].dense == expected_dense


def test_every_worker_routes_by_the_same_measured_costs():
    """Each worker times the link and the compressor itself; routes that differed between
    workers would leave each waiting for keys the others never push."""
    import re
    import sys
    from pathlib import Path

    from procs import bpslaunch
    program = Path(__file__).resolve().parent / "programs" / "cost_check.py"
    result = bpslaunch("--local", "--num-workers", "2", "--num-servers", "2", "--",
                       sys.executable, str(program), timeout=120)
    assert result.returncode == 0, result.stdout[-3000:]
    decided = dict(re.findall(r"worker (\d): figures (.*)", result.stdout))
    assert set(decided) == {"0", "1"} and decided["0"] == decided["1"], result.stdout[-3000:]
    assert "worker 0: trained" in result.stdout and "worker 1: trained" in result.stdout


@pytest.mark.parametrize("capacity, buckets", [(4 << 20, "1 bucket(s) holding 26"),
                                               (700, "8 bucket(s) holding 26"), (0, "0 bucket(s)")])
def test_fused_buckets_average_exactly(capacity, buckets):
    """26 small dense tensors (6 linear layers, 6 norms, an unused layer): one bucket, several
    small ones, or none; every averaged gradient equals the mean of both workers' own."""
    import sys
    from pathlib import Path

    from procs import bpslaunch
    program = Path(__file__).resolve().parent / "programs" / "fusion_check.py"
    result = bpslaunch("--local", "--num-workers", "2", "--num-servers", "2", "--",
                       sys.executable, str(program), str(capacity), timeout=120)
    assert result.returncode == 0, result.stdout[-3000:]
    assert f"worker 0: {buckets}" in result.stdout
    assert "worker 0: fused averages exact" in result.stdout
    assert "worker 1: fused averages exact" in result.stdout


def test_channels_last_gradients_are_averaged_too(session):
    """A channels_last convolution's gradient is not contiguous: its answer goes through a
    buffer of its own and is copied back, for the dense and the sparse path alike."""
    from adtopk_ps.compression import SparsificationPolicy
    torch.manual_seed(0)
    model = torch.nn.Conv2d(16, 32, 3).to(memory_format=torch.channels_last)
    compression = bps.GradientCompression({"compressor": "adtopk", "k": 0.1},
                                          SparsificationPolicy(0.1, min_compress_bytes=0))
    opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   model.named_parameters(), compression)
    model(torch.randn(2, 16, 8, 8).to(memory_format=torch.channels_last)).sum().backward()
    assert not model.weight.grad.is_contiguous()
    local = model.weight.grad.clone()
    opt.synchronize()
    kept = model.weight.grad != 0
    assert torch.equal(model.weight.grad[kept], local[kept])  # W=1: the kept entries unchanged
    assert 0 < int(kept.sum()) < local.numel()
    with opt.skip_synchronize():
        opt.step()


def test_tensors_the_wire_cannot_carry_are_refused_by_name_and_the_worker_goes_on(session):
    """Sparse, complex and meta tensors, to the functional calls and to the optimizer (its
    parameters or a sparse gradient), are refused at once naming the tensor; before, some
    reached the engine, whose failure ended the worker's part in the job."""
    odd = {"sparse": torch.eye(3).to_sparse(), "complex": torch.ones(3, dtype=torch.complex64),
           "meta": torch.ones(3, device="meta")}
    for what, tensor in odd.items():
        with pytest.raises(ValueError, match=what if what != "sparse" else "sparse_coo"):
            bps.allreduce(tensor, name=what)
    for what in ("complex", "meta"):
        p = torch.nn.Parameter(odd[what].clone())
        with pytest.raises(ValueError, match=rf"'{what}': "):
            bps.DistributedOptimizer(torch.optim.SGD([p], lr=0.1), named_parameters=[(what, p)])
    embedding = torch.nn.Embedding(10, 4, sparse=True)
    opt = bps.DistributedOptimizer(torch.optim.SGD(embedding.parameters(), lr=0.1),
                                   named_parameters=embedding.named_parameters(), overlap=False)
    embedding(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(ValueError, match="'weight': a torch.sparse_coo tensor cannot be pushed"):
        opt.step()
    assert torch.equal(bps.allreduce(torch.ones(8, 0), name="empty"), torch.ones(8, 0))
    assert torch.equal(bps.allreduce(torch.ones(2), name="after"), torch.ones(2))


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors is a no-op")
def test_zero_size_parameters_train_under_adtopk(session):
    """Layers of width 0 ((0, 64), (8, 0): a pruned layer, a config of 0 hidden units) have
    fibres of no entries: they travel empty and the rest of the model trains."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 0), torch.nn.Linear(0, 8), torch.nn.Linear(8, 300))
    opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                   compression={"compressor": "adtopk", "k": 0.01, "ef": "vanilla"})
    before = model[2].weight.detach().clone()
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(4, 64)).sum().backward()
        opt.step()
    assert model[1].weight.shape == (8, 0) and not torch.equal(model[2].weight, before)
