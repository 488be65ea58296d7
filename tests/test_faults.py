"""A dead peer ends the job with a clear error within seconds, and nothing is left behind."""
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from procs import FAST, selfcheck


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
# every other role ends on its own within this many seconds of a kill -9
BOUND = 3.0


def _kill_mid_round(victim_pattern: str, env=None, sig=signal.SIGKILL):
    """A 3x2 selfcheck job; send ``sig`` to the process whose pid ``victim_pattern`` captures
    (group 1; group 2, if any, is returned too) once worker 1 is past round 3.
    Returns (launcher status, seconds from the signal to the launcher's exit, output, group 2)."""
    marker = str(random.randint(10**8, 10**9))
    cmd = [sys.executable, "-m", "adtopk_ps.launcher", "--local", "--num-workers", "3",
           "--num-servers", "2", "--timeout", "100", "--", sys.executable, "-m", "worker.selfcheck",
           "--rounds", "1000", "--sleep", "0.05", "--seed", marker]
    launcher = subprocess.Popen(cmd, env={**os.environ, **(env or DEFAULTS)}, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
    lines, victim, extra = [], None, None
    try:
        deadline = time.monotonic() + 90
        for line in launcher.stdout:
            lines.append(line)
            found = re.search(victim_pattern, line)
            if found:
                victim = int(found.group(1))
                extra = found.group(2) if found.re.groups > 1 else None
            if victim and "[worker 1] worker 1: round 3 ok" in line:
                break
            assert time.monotonic() < deadline, "".join(lines[-20:])
        os.kill(victim, sig)
        killed_at = time.monotonic()
        rest, _ = launcher.communicate(timeout=60)
        elapsed = time.monotonic() - killed_at
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert _alive_with(marker) == []  # nothing is left running
    return launcher.returncode, elapsed, "".join(lines) + rest, extra


def _ended_on_their_own(out: str) -> None:
    assert "[bpslaunch] killing" not in out, out[-3000:]  # nobody waited for the launcher's grace


def test_worker_killed_mid_round_ends_the_job_with_a_named_error():
    status, elapsed, out, _ = _kill_mid_round(r"\[worker 1\] worker 1/3 pid=(\d+)")
    assert status == 137, out[-3000:]  # the first failure: worker 1, SIGKILL
    assert elapsed < BOUND, (elapsed, out[-3000:])
    named = r"worker 1 \(127\.0\.0\.1\) lost: its connection to the scheduler closed"
    for role in ("worker 0", "worker 2", "server 0", "server 1", "scheduler"):
        assert re.search(rf"\[{role}\] .*{named}", out), (role, out[-3000:])
    _ended_on_their_own(out)


def test_server_killed_mid_round_ends_the_job_naming_it():
    status, elapsed, out, port = _kill_mid_round(
        r"\[server 0\] .* serving on port (?=\d+ \(pid (\d+)\))(\d+)")
    assert status == 137 and elapsed < BOUND, (status, elapsed, out[-3000:])
    # by the scheduler's notice or by the worker's own connection, whichever comes first
    named = rf"server \d \(tcp://127\.0\.0\.1:{port}\) lost: its connection"
    for role in ("worker 0", "worker 1", "worker 2", "scheduler"):
        assert re.search(rf"\[{role}\] .*{named}", out), (role, out[-3000:])
    _ended_on_their_own(out)


def test_scheduler_killed_ends_every_role_naming_it():
    status, elapsed, out, _ = _kill_mid_round(r"\[scheduler\] .* listening on port .* \(pid (\d+)\)")
    assert status == 137 and elapsed < BOUND, (status, elapsed, out[-3000:])
    for role in ("worker 0", "worker 1", "worker 2", "server 0", "server 1"):
        assert re.search(rf"\[{role}\] .*scheduler at tcp://127\.0\.0\.1:\d+ lost: its "
                         rf"connection closed", out), (role, out[-3000:])
    _ended_on_their_own(out)


def test_a_stopped_worker_ends_the_job_by_heartbeats():
    """SIGSTOP closes nothing: the heartbeat timeout (2 s here) finds it."""
    status, elapsed, out, _ = _kill_mid_round(r"\[worker 1\] worker 1/3 pid=(\d+)", env=FAST,
                                              sig=signal.SIGSTOP)
    assert status != 0 and elapsed < 2 + 5 + 5, (status, elapsed, out[-3000:])
    named = r"worker 1 \(127\.0\.0\.1\) lost: no heartbeat for [\d.]+ s"
    for role in ("worker 0", "worker 2", "server 0", "server 1", "scheduler"):
        assert re.search(rf"\[{role}\] .*{named}", out), (role, out[-3000:])


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
