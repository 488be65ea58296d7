"""bpslaunch: the environment contract's errors, and role mode on a hand-made cluster."""
import os
import subprocess
import sys

import pytest

from adtopk_ps.launcher import free_port

from procs import FAST, bpslaunch

CONTRACT = ["DMLC_ROLE", "DMLC_NUM_WORKER", "DMLC_NUM_SERVER", "DMLC_PS_ROOT_URI",
            "DMLC_PS_ROOT_PORT", "DMLC_WORKER_ID", "BYTEPS_LOCAL_SIZE", "BYTEPS_LOCAL_RANK"]


def _run(args, **env):
    clean = {k: v for k, v in os.environ.items() if k not in CONTRACT}
    return subprocess.run([sys.executable, "-m", "adtopk_ps.launcher", *args],
                          env={**clean, **env}, capture_output=True, text=True, timeout=60)


WORKER = {"DMLC_ROLE": "worker", "DMLC_NUM_WORKER": "1", "DMLC_NUM_SERVER": "1",
          "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": "9"}


@pytest.mark.parametrize("env, args, words", [
    ({}, ["true"], "DMLC_ROLE is required"),
    ({**WORKER, "DMLC_ROLE": "chief"}, ["true"], "DMLC_ROLE='chief' must be one of"),
    ({**WORKER, "DMLC_PS_ROOT_URI": ""}, ["true"], "DMLC_PS_ROOT_URI is required"),
    ({**WORKER, "DMLC_NUM_WORKER": "two"}, ["true"], "DMLC_NUM_WORKER='two' is not an integer"),
    ({**WORKER, "DMLC_WORKER_ID": "3"}, ["true"], "DMLC_WORKER_ID=3 must be below DMLC_NUM_WORKER=1"),
    ({**WORKER, "BYTEPS_LOCAL_SIZE": "0"}, ["true"], "BYTEPS_LOCAL_SIZE=0 must be >= 1"),
    (WORKER, [], "DMLC_ROLE=worker needs the training command"),
    ({}, ["--local", "--num-workers", "0", "--", "true"], "--num-workers and --num-servers"),
    ({}, ["--local"], "--local needs the worker command"),
])
def test_contract_errors_exit_non_zero_naming_the_problem(env, args, words):
    result = _run(args, **env)
    assert result.returncode == 2
    assert words in result.stderr


def test_role_mode_runs_a_cluster_started_by_hand():
    """Each role started as a user would on separate machines: bpslaunch with DMLC_* set."""
    port = str(free_port())
    common = {**FAST, "DMLC_NUM_WORKER": "1", "DMLC_NUM_SERVER": "1", "DMLC_PS_ROOT_URI": "127.0.0.1",
              "DMLC_PS_ROOT_PORT": port, "BYTEPS_LOCAL_SIZE": "1"}
    clean = {k: v for k, v in os.environ.items() if k not in CONTRACT}
    launch = [sys.executable, "-m", "adtopk_ps.launcher"]
    procs = [subprocess.Popen(launch, env={**clean, **common, "DMLC_ROLE": role},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for role in ("scheduler", "server")]
    try:
        worker = subprocess.run(
            [*launch, sys.executable, "-m", "worker.selfcheck", "--rounds", "2"],
            env={**clean, **common, "DMLC_ROLE": "worker", "DMLC_WORKER_ID": "0"},
            capture_output=True, text=True, timeout=90)
        assert worker.returncode == 0, worker.stdout + worker.stderr
        assert "[worker] worker 0: selfcheck passed" in worker.stdout
        assert [p.wait(20) for p in procs] == [0, 0]  # scheduler and server exit on their own
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_local_mode_prefixes_output_and_returns_the_first_failure():
    result = bpslaunch("--local", "--num-workers", "2", "--num-servers", "1", "--",
                       sys.executable, "-c",
                       "import os, sys; print('hello from', os.environ['DMLC_WORKER_ID']); "
                       "sys.exit(3 if os.environ['DMLC_WORKER_ID'] == '1' else 0)")
    assert result.returncode == 3
    assert "[worker 0] hello from 0" in result.stdout and "[worker 1] hello from 1" in result.stdout
    assert "worker 1 exited with status 3" in result.stdout


def _children(pid):
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = open(f"/proc/{pid}/stat").read().split(")")[-1].split()
    return stat[0] != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_launcher_killed_with_sigkill_takes_its_role_process_along():
    """A server still waiting for its address book (no scheduler is listening) would wait
    out its registration timeout; with its launcher gone it ends within seconds."""
    import time
    env = {**{k: v for k, v in os.environ.items() if k not in CONTRACT}, **WORKER,
           "DMLC_ROLE": "server", "DMLC_PS_ROOT_PORT": str(free_port()), "PS_REGISTER_TIMEOUT_S": "600"}
    launcher = subprocess.Popen([sys.executable, "-m", "adtopk_ps.launcher"], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while not (kids := _children(launcher.pid)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert kids, "the launcher started no role process"
        time.sleep(1.0)  # the role process is now past exec, waiting to register
        launcher.kill()
        launcher.wait(10)
        deadline = time.monotonic() + 10
        while any(_alive(k) for k in kids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(k) for k in kids), "the role process outlived its launcher"
    finally:
        launcher.kill()
        for k in _children(launcher.pid):
            os.kill(k, 9)


def test_the_guard_refuses_a_parent_that_is_already_gone():
    result = subprocess.run([sys.executable, "-m", "adtopk_ps.deathsig", "1", "true"],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 1 and "parent 1 is gone" in result.stderr
