"""The training job's device: ``auto``, ``cpu`` or ``cuda``, decided before the worker joins,
and checkpoints that name no device. On a machine without a GPU, and on one with GPUs hidden
(``CUDA_VISIBLE_DEVICES=""``), so that each test means the same anywhere."""
import io
import os
import re
import subprocess
import sys
import time
import zipfile

import pytest
import torch

from adtopk_ps.launcher import free_port
from procs import DIGITS_CNN, bpslaunch
from worker import checkpoint, checkpoint_file, config
from worker.device import resolve
from worker.models import build
from worker.validate import ConfigError

NO_GPU = {"CUDA_VISIBLE_DEVICES": ""}


def _load(*sets):
    return config.load(config.parse_args(["--config", DIGITS_CNN, *[a for s in sets for a in ("--set", s)]]))


def test_the_default_is_auto_and_each_value_loads():
    assert _load()["device"] == "auto"
    assert [_load(f"device={d}")["device"] for d in ("auto", "cpu", "cuda")] == ["auto", "cpu", "cuda"]


def test_auto_takes_the_local_ranks_gpu_where_there_is_one_else_the_cpu():
    assert resolve("cpu") == torch.device("cpu")
    for rank in (0, 1, 5):
        got = resolve("auto", {"BYTEPS_LOCAL_RANK": str(rank)})
        if torch.cuda.is_available():  # more local workers than GPUs share them round-robin
            assert got == torch.device("cuda", rank % torch.cuda.device_count())
            assert resolve("cuda", {"BYTEPS_LOCAL_RANK": str(rank)}) == got
            # bpslaunch --local's workers share one host: each takes its id's GPU
            assert resolve("auto", {"BYTEPS_LOCAL_RANK": "0", "PS_DEVICE_INDEX": str(rank)}) == got
        else:
            assert got == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_a_gpu_is_refused_in_process():
    with pytest.raises(ConfigError, match=r"^config key device='cuda': no GPU to train on: .*; "
                                          r"set device: cpu, or auto"):
        resolve("cuda")


def test_cuda_without_a_gpu_exits_2_before_joining_the_cluster():
    """No scheduler listens and the registration timeout is long: a worker that joined would
    wait; it exits 2 at once, naming the key and why."""
    env = {**os.environ, **NO_GPU, "DMLC_ROLE": "worker", "DMLC_NUM_WORKER": "1",
           "DMLC_NUM_SERVER": "1", "DMLC_PS_ROOT_URI": "127.0.0.1",
           "DMLC_PS_ROOT_PORT": str(free_port()), "DMLC_WORKER_ID": "0", "PS_REGISTER_TIMEOUT_S": "600"}
    began = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "worker", "--config", DIGITS_CNN, "--set", "device=cuda"],
                            env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert re.fullmatch(r"worker: config key device='cuda': no GPU to train on: (this torch \(\S+\) is "
                        r"built without CUDA|torch sees no GPU \(CUDA_VISIBLE_DEVICES=''\)); set device: "
                        r"cpu, or auto to take a GPU only where there is one", result.stderr.strip()), \
        result.stderr
    print(f"refused in {time.monotonic() - began:.1f} s")


def test_cuda_without_a_gpu_stops_the_whole_local_cluster_at_once():
    began = time.monotonic()
    result = bpslaunch("--local", "--num-workers", "2", "--num-servers", "1", "--timeout", "60", "--",
                       sys.executable, "-m", "worker", "--config", DIGITS_CNN, "--set", "device=cuda",
                       env=NO_GPU, timeout=90)
    assert result.returncode == 2, result.stdout[-3000:]
    assert "no GPU to train on" in result.stdout
    assert "exited with status 2 (a usage or configuration error); stopping the others" in result.stdout
    assert time.monotonic() - began < 30, result.stdout[-3000:]


def test_auto_trains_on_the_cpu_without_a_gpu_and_every_worker_says_so():
    result = bpslaunch("--local", "--num-workers", "2", "--num-servers", "1", "--timeout", "100", "--",
                       sys.executable, "-m", "worker", "--config", DIGITS_CNN, "--steps", "3",
                       "--set", "progress=false", env=NO_GPU, timeout=120)
    assert result.returncode == 0, result.stdout[-3000:]
    said = re.findall(r"\[worker (\d)\] worker (\d) of 2 trains on (\S+) \(\d+ threads\)", result.stdout)
    assert sorted(said) == [("0", "0", "cpu"), ("1", "1", "cpu")], result.stdout[-3000:]
    assert "summary: accuracy=" in result.stdout


# --- checkpoints name no device ----------------------------------------------------------

def _trained(device, seed: int):
    torch.manual_seed(seed)
    model = build("cnn", {}).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(8, 1, 8, 8, device=device)
    model(x).square().mean().backward()
    opt.step()  # momentum buffers now exist
    return model, opt


JOB = checkpoint.job_identity(config.DEFAULTS)


def _save(folder, model, opt):
    path = checkpoint.generation_path(folder, 0, 5)
    checkpoint_file.write(path, model, opt, {"step": 5, "workers": 1, "rank": 0, "job": JOB})
    return path


def _payload(path) -> bytes:
    blob = path.read_bytes()
    return blob[len(checkpoint_file.MAGIC):].split(b"\n", 2)[2]


def test_a_checkpoint_is_saved_from_the_cpu_and_loads_onto_the_models_device(tmp_path, device):
    model, opt = _trained(device, 0)
    path = _save(tmp_path, model, opt)
    saved = torch.load(io.BytesIO(_payload(path)), weights_only=True)
    tensors = [*saved["model"].values(), *(t for s in saved["optimizer"]["state"].values() for t in s.values()
                                           if isinstance(t, torch.Tensor))]
    assert len(tensors) > 8 and {t.device.type for t in tensors} == {"cpu"}
    fresh, fresh_opt = _trained(device, 1)
    assert checkpoint.survey(str(tmp_path), 0, 1, JOB).held == {5: str(path.resolve())}
    assert checkpoint.load_into(path, fresh, fresh_opt) is None
    assert checkpoint.parameters_digest(fresh) == checkpoint.parameters_digest(model)
    for p, q in zip(fresh.parameters(), model.parameters()):
        assert p.device == q.device and torch.equal(fresh_opt.state[p]["momentum_buffer"],
                                                    opt.state[q]["momentum_buffer"])


def _as_if_saved_on(path, device: str) -> None:
    """Rewrite the checkpoint at ``path`` as torch.save writes one whose tensors lived on
    ``device`` (their storages' location tags), with its header's checksum to match."""
    source = zipfile.ZipFile(io.BytesIO(_payload(path)))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as rewritten:
        for info in source.infolist():
            blob = source.read(info.filename)
            if info.filename.endswith("data.pkl"):
                tag = len(device).to_bytes(4, "little") + device.encode()
                assert b"X\x03\x00\x00\x00cpu" in blob  # (pickled once, referred to after)
                blob = blob.replace(b"X\x03\x00\x00\x00cpu", b"X" + tag)
            rewritten.writestr(info.filename, blob)
    meta, _ = checkpoint_file.read(path)
    payload = out.getvalue()
    path.write_bytes(checkpoint_file.header_for({k: v for k, v in meta.items() if k != "bytes"}, payload) + payload)


def test_a_checkpoint_saved_on_a_gpu_resumes_on_the_cpu(tmp_path):
    model, opt = _trained("cpu", 0)
    path = _save(tmp_path, model, opt)
    _as_if_saved_on(path, "cuda:0")
    if not torch.cuda.is_available():  # it really names a GPU: torch alone refuses it here
        with pytest.raises(RuntimeError, match="CUDA"):
            torch.load(io.BytesIO(_payload(path)), weights_only=True)
    fresh, fresh_opt = _trained("cpu", 1)
    assert checkpoint.survey(str(tmp_path), 0, 1, JOB).held == {5: str(path.resolve())}
    assert checkpoint.load_into(path, fresh, fresh_opt) is None
    assert checkpoint.parameters_digest(fresh) == checkpoint.parameters_digest(model)
    assert all(fresh_opt.state[p]["momentum_buffer"].device.type == "cpu" for p in fresh.parameters())
