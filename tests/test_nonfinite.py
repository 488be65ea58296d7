"""Non-finite gradients: every compressor finds a NaN or an infinity wherever it is, the wire
carries the finding, the server tells every worker alike, and a real job stops naming the
worker, tensor and step, or skips the step on every worker and trains on."""
import os
import re
import subprocess
import sys
from pathlib import Path

import msgpack
import pytest
import torch
from hypothesis import given, strategies as st

from adtopk_ps import wire
from adtopk_ps.compression import COMPRESSORS, create
from adtopk_ps.compression.select import above, all_finite
from server.aggregator import Aggregator

from procs import cluster_env, roles
from strategies import gradients, shapes_2d, shapes_4d

PROGRAM = Path(__file__).resolve().parent / "programs" / "nonfinite_check.py"
ROOT = Path(__file__).resolve().parents[1]
BAD = [float("nan"), float("inf"), float("-inf")]
# every compressor, with and without error feedback (whose kernel adds the residual in the
# same pass), and with values cast for the wire (a cast must not hide an infinity)
SPECS = [(name, ef, vdtype) for name in COMPRESSORS for ef in (None, "vanilla")
         for vdtype in ((None,) if name == "none" else (None, "fp16"))]


def _compressor(name, ef, vdtype):
    params = {} if name == "none" else {"ratio": 0.05}
    if vdtype:
        params["value_dtype"] = vdtype
    return create(name, ef=ef, **params)


def _compress(spec, x, step=0):
    return _compressor(*spec).compress(x, "w#0", step)


@given(gradients(st.one_of(shapes_2d, shapes_4d), dtypes=[torch.float32, torch.float16]),
       st.sampled_from(SPECS), st.data())
def test_a_nan_or_infinity_anywhere_is_always_found(x, spec, data):
    count = data.draw(st.integers(1, min(3, x.numel())))
    bad = x.clone().view(-1)
    for _ in range(count):
        bad[data.draw(st.integers(0, x.numel() - 1))] = data.draw(st.sampled_from(BAD))
    assert _compress(spec, bad.view(x.shape)).nonfinite, (spec, count)


@given(gradients(st.one_of(shapes_2d, shapes_4d), dtypes=[torch.float32, torch.float16]),
       st.sampled_from(SPECS))
def test_finite_inputs_are_never_flagged_and_never_touched(x, spec):
    before = x.clone()
    comp = _compressor(*spec)
    for step in range(3):  # threshold and error feedback keep state between calls
        assert not comp.compress(x, "w#0", step).nonfinite, (spec, step)
    assert torch.equal(x, before)


@given(gradients(st.one_of(shapes_2d, shapes_4d), dtypes=[torch.float32]),
       st.floats(0, 5), st.sampled_from(BAD), st.integers(0, 10**6))
def test_above_selects_what_it_did_and_every_nan(x, threshold, value, where):
    """The threshold selections (threshold, DGC, Gaussian-k) take |x| > t as before, plus
    every NaN: a selection never hides one."""
    flat = x.reshape(-1)
    assert torch.equal(above(flat, threshold), torch.nonzero(flat.abs() > threshold).view(-1))
    flat = flat.clone()
    flat[where % flat.numel()] = value
    assert int(where % flat.numel()) in above(flat, threshold).tolist()


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_found_on_the_tensors_own_device(spec, device):
    x = torch.randn(48, 260, device=device)
    assert not _compress(spec, x).nonfinite
    for value in BAD:
        y = x.clone()
        y[47, 259] = value
        assert _compress(spec, y).nonfinite, value


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_all_finite_reads_every_entry(dtype):
    x = torch.randn(4099, dtype=dtype)
    assert all_finite(x) and all_finite(x[:0]) and all_finite(torch.full((3,), torch.finfo(dtype).max, dtype=dtype))
    for i in (0, 1, 2048, 4098):
        for value in BAD:
            y = x.clone()
            y[i] = value
            assert not all_finite(y) and not all_finite(y.view(1, -1).t())


@pytest.mark.parametrize("name", ["adtopk", "topk", "randomk", "threshold", "dgc", "gaussiank"])
def test_a_forgotten_residual_sends_no_nan_again(name):
    """A NaN that error feedback kept (random-k leaves almost all of it behind) is sent on
    every later call until its residual is forgotten; then the next payload is finite."""
    comp = create(name, ratio=0.01, ef="vanilla")
    x = torch.randn(64, 300)
    x[7, 123] = float("nan")
    x[9, :] = float("inf")  # more non-finite entries than one fibre's k
    assert comp.compress(x, "w#0", 0).nonfinite
    clean = torch.randn(64, 300)
    assert comp.compress(clean, "w#0", 1).nonfinite
    comp.forget(["w"])  # the tensor's name: its partitions' residuals go too
    p = comp.compress(clean, "w#0", 2)
    assert not p.nonfinite and all_finite(p.values) and all_finite(comp.memory.residuals["w#0"])


def test_threshold_keeps_its_last_finite_threshold():
    comp = create("threshold", ratio=0.01, warmup=0)
    comp.compress(torch.randn(50, 50), "w", 0)
    kept = comp.layers["w"].threshold
    comp.compress(torch.full((50, 50), float("inf")), "w", 1)
    assert comp.layers["w"].threshold == kept


def _push_frames(**extra):
    p = create("none").compress(torch.ones(3), "w")
    return [bytes(f) for f in wire.encode(wire.Op.PUSH, key=1, round=0, sender=0, payload=p, **extra)]


def _with(frames, op=None, **changes):
    header = msgpack.unpackb(frames[0])
    header.update(changes)
    if op:
        header["op"] = op
    return [msgpack.packb(header), *frames[1:]]


def test_the_flag_travels_and_a_malformed_one_is_refused():
    assert wire.decode(_push_frames(nonfinite=True)).extra == {"nonfinite": True}
    assert wire.decode(_push_frames()).extra == {}
    result = _with(_push_frames(), op=wire.Op.RESULT, nonfinite=[0, 3])
    assert wire.decode(result).extra["nonfinite"] == [0, 3]
    refused = {
        "push, not a bool": (_push_frames(nonfinite=1), "must be a bool"),
        "push, a list": (_push_frames(nonfinite=[0]), "must be a bool"),
        "result, a bool": (_with(_push_frames(), op=wire.Op.RESULT, nonfinite=True), "distinct worker ranks"),
        "result, empty": (_with(_push_frames(), op=wire.Op.RESULT, nonfinite=[]), "distinct worker ranks"),
        "result, unsorted": (_with(_push_frames(), op=wire.Op.RESULT, nonfinite=[2, 1]), "increasing"),
        "result, repeated": (_with(_push_frames(), op=wire.Op.RESULT, nonfinite=[1, 1]), "distinct"),
        "result, negative": (_with(_push_frames(), op=wire.Op.RESULT, nonfinite=[-1]), "distinct worker"),
        "result, not ints": (_with(_push_frames(), op=wire.Op.RESULT, nonfinite=[True]), "distinct worker"),
        "control op": ([msgpack.packb({**msgpack.unpackb(wire.encode(wire.Op.HEARTBEAT)[0]),
                                       "nonfinite": True})], "only push and result"),
    }
    for case, (frames, words) in refused.items():
        with pytest.raises(wire.WireError, match=words):
            wire.decode(frames)
        assert case


def test_the_server_ors_the_flags_of_a_round_and_starts_every_round_clean():
    agg = Aggregator(3)
    dense = create("none")
    for rnd, flags in enumerate([(False, True, True), (False, False, False), (True, False, False)]):
        for w, flag in enumerate(flags):
            x = torch.full((4,), float("nan") if flag else 1.0)
            answer = agg.push(5, rnd, w, dense.compress(x, "t"), nonfinite=flag)
        assert answer is not None
        assert agg.keys[5].flagged == [w for w, f in enumerate(flags) if f]


def test_a_resparsifying_server_forgets_a_flagged_keys_residual():
    agg = Aggregator(1, resparsify=create("topk", ratio=0.1))
    topk = create("topk", ratio=0.5)
    x = torch.randn(8, 8)
    x[0, 0] = float("nan")
    agg.push(2, 0, 0, topk.compress(x, "t"), nonfinite=True)
    assert "key2" not in agg.resparsify.memory.residuals
    agg.push(2, 1, 0, topk.compress(torch.randn(8, 8), "t"), nonfinite=False)
    assert all_finite(agg.resparsify.memory.residuals["key2"])


def test_a_server_refuses_a_push_with_a_malformed_flag():
    import zmq
    from procs import clients, insider
    with roles(1, 1) as (config, procs):
        client, = clients(config, 1)
        sock = insider(client.servers[0])
        sock.send_multipart(_push_frames(nonfinite="yes"))
        assert sock.poll(5000), "no reply"
        reply = wire.decode(sock.recv_multipart())
        assert reply.op == wire.Op.ERROR and "must be a bool" in reply.extra["message"]
        sock.close()
        ones = torch.ones(3)
        assert torch.equal(client.push_pull(ones, "w", average=False).wait(10), ones)
        client.shutdown()
        assert procs[1].wait(10) == 0


def _job(*argv, module=False, timeout=90, **env_extra):
    """Two workers (DMLC_WORKER_ID 0 and 1) of a real cluster running ``argv``; each one's
    (exit status, output). Heartbeats are not what is tested: a loaded machine gets time."""
    env_extra = {"PS_HEARTBEAT_TIMEOUT_MS": "10000", **env_extra}
    with roles(2, 1, **env_extra) as (config, _):
        # this tree's packages, whichever one the environment has installed
        env = cluster_env(2, 1, config.root_port, DMLC_ROLE="worker", PYTHONPATH=str(ROOT),
                          **env_extra)
        cmd = [sys.executable, *(("-m",) if module else (str(PROGRAM),)), *argv]
        workers = [subprocess.Popen(cmd, env={**env, "DMLC_WORKER_ID": str(i)}, cwd=ROOT,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    start_new_session=True) for i in range(2)]
        try:
            return [(w.wait(timeout), w.stdout.read()) for w in workers]
        finally:
            for w in workers:
                if w.poll() is None:
                    os.killpg(w.pid, 9)
                    w.wait(10)


# (route, tensor, where it travels): a sparsified weight; a bias in a fused bucket; no
# compression, every tensor its own dense key; dense tensors all-reduced among the workers
CASES = [("sparse", "2.weight", "'2.weight'"), ("sparse", "2.bias", "'fused.0' (holding "),
         ("none", "4.weight", "'4.weight'"), ("allreduce", "0.bias", "'fused.0' (holding "),
         ("allreduce", "2.weight", "'2.weight'")]


@pytest.mark.parametrize("route, tensor, named", CASES[::2])
def test_stop_ends_every_worker_naming_worker_tensor_and_step(route, tensor, named):
    runs = _job("stop", route, tensor, "1", "3", "nan")
    for rank, (code, out) in enumerate(runs):
        assert code == 3, (rank, out[-3000:])
        stopped = re.findall(r"stopped: worker (\d): non-finite gradient \(NaN or infinity\) at "
                             r"step 3: (.*) from worker\(s\) \[1\]; stopping", out)
        assert stopped and int(stopped[0][0]) == rank, out[-3000:]
        assert stopped[0][1].startswith(named) and tensor in stopped[0][1], stopped
        assert re.findall(r"^step (\d)", out, re.M) == ["0", "1", "2"]  # step 3 applied nowhere


@pytest.mark.parametrize("route, tensor, named", CASES)
def test_skip_drops_the_step_on_every_worker_alike_and_training_goes_on(route, tensor, named):
    value = "-inf" if route == "none" else "nan"
    runs = _job("skip", route, tensor, "0", "3", value)
    lines = []
    for rank, (code, out) in enumerate(runs):
        assert code == 0, (rank, out[-3000:])
        warned = re.findall(rf"worker {rank}: non-finite gradient \(NaN or infinity\) at step 3: "
                            rf"(.*) from worker\(s\) \[0\]; step skipped", out)
        assert len(warned) == 1 and warned[0].startswith(named), out[-3000:]
        assert "done skipped=1" in out
        steps = re.findall(r"^step (\d) checksum (\w+) loss (\S+)$", out, re.M)
        assert [int(s) for s, _, _ in steps] == list(range(8))
        assert all(float(loss) == float(loss) and abs(float(loss)) < 100 for _, _, loss in steps)
        lines.append([digest for _, digest, _ in steps])
    assert lines[0] == lines[1]  # bit-identical parameters on both workers at every step
    by_step = dict(enumerate(lines[0]))
    assert by_step[3] == by_step[2] != by_step[4]  # step 3 moved no parameter; step 4 did


def test_the_training_job_exits_non_zero_with_the_message(tmp_path):
    """worker/train.py: a learning rate that blows up makes every gradient non-finite; under
    the default policy both workers exit 1 naming the step, and under ``nonfinite: skip``
    every such step is skipped until ten in a row end the job."""
    config = ROOT / "configs" / "digits-cnn.yaml"
    args = ["worker", "--config", str(config), "--steps", "6", "--lr", "1e30",
            "--set", "progress=false"]
    for rank, (code, out) in enumerate(_job(*args, module=True, timeout=120)):
        assert code == 1, out[-3000:]
        assert re.search(rf"worker: NonFiniteGradient: worker {rank}: non-finite gradient "
                         rf"\(NaN or infinity\) at step \d: .* from worker\(s\) \[0, 1\]", out), \
            out[-3000:]
    # skipping cannot mend parameters that are already non-finite: after 10 in a row it stops
    runs = _job(*args[:4], "14", *args[5:], "--set", "nonfinite=skip", module=True, timeout=120)
    for rank, (code, out) in enumerate(runs):
        assert code == 1, out[-3000:]
        assert "step skipped (nonfinite='skip')" in out and "summary: " not in out
        assert f"worker: NonFiniteGradient: worker {rank}: 10 steps in a row skipped" in out, \
            out[-3000:]
