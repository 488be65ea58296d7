"""byteps' and horovod's APIs used the way their example scripts use them, on real clusters."""
import os
import re
import sys
from pathlib import Path

import pytest
import torch

from procs import bpslaunch

PROGRAMS = Path(__file__).resolve().parent / "programs"
# these programs train and time steps: a loaded CI core must not pass for a lost worker
PATIENT = {"PS_HEARTBEAT_TIMEOUT_MS": "10000"}


def _lines(stdout, worker):
    return [line.split(f"worker {worker}: ", 1)[1] for line in stdout.splitlines()
            if line.startswith(f"[worker {worker}] worker {worker}: ")]


def test_byteps_scripts_run_with_the_import_changed():
    """Synthetic benchmark with fp16, MNIST-style trainer, suspend/resume and refused calls,
    two workers and two servers."""
    result = bpslaunch("--local", "--num-workers", "2", "--num-servers", "2", "--",
                       sys.executable, str(PROGRAMS / "byteps_style.py"), env=PATIENT, timeout=150)
    out = result.stdout
    assert result.returncode == 0, out[-4000:]
    w0, w1 = _lines(out, 0), _lines(out, 1)
    # fp16 both ways, 1-D tensors included: 2 bytes per element plus headers, each direction
    bench = re.search(r"per step (\d+) elements, (\d+) bytes pushed, (\d+) pulled; params (\w+)",
                      w0[0])
    elements, pushed, pulled = (int(bench[i]) for i in (1, 2, 3))
    assert 2 * elements <= pushed < 2.2 * elements and 2 * elements <= pulled < 2.2 * elements, w0[0]
    assert bench[4] == re.search(r"params (\w+)", w1[0])[1]  # the same weights on both workers
    m0, m1 = (re.search(r"mnist loss (\S+) accuracy (\S+) own (\d+) total (\d+) (\S+)", w[1])
              for w in (w0, w1))
    assert m0[1] == m1[1] and m0[2] == m1[2] and float(m0[2]) > 0.7  # averaged metrics agree
    assert int(m0[3]) + int(m1[3]) == int(m0[4]) == int(m1[4]) and m0[5] == "torch.int64"
    for lines in (w0, w1):
        text = "\n".join(lines)
        assert "refused while suspended" in text and "it is not elastic" in text
        assert "resumed, in-flight average 1.5, next push_pull 0.5" in text
        assert "NOT refused" not in text
        assert "reused name with another shape [0.5, 0.5, 0.5]" in text  # agreed, its own key
        for what in ("unnamed push_pull", "object compression", "zip compression",
                     "complex tensor", "unknown handle", "resume without suspend"):
            assert f"refused {what}:" in text, what
        assert "after the refusals 0.5" in text


def test_byteps_suspend_and_resume_take_in_an_elastic_re_form():
    result = bpslaunch("--local", "--num-workers", "3", "--num-servers", "2", "--min-workers", "2",
                       "--", sys.executable, str(PROGRAMS / "byteps_elastic.py"),
                       env={**PATIENT, "PS_HEARTBEAT_TIMEOUT_MS": "6000"}, timeout=150)
    out = result.stdout
    assert result.returncode == 0, out[-4000:]
    for me in (0, 1):
        assert f"worker {me}: MembershipChanged at step 5" in out, out[-4000:]
        assert f"worker {me}: step 4 of 3 average 2.0" in out  # (1 + 2 + 3) / 3
        assert f"worker {me}: step 11 of 2 average 1.5" in out  # (1 + 2) / 2, after the resume
        assert f"worker {me}: resume(3, 2): the job still has 2 workers and 2 servers after 1 s" in out
        assert f"worker {me}: done at rank {me} of 2" in out


def test_horovod_calls_run_with_the_import_changed():
    """allreduce (average, sum, integers, in place, async, fp16, gradient), broadcast,
    allgather with unequal first dimensions, objects, barrier, join, op=Sum optimizer,
    refused ops; three workers."""
    result = bpslaunch("--local", "--num-workers", "3", "--num-servers", "1", "--",
                       sys.executable, str(PROGRAMS / "horovod_style.py"), env=PATIENT, timeout=150)
    out = result.stdout
    assert result.returncode == 0, out[-4000:]
    for worker in range(3):
        lines = _lines(out, worker)
        assert len(lines) == 24 and all(line.endswith(" ok") for line in lines), lines


def test_compression_names_resolve_and_unknown_ones_are_refused():
    from adtopk_ps.compression import ADTopk, ErrorFeedback, TopK
    from adtopk_ps.torch import Compression, GradientCompression
    from adtopk_ps.torch.compressors import FP16, compressor_of
    assert compressor_of(Compression.none) is None and compressor_of("none") is None
    made = Compression.adtopk(ratio=0.05)
    assert isinstance(made, ErrorFeedback) and isinstance(made.base, ADTopk) and made.ratio == 0.05
    assert isinstance(Compression.topk(ef=False), TopK)
    assert isinstance(compressor_of({"compressor": "adtopk", "k": 0.01, "ef": "vanilla"}), ErrorFeedback)
    fp16 = GradientCompression(Compression.fp16)
    fp16.plan([("bias", torch.zeros(3)), ("weight", torch.zeros(4, 4))])
    comp, ratio = fp16.for_tensor("bias")  # 1-D included
    assert isinstance(comp, FP16) and ratio == 1.0
    # horovod's interface: compress(tensor) -> (tensor, ctx), decompress(tensor, ctx)
    for dtype, wire in ((torch.float64, torch.float16), (torch.int32, torch.int32)):
        sent, ctx = Compression.fp16.compress(torch.ones(5, dtype=dtype))
        assert sent.dtype == wire and Compression.fp16.decompress(sent, ctx).dtype == dtype
    assert Compression.none.compress(torch.ones(2))[0].dtype == torch.float32
    for bad, kind in ((object(), TypeError), ("zip", ValueError), (3, TypeError)):
        with pytest.raises(kind, match="unknown compress"):
            compressor_of(bad)


def test_horovod_suite_shim_is_adtopk_ps_torch_under_horovods_name(tmp_path):
    """adtopk_ps.testing.horovod_suite runs horovod's own test file with only the import
    changed: its ``horovod.torch`` is ours, and a tree without the test file is refused."""
    import subprocess

    from adtopk_ps.testing.horovod_suite import OFFERED, main, write_shim
    write_shim(tmp_path)
    probe = ("import horovod.torch as hvd, adtopk_ps.torch as ours, inspect, common_probe;"
             "assert hvd.allreduce is ours.allreduce and hvd.join is ours.join;"
             "assert hasattr(inspect, 'getargspec');"
             "import torch.optim as o;"
             "assert o.SGD in o.Optimizer.__subclasses__();"
             "assert 'Muon' not in [c.__name__ for c in o.Optimizer.__subclasses__()];"
             "from horovod.runner.util.threads import in_thread; import mock;"
             "print('shim ok')")
    (tmp_path / "common_probe.py").write_text("")
    out = subprocess.run([sys.executable, "-c", probe], env={**os.environ, "PYTHONPATH": str(tmp_path)},
                         capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "shim ok", out.stderr[-2000:]
    assert len(OFFERED) == len(set(OFFERED)) == 44
    assert main([str(tmp_path / "no-horovod-here")]) == 2
