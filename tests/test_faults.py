"""A dead peer ends the job with a clear error within seconds, and nothing is left behind."""
import os
import random
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from procs import FAST, bpslaunch, selfcheck


def _alive_with(marker: str) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and marker in (proc / "cmdline").read_bytes().decode(errors="ignore"):
                pids.append(int(proc.name))
        except OSError:
            pass
    return pids


# PS's own defaults, not the FAST heartbeats: a closed connection must not need a heartbeat
DEFAULTS = {"PS_HEARTBEAT_INTERVAL_MS": "500", "PS_HEARTBEAT_TIMEOUT_MS": "10000"}
# every other role reports the dead peer and ends the job within this many seconds of a kill -9
BOUND = 3.0
# ... and its process is gone within this many: the interpreter's own teardown with torch
# loaded takes a few tenths of a second of CPU, several seconds on a crowded CI machine;
# the launcher's grace (heartbeat timeout + 5 s) is far longer
EXIT_BOUND = 10.0


@dataclass
class Killed:
    status: int
    exited: float  # seconds from the signal to the launcher's exit
    lines: list  # (seconds after the signal, line); negative before it
    extra: str | None  # the victim pattern's second group

    @property
    def out(self) -> str:
        return "".join(line for _, line in self.lines)

    def reported(self, role: str, pattern: str) -> float:
        """When ``role`` first printed a line matching ``pattern`` (seconds after the signal)."""
        for at, line in self.lines:
            if line.startswith(f"[{role}] ") and re.search(pattern, line):
                return at
        raise AssertionError(f"{role} never printed {pattern!r}:\n{self.out[-3000:]}")

    def every_role_reported(self, roles, pattern: str, bound: float) -> None:
        times = {role: self.reported(role, pattern) for role in roles}
        print(f"reported after the signal: {times}; launcher exited after {self.exited:.2f} s")
        assert max(times.values()) < bound, (times, self.out[-3000:])


def _kill_mid_round(victim_pattern: str, env=None, sig=signal.SIGKILL, servers: int = 2) -> Killed:
    """A selfcheck job of 3 workers and ``servers`` servers; send ``sig`` to the process whose
    pid ``victim_pattern`` captures (group 1) once worker 1 is past round 3, and time every
    line that follows."""
    marker = str(random.randint(10**8, 10**9))
    cmd = [sys.executable, "-m", "adtopk_ps.launcher", "--local", "--num-workers", "3",
           "--num-servers", str(servers), "--timeout", "100", "--", sys.executable, "-m", "worker.selfcheck",
           "--rounds", "1000", "--sleep", "0.05", "--seed", marker]
    launcher = subprocess.Popen(cmd, env={**os.environ, **(env or DEFAULTS)}, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
    lines, victim, extra, killed_at = [], None, None, None
    try:
        deadline = time.monotonic() + 90
        for line in launcher.stdout:
            lines.append((time.monotonic(), line))
            found = re.search(victim_pattern, line)
            if found and killed_at is None:
                victim = int(found.group(1))
                extra = found.group(2) if found.re.groups > 1 else None
            if victim and killed_at is None and "[worker 1] worker 1: round 3 ok" in line:
                os.kill(victim, sig)
                killed_at = time.monotonic()
            assert time.monotonic() < deadline + (60 if killed_at else 0), lines[-20:]
        launcher.wait(60)
        exited = time.monotonic() - killed_at
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert _alive_with(marker) == []  # nothing is left running
    return Killed(launcher.returncode, exited, [(t - killed_at, line) for t, line in lines], extra)


def _ended_on_their_own(job: Killed) -> None:
    assert "[bpslaunch] killing" not in job.out, job.out[-3000:]  # none needed the launcher's grace
    assert job.exited < EXIT_BOUND, (job.exited, job.out[-3000:])


def test_worker_killed_mid_round_ends_the_job_with_a_named_error():
    job = _kill_mid_round(r"\[worker 1\] worker 1/3 pid=(\d+)")
    assert job.status == 137, job.out[-3000:]  # the first failure: worker 1, SIGKILL
    job.every_role_reported(("worker 0", "worker 2", "server 0", "server 1", "scheduler"),
                            r"worker 1 \(127\.0\.0\.1\) lost: its connection to the scheduler closed",
                            BOUND)
    _ended_on_their_own(job)


def test_server_killed_mid_round_ends_the_job_naming_it():
    job = _kill_mid_round(r"\[server 0\] .* serving on port (?=\d+ \(pid (\d+)\))(\d+)")
    assert job.status == 137, job.out[-3000:]
    # by the scheduler's notice or by the worker's own connection, whichever comes first
    job.every_role_reported(("worker 0", "worker 1", "worker 2", "scheduler"),
                            rf"server \d \(tcp://127\.0\.0\.1:{job.extra}\)(: their| lost: its) connection",
                            BOUND)
    _ended_on_their_own(job)


def test_the_last_server_killed_ends_even_an_elastic_job_naming_it():
    # an elastic job re-forms without a lost server; the last one's keys have nowhere to go
    job = _kill_mid_round(r"\[server 0\] .* serving on port (?=\d+ \(pid (\d+)\))(\d+)",
                          env={**DEFAULTS, "PS_MIN_WORKERS": "2"}, servers=1)
    assert job.status == 137, job.out[-3000:]
    assert "no other server remains to take its keys" in job.out, job.out[-3000:]
    assert "going on with" not in job.out, job.out[-3000:]
    _ended_on_their_own(job)


def test_scheduler_killed_ends_every_role_naming_it():
    job = _kill_mid_round(r"\[scheduler\] .* listening on port .* \(pid (\d+)\)")
    assert job.status == 137, job.out[-3000:]
    job.every_role_reported(("worker 0", "worker 1", "worker 2", "server 0", "server 1"),
                            r"scheduler at tcp://127\.0\.0\.1:\d+ lost: its connection closed", BOUND)
    _ended_on_their_own(job)


def test_a_stopped_worker_ends_the_job_by_heartbeats():
    """SIGSTOP closes nothing: the heartbeat timeout (2 s here) finds it."""
    job = _kill_mid_round(r"\[worker 1\] worker 1/3 pid=(\d+)", env=FAST, sig=signal.SIGSTOP)
    assert job.status != 0, job.out[-3000:]
    job.every_role_reported(("worker 0", "worker 2", "server 0", "server 1", "scheduler"),
                            r"worker 1 \(127\.0\.0\.1\) lost: no heartbeat for [\d.]+ s", 2 + 3)


def test_a_slow_worker_delays_the_others_but_every_aggregate_stays_exact(tmp_path):
    """Worker 1 sleeps 0.4 s before every round: the job completes with every sum exact,
    and the others' rounds take about that long (they wait for it), while its own do not."""
    import json
    import statistics
    report = str(tmp_path / "{rank}.json")
    result = selfcheck(3, 2, "--rounds", "8", "--slow-rank", "1", "--slow-seconds", "0.4",
                       "--report", report)
    assert result.returncode == 0, result.stdout[-3000:]
    assert result.stdout.count("selfcheck passed") == 3
    waits = {r: statistics.median(json.load(open(report.format(rank=r)))["latencies_s"])
             for r in range(3)}
    print(f"median round latency by rank: {waits}")
    assert waits[0] > 0.3 and waits[2] > 0.3  # they waited for the straggler
    assert waits[1] < 0.2  # its pushes come last, so its rounds complete at once


def _fails_within_40_s(program: str, env: dict) -> str:
    """The output of ``program`` run by two workers and a server (``bpslaunch --local``),
    a job that must fail within 40 s."""
    began = time.monotonic()
    result = bpslaunch("--local", "--num-workers", "2", "--num-servers", "1", "--",
                       sys.executable, "-c", program, env=env, timeout=90)
    took = time.monotonic() - began
    assert result.returncode != 0 and took < 40, (took, result.stdout[-3000:])
    return result.stdout


def test_a_worker_whose_loop_hangs_is_named_then_the_job_ends():
    """Worker 1's process and heartbeats stay alive but it never pushes (a stuck data loader):
    after PS_STALL_WARN_S the waiting worker names it and the tensor, the scheduler names it,
    and after PS_STALL_ABORT_S the job ends on every role, naming it."""
    program = ("import time, torch, adtopk_ps.torch as bps\n"
               "bps.init()\n"
               "if bps.rank() == 0:\n"
               "    bps.client().push_pull(torch.ones(4, 4), 'stuck.tensor').wait()\n"
               "else:\n"
               "    time.sleep(120)\n")
    out = _fails_within_40_s(program, {"PS_STALL_WARN_S": "2", "PS_STALL_ABORT_S": "5"})
    assert re.search(r"\[worker 0\] .*worker 0: 1 round\(s\) on server 0 have waited \d+ s for "
                     r"worker\(s\) \[1\].*tensors: stuck\.tensor", out), out[-3000:]
    assert re.search(r"\[scheduler\] .*have waited \d+ s for worker 1 \(127\.0\.0\.1\)", out)
    for role in ("worker 0", "server 0"):
        assert re.search(rf"\[{role}\] .*the job stalled: .* for worker 1", out), role


def test_a_worker_whose_main_thread_hangs_exits_by_itself_once_the_job_ended():
    """Worker 1 dies; worker 0's main thread sleeps in its own code, never calling into the
    cluster again. Its engine hears the job ended and, PS_EXIT_GRACE_S later, ends the process
    itself, naming why (before, it waited for bpslaunch to kill it, and on a pod, forever)."""
    program = ("import os, signal, time, torch, adtopk_ps.torch as bps\n"
               "bps.init()\n"
               "bps.client().push_pull(torch.ones(4, 4), 'x').wait()\n"
               "if bps.rank() == 1:\n"
               "    os.kill(os.getpid(), signal.SIGKILL)\n"
               "time.sleep(120)\n")
    out = _fails_within_40_s(program, {**DEFAULTS, "PS_EXIT_GRACE_S": "2"})
    assert re.search(r"\[worker 0\] worker 0: worker 1 \(127\.0\.0\.1\) lost: .*; this process's "
                     r"main thread did not end it within 2 s \(PS_EXIT_GRACE_S\): exiting", out), out[-3000:]
    assert "[bpslaunch] killing" not in out, out[-3000:]  # it did not need the launcher's grace
