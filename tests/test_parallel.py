"""byteps' DistributedDataParallel and CrossBarrier used the way their examples use them,
on real local clusters (two workers, one server)."""
import re
import sys
from pathlib import Path

from procs import bpslaunch

PROGRAMS = Path(__file__).resolve().parent / "programs"
# these programs train: a loaded CI core must not pass for a lost worker; the first layers are
# large enough to be sparsified under ADTopk
ENV = {"PS_HEARTBEAT_TIMEOUT_MS": "10000", "BYTEPS_MIN_COMPRESS_BYTES": "1024"}


def _run(program):
    result = bpslaunch("--local", "--num-workers", "2", "--num-servers", "1", "--",
                       sys.executable, str(PROGRAMS / program), env=ENV, timeout=150)
    assert result.returncode == 0, result.stdout[-4000:]
    return [[line.split(f"worker {w}: ", 1)[1] for line in result.stdout.splitlines()
             if f"worker {w}: " in line] for w in (0, 1)]


def test_ddp_wrapper_averages_during_backward_as_byteps_examples_use_it():
    """Trained with the user's own SGD, with and without no_sync() accumulation: equal to the
    big-batch step on every worker's data and bit-identical across workers; buffers come from
    rank 0 in forward passes with gradients only; ADTopk by one argument pushes fewer bytes."""
    w0, w1 = _run("ddp_style.py")
    runs = {}
    for lines in (w0, w1):
        for line in lines:
            m = re.match(r"(\w+): max diff from the big-batch step (\S+); params (\w+); "
                         r"pushed (\d+) bytes a step", line)
            if m:
                runs.setdefault(m[1], []).append((float(m[2]), m[3], int(m[4])))
    assert set(runs) == {"plain", "no_sync", "adtopk"}, w0
    for label, ((diff0, params0, pushed0), (diff1, params1, _)) in runs.items():
        assert params0 == params1, label  # the workers end bit-identical
        if label != "adtopk":
            assert diff0 < 1e-5 and diff1 < 1e-5, (label, diff0, diff1)
    assert runs["adtopk"][0][2] < runs["plain"][0][2]
    assert "buffer under no_grad 1.0, after a forward 1.0" in w0
    assert "buffer under no_grad 2.0, after a forward 1.0" in w1
    for lines in (w0, w1):
        text = "\n".join(lines)
        assert "NOT refused" not in text
        assert "refused two devices: DistributedDataParallel takes at most one device" in text
        assert "refused synchronize inside no_sync" in text


def test_cross_barrier_trains_as_the_plain_optimizer_with_updates_left_to_the_forward():
    """SGD (momentum, weight decay, nesterov), Adam, RMSprop and SGD under ADTopk: step()
    leaves every update pending, the next forward applies them, and outputs, parameters and
    optimizer state match the plain DistributedOptimizer's on the same data; Adagrad is refused
    by name, and so is a forward that reads a parameter outside its own module; a NaN on one
    worker stops both (the engine's nonfinite='stop')."""
    w0, w1 = _run("cross_barrier_style.py")
    for lines in (w0, w1):
        results = {m[1]: m for m in (re.match(
            r"([\w+]+): (\d+) updates pending after step\(\), applied by the forward: (\w+); max "
            r"diff from the plain optimizer: outputs (\S+), params (\S+), optimizer state (\S+)",
            line) for line in lines) if m}
        assert set(results) == {"sgd", "adam", "rmsprop", "sgd+adtopk"}, lines
        for m in results.values():
            assert m[2] == "6" and m[3] == "True", m[0]
            assert max(float(m[i]) for i in (4, 5, 6)) < 1e-5, m[0]
        text = "\n".join(lines)
        assert "refused Adagrad: CrossBarrier updates one parameter at a time and supports SGD, " \
               "Adam, AdamW, RMSprop; got Adagrad" in text
        assert re.search(r"refused a stale read: parameter 'lin\.\w+' was used before its update",
                         text)
        assert re.search(r"refused a NaN: worker [01]: non-finite gradient \(NaN or infinity\) at "
                         r"step 2: .*from worker\(s\) \[1\]", text), text
        assert "NOT refused" not in text
