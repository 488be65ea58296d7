"""Servers beside the workers (``bpslaunch --colocate-servers``, ``BYTEPS_COLOCATE_SERVERS=1``):
S = W with --local and on worker hosts in role mode, real processes on loopback."""
import os
import re
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from adtopk_ps.launcher import free_port
from adtopk_ps.testing.roles import role_pids
from procs import FAST, bpslaunch

LAUNCH = [sys.executable, "-m", "adtopk_ps.launcher"]
CONTRACT = ["DMLC_ROLE", "DMLC_NUM_WORKER", "DMLC_NUM_SERVER", "DMLC_PS_ROOT_URI", "DMLC_PS_ROOT_PORT",
            "DMLC_WORKER_ID", "BYTEPS_LOCAL_SIZE", "BYTEPS_LOCAL_RANK", "PS_SERVER_ID",
            "BYTEPS_COLOCATE_SERVERS", "PS_MIN_WORKERS", "PS_MAX_WORKERS"]
SELFCHECK = [sys.executable, "-m", "worker.selfcheck", "--compressor", "adtopk", "--ef"]
ELASTIC_TRAIN = str(Path(__file__).resolve().parent / "programs" / "elastic_train.py")


def _serving(out: str) -> list[int]:
    """The server ranks whose own start-up line appears under their label."""
    return sorted(int(a) for a, b in re.findall(r"\[server (\d+)\] .* server (\d+) serving on port", out)
                  if a == b)


def test_local_colocated_runs_a_server_per_worker_and_sums_exactly():
    result = bpslaunch("--local", "--colocate-servers", "--num-workers", "2", "--timeout", "60", "--",
                       *SELFCHECK, "--rounds", "4", timeout=90)
    assert result.returncode == 0, result.stdout[-3000:]
    assert len(re.findall(r"\[worker \d\] worker \d: selfcheck passed: 4 rounds", result.stdout)) == 2
    assert _serving(result.stdout) == [0, 1], result.stdout[-3000:]


class _Host:
    """One role started by hand as on a machine of its own, its output read as it comes."""

    def __init__(self, argv: list[str], env: dict):
        self.proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self._reader.start()

    @property
    def out(self) -> str:
        return "".join(self.lines)

    def wait_for(self, pattern: str, limit: float) -> None:
        deadline = time.monotonic() + limit
        while not re.search(pattern, self.out):
            assert self.proc.poll() is None and time.monotonic() < deadline, self.out[-3000:]
            time.sleep(0.05)

    def finish(self, limit: float) -> int:
        code = self.proc.wait(limit)
        self._reader.join(5)
        return code


def _environment(hosts: int, **extra: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if k not in CONTRACT}
    return {**clean, **FAST, "DMLC_NUM_WORKER": str(hosts), "DMLC_NUM_SERVER": str(hosts),
            "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": str(free_port()),
            "DMLC_NODE_HOST": "127.0.0.1", "BYTEPS_LOCAL_SIZE": "1", **extra}


@contextmanager
def _colocated_hosts(command: list[str], hosts: int = 2, **extra: str):
    """A scheduler and ``hosts`` worker hosts, each ``bpslaunch --colocate-servers`` (host 0
    with the flag, the others with BYTEPS_COLOCATE_SERVERS=1, as a pod would set it)."""
    env = _environment(hosts, **extra)
    started = [_Host(LAUNCH, {**env, "DMLC_ROLE": "scheduler"})]
    started += [_Host([*LAUNCH, *(["--colocate-servers"] if h == 0 else []), *command],
                      {**env, "DMLC_ROLE": "worker", "DMLC_WORKER_ID": str(h),
                       **({} if h == 0 else {"BYTEPS_COLOCATE_SERVERS": "1"})})
                for h in range(hosts)]
    try:
        yield started
    finally:
        for host in started:
            if host.proc.poll() is None:
                host.proc.kill()
            host.proc.wait()


def test_role_mode_hosts_each_run_a_server_beside_their_worker_and_the_job_exits_0():
    with _colocated_hosts([*SELFCHECK, "--rounds", "4"]) as (scheduler, *hosts):
        codes = [h.finish(60) for h in (scheduler, *hosts)]
        assert codes == [0, 0, 0], [h.out[-2000:] for h in (scheduler, *hosts)]
        for rank, host in enumerate(hosts):
            assert f"[worker] worker {rank}: selfcheck passed: 4 rounds" in host.out, host.out[-2000:]
            assert _serving(host.out) == [rank], host.out[-2000:]
        assert len(re.findall(r"registered server at", scheduler.out)) == 2, scheduler.out[-2000:]


def test_role_mode_a_server_killed_mid_job_fails_the_job_naming_it():
    with _colocated_hosts([*SELFCHECK, "--rounds", "100000"]) as (scheduler, *hosts):
        hosts[1].wait_for(r"\[worker\] worker 1: round 3 ok", 120)
        [server] = role_pids(hosts[1].proc.pid, "server", 1)
        os.kill(server, signal.SIGKILL)
        began = time.monotonic()
        codes = [h.finish(40) for h in (scheduler, *hosts)]
        outs = [h.out for h in (scheduler, *hosts)]
    assert codes[2] == 128 + signal.SIGKILL, outs[2][-2000:]
    assert "[bpslaunch] server 1 exited with status 137" in outs[2], outs[2][-2000:]
    assert codes[0] != 0 and codes[1] != 0, outs  # the job failed on every host
    for out in outs:  # the scheduler, the other host's worker and its own name the lost server
        assert re.search(r"server 1 \(tcp://[\d.:]+\)", out), out[-2000:]
    assert time.monotonic() - began < 30


@pytest.mark.parametrize("args, env, words", [
    (["--local", "--colocate-servers", "--num-workers", "2", "--num-servers", "3", "--", "true"], {},
     "--num-servers 3 contradicts --num-workers 2"),
    (["--local", "--", "true"], {"BYTEPS_COLOCATE_SERVERS": "yes"},
     "BYTEPS_COLOCATE_SERVERS='yes' must be 0 or 1"),
    (["--colocate-servers", "true"], {"DMLC_ROLE": "worker", "DMLC_WORKER_ID": "0", "DMLC_NUM_SERVER": "1"},
     "DMLC_NUM_SERVER=1 must equal DMLC_NUM_WORKER=2"),
    (["--colocate-servers", "true"], {"DMLC_ROLE": "worker"}, "DMLC_WORKER_ID, which is not set"),
    (["--colocate-servers", "true"], {"DMLC_ROLE": "worker", "DMLC_WORKER_ID": "1", "PS_SERVER_ID": "0"},
     "its PS_SERVER_ID is DMLC_WORKER_ID=1, but PS_SERVER_ID=0 is set"),
    ([], {"DMLC_ROLE": "server", "BYTEPS_COLOCATE_SERVERS": "1"}, "would be one too many"),
])
def test_a_combination_colocation_cannot_run_exits_2_naming_it(args, env, words):
    result = subprocess.run([*LAUNCH, *args], env={**_environment(2), **env}, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2, result.stdout + result.stderr
    assert words in result.stderr and "[" not in result.stdout, result.stdout + result.stderr


# -- elastic jobs: a restarted worker does not restart its server; a host's roles fail alone ----

ELASTIC = {"PS_HEARTBEAT_TIMEOUT_MS": "6000"}  # as tests/test_elastic.py: kills are seen by hang-ups


def _done(out: str) -> list[tuple[int, int, str]]:
    """(step, size, digest) of every worker of elastic_train.py that finished."""
    return [(int(s), int(n), d) for s, n, d in re.findall(r"done step=(\d+) size=(\d+) digest=(\w+)", out)]


def test_local_colocated_restarted_worker_joins_and_its_server_is_not_restarted():
    result = bpslaunch("--local", "--colocate-servers", "--num-workers", "3", "--min-workers", "2",
                       "--restarts", "1", "--timeout", "100", "--", sys.executable, ELASTIC_TRAIN,
                       "--steps", "40", "--kill=1:5", "--step-s=0.15", env=ELASTIC, timeout=130)
    assert result.returncode == 0, result.stdout[-3000:]
    # on a loaded machine the job may finish before the restart has imported torch: then it
    # is stopped unjoined, which is no failure either
    size = 3 if "joined the running job" in result.stdout else 2
    done = _done(result.stdout)
    assert {(step, n) for step, n, _ in done} == {(40, size)} and len(done) == size, result.stdout[-3000:]
    assert len({digest for *_, digest in done}) == 1, done
    assert "restarting worker 1 (restart 1 of 1)" in result.stdout
    assert _serving(result.stdout) == [0, 1, 2], result.stdout[-3000:]  # each started once


@pytest.mark.parametrize("victim", ["worker", "server", "host"])
def test_role_mode_elastic_job_goes_on_without_a_hosts_role_or_the_host(victim):
    """PS_MIN_WORKERS=1: host 1's worker (killed by the program), its server, or its whole
    bpslaunch (a lost host: both roles die with it) is killed at step 5; the job re-forms
    without it and finishes. On a live host the other role runs to the job's end, and host
    1's bpslaunch then exits with the dead role's status."""
    kill = ["--kill=1:5"] if victim == "worker" else []
    command = [sys.executable, ELASTIC_TRAIN, "--steps", "20", "--step-s=0.1", *kill]
    with _colocated_hosts(command, PS_MIN_WORKERS="1", **ELASTIC) as (scheduler, *hosts):
        if victim != "worker":
            hosts[1].wait_for(r"\[worker\] worker 1: step 5 ", 120)
            [pid] = role_pids(hosts[1].proc.pid, "server", 1) if victim == "server" else [hosts[1].proc.pid]
            os.kill(pid, signal.SIGKILL)
        codes = [h.finish(90) for h in (scheduler, *hosts)]
        outs = [h.out for h in (scheduler, *hosts)]
    lost = -signal.SIGKILL if victim == "host" else 128 + signal.SIGKILL
    assert codes == [0, 0, lost], [out[-2000:] for out in outs]
    survivors = _done(outs[1] + outs[2])
    if victim == "server":  # host 1's worker trained on with the one server left
        assert "[bpslaunch] server 1 exited with status 137; an elastic job goes on" in outs[2]
        assert [(s, n) for s, n, _ in survivors] == [(20, 2), (20, 2)], outs[2][-2000:]
        assert len({d for *_, d in survivors}) == 1
        return
    assert [(s, n) for s, n, _ in survivors] == [(20, 1)], outs[1][-2000:]
    if victim == "worker":  # host 1's server served the job to its end, and was stopped by it
        assert "[bpslaunch] worker exited with status 137; an elastic job goes on" in outs[2]
        assert "server 1 shutting down" in outs[2], outs[2][-2000:]
    else:
        assert re.search(r"server 1 \(tcp://[\d.:]+\) lost", outs[0]), outs[0][-2000:]
