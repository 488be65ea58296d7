"""benchmarks/gpu_check.sh checks its prerequisites before any step and stops naming each one
missing (--check-only runs that part alone, in seconds). The whole check's flow runs on a CPU
with --cpu-dry-run, which is too long for here (about a minute)."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
COMPILERS = ("gcc", "cc")

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="bash is not installed")


def check(tmp_path: Path, *args: str, path: str | None = None, python: str = sys.executable
          ) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": python, "OUT": str(tmp_path / "out")}
    env.pop("CC", None)
    if path is not None:
        env["PATH"] = path
    return subprocess.run(["bash", str(SCRIPT), "--check-only", *args], capture_output=True,
                          text=True, timeout=120, cwd=ROOT, env=env)


def without_compilers(tmp_path: Path) -> str:
    """A PATH of links to every program on this one but the C compilers."""
    farm = tmp_path / "bin"
    farm.mkdir()
    for folder in os.environ["PATH"].split(os.pathsep):
        if not os.path.isdir(folder):
            continue
        for name in os.listdir(folder):
            if name in COMPILERS or name.startswith(("gcc", "x86_64-linux-gnu-gcc")):
                continue
            if not (farm / name).exists() and os.access(os.path.join(folder, name), os.X_OK):
                (farm / name).symlink_to(os.path.join(folder, name))
    return str(farm)


def test_a_dry_run_with_everything_there_passes_the_check(tmp_path):
    if shutil.which("gcc") is None:
        pytest.skip("no gcc here")
    run = check(tmp_path, "--cpu-dry-run")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "prerequisites: ok: python" in run.stdout
    assert "torch" in run.stdout and "pyzmq" in run.stdout and "msgpack" in run.stdout
    assert "===" not in run.stdout  # --check-only: no step ran


def test_a_missing_compiler_is_named_and_nothing_runs(tmp_path):
    run = check(tmp_path, "--cpu-dry-run", path=without_compilers(tmp_path))
    assert run.returncode == 2, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert "GPU check: missing prerequisites:" in lines
    assert any(line.startswith("  gcc: no C compiler 'gcc' on PATH: the build step (setup.py "
                               "build_ext)") for line in lines), run.stdout
    assert lines[-1] == "GPU check: failed: prerequisites"
    assert "===" not in run.stdout


def test_a_missing_python_is_named(tmp_path):
    run = check(tmp_path, python=str(tmp_path / "no-such-python"))
    assert run.returncode == 2
    assert f"  python: no '{tmp_path / 'no-such-python'}' here" in run.stdout
    assert run.stdout.splitlines()[-1] == "GPU check: failed: prerequisites"


def test_missing_modules_are_named_with_how_to_carry_them(tmp_path):
    # a python that has none of the project's modules: each named, pyzmq with its wheel command
    bare = tmp_path / "bare-python"
    bare.write_text(f"#!/bin/sh\nexec {sys.executable} -I -S \"$@\"\n")  # no site-packages
    bare.chmod(0o755)
    run = check(tmp_path, "--cpu-dry-run", python=str(bare))
    assert run.returncode == 2, run.stdout + run.stderr
    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    for label in ("torch", "triton", "pyzmq", "msgpack", "pytest (for the tests step)"):
        assert f"\n  {label}: cannot import" in run.stdout, (label, run.stdout)
    assert (f"pip download --no-deps --only-binary=:all: --python-version {version} "
            f"--platform manylinux_2_28_x86_64 -d .whl pyzmq") in run.stdout


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has a GPU")
def test_without_a_gpu_the_real_check_names_what_is_missing(tmp_path):
    run = check(tmp_path)
    assert run.returncode == 2, run.stdout + run.stderr
    assert "  nvidia-smi: not on PATH" in run.stdout
    assert "  torch with CUDA: torch " in run.stdout


def _gpu_kernel():
    import importlib.util
    spec = importlib.util.spec_from_file_location("gpu_kernel", ROOT / "benchmarks" / "gpu_kernel.py")
    module = sys.modules["gpu_kernel"] = importlib.util.module_from_spec(spec)  # its dataclasses
    spec.loader.exec_module(module)
    return module


def test_kernel_times_are_trusted_only_where_the_gpu_never_waited_for_the_host():
    # stamps as seconds: a mark after each sleep, then (start, end) of each launch of the call
    gk = _gpu_kernel()

    class Stamps:
        clock = type("Clock", (), {"seconds": staticmethod(lambda a, b: b - a)})()
        pairs = [[10e-6, 60e-6], [61e-6, 90e-6],  # call 0: the upload, then back to back
                 [1000e-6, 1050e-6]]              # call 1: one launch
    marks = [(0.0, 0), (990e-6, 2)]
    assert gk.idle(Stamps, marks) == 0.0
    Stamps.pairs[1] = [85e-6, 100e-6]  # 25 us between two launches of one call: host time
    assert gk.idle(Stamps, marks) == pytest.approx(25e-6)
    Stamps.pairs[1] = [61e-6, 90e-6]
    marks[1] = (700e-6, 2)  # 300 us from the sleep's end to the launch: more than an upload
    assert gk.idle(Stamps, marks) == pytest.approx(300e-6)
