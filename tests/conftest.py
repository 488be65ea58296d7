import subprocess

import pytest
import torch
from hypothesis import settings

import adtopk_ps.torch as bps
from adtopk_ps.torch.runtime import close
from procs import roles

settings.register_profile("ci", deadline=None, max_examples=100, derandomize=False)
settings.load_profile("ci")

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES)
def device(request):
    return torch.device(request.param)


@pytest.fixture
def session():
    """adtopk_ps.torch initialised in this process against a real scheduler and server."""
    with roles(1, 1) as (config, _):
        bps.init(config=config)
        yield
        close()


@pytest.fixture
def small_disk(tmp_path):
    """A tmpfs of its own, resized with ``resize(bytes)``; skipped where mounting is not allowed."""
    folder = tmp_path / "disk"
    folder.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(folder)],
                      capture_output=True).returncode:
        pytest.skip("mounting a tmpfs needs root (CAP_SYS_ADMIN)")

    def resize(size):
        subprocess.run(["mount", "-o", f"remount,size={size}", str(folder)], check=True)
    try:
        yield folder, resize
    finally:
        subprocess.run(["umount", "-l", str(folder)])
