"""bpslaunch: the environment contract's errors, and role mode on a hand-made cluster."""
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from adtopk_ps.launcher import Child, free_port, supervise

from procs import DIGITS_CNN, FAST, bpslaunch

CONTRACT = ["DMLC_ROLE", "DMLC_NUM_WORKER", "DMLC_NUM_SERVER", "DMLC_PS_ROOT_URI",
            "DMLC_PS_ROOT_PORT", "DMLC_WORKER_ID", "BYTEPS_LOCAL_SIZE", "BYTEPS_LOCAL_RANK"]
LAUNCH = [sys.executable, "-m", "adtopk_ps.launcher"]


def _by_hand(workers: int, servers: int) -> dict:
    """The environment of roles started by hand, as on separate machines (no DMLC_ROLE yet),
    on a free port of this host."""
    clean = {k: v for k, v in os.environ.items() if k not in CONTRACT}
    return {**clean, **FAST, "DMLC_NUM_WORKER": str(workers), "DMLC_NUM_SERVER": str(servers),
            "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": str(free_port()),
            "DMLC_NODE_HOST": "127.0.0.1", "BYTEPS_LOCAL_SIZE": "1"}


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
    env = _by_hand(workers=1, servers=1)
    procs = [subprocess.Popen(LAUNCH, env={**env, "DMLC_ROLE": role},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for role in ("scheduler", "server")]
    try:
        worker = subprocess.run(
            [*LAUNCH, sys.executable, "-m", "worker.selfcheck", "--rounds", "2"],
            env={**env, "DMLC_ROLE": "worker", "DMLC_WORKER_ID": "0"},
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


NOTICE = ("import logging, adtopk_ps.torch as bps; logging.basicConfig(); bps.init(); "
          "logging.getLogger('adtopk_ps.check').info('a worker notice'); bps.shutdown()")


@pytest.mark.parametrize("verbose", ["0", "1"])
def test_ps_verbose_sets_every_roles_log_level(verbose):
    """PS_VERBOSE=1: the scheduler's, a server's and a worker's INFO lines; 0: none of them."""
    result = bpslaunch("--local", "--num-workers", "1", "--num-servers", "1", "--",
                       sys.executable, "-c", NOTICE, env={"PS_VERBOSE": verbose}, timeout=60)
    assert result.returncode == 0, result.stdout[-3000:]
    lines = ("[scheduler] ", "INFO scheduler listening on port"), \
        ("[server 0] ", "INFO server 0 serving on port"), ("[worker 0] ", "INFO:adtopk_ps.check:a worker notice")
    for prefix, line in lines:
        logged = any(row.startswith(prefix) and line in row for row in result.stdout.splitlines())
        assert logged == (verbose == "1"), (prefix, line, result.stdout[-3000:])


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


# -- exit status: every mode returns the first failure's status ------------------------------

EXIT_MODES = [  # (python -c program, the status bpslaunch must return)
    ("pass", 0),
    ("import sys; sys.exit(1)", 1),
    ("import sys; sys.exit(3)", 3),
    ("raise RuntimeError('boom')", 1),
    ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", 137),
]


@pytest.mark.parametrize("program, status", EXIT_MODES)
def test_role_mode_worker_returns_its_command_status(program, status):
    result = _run([sys.executable, "-c", program], **WORKER, BYTEPS_LOCAL_SIZE="1")
    assert result.returncode == status, result.stdout + result.stderr


def test_role_mode_returns_the_first_failure_of_several_local_ranks():
    rank_exits = "import os, sys; sys.exit({1: 3}.get(int(os.environ['BYTEPS_LOCAL_RANK']), 0))"
    result = _run([sys.executable, "-c", rank_exits], **WORKER, BYTEPS_LOCAL_SIZE="3")
    assert result.returncode == 3, result.stdout + result.stderr
    assert "worker 0.1 exited with status 3" in result.stderr


def test_role_mode_server_returns_its_real_status():
    """A server that cannot reach its scheduler gives up after the registration timeout."""
    result = _run([], **{**WORKER, "DMLC_ROLE": "server", "PS_REGISTER_TIMEOUT_S": "1",
                         "DMLC_PS_ROOT_PORT": str(free_port())})
    assert result.returncode == 1, result.stdout + result.stderr
    assert "[server]" in result.stdout and "gave up after 1 s (PS_REGISTER_TIMEOUT_S)" in result.stdout


def test_local_mode_returns_every_exit_mode_and_servers_are_labelled_by_rank():
    """One --local job per exit mode, run side by side; the one that succeeds runs the real
    protocol (two servers, whose prefixes name the ranks they report)."""
    quick = {"PS_HEARTBEAT_INTERVAL_MS": "100", "PS_HEARTBEAT_TIMEOUT_MS": "400"}
    jobs = [(["--num-servers", "2", "--", sys.executable, "-m", "worker.selfcheck", "--rounds", "1"], 0)]
    jobs += [(["--", sys.executable, "-c", program], status) for program, status in EXIT_MODES[1:]]
    procs = [subprocess.Popen([sys.executable, "-m", "adtopk_ps.launcher", "--local",
                               "--num-workers", "2", "--timeout", "60", *args],
                              env={**os.environ, **FAST, **quick}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for args, _ in jobs]
    try:
        outputs = [p.communicate(timeout=90)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for (args, status), p, out in zip(jobs, procs, outputs):
        assert p.returncode == status, (args, out[-2000:])
    for rank in (0, 1):
        assert re.search(rf"\[server {rank}\] .* server {rank} serving on port", outputs[0]), outputs[0]


def _fifo(tmp_path, name):
    path = tmp_path / name
    os.mkfifo(path)
    return str(path), os.open(path, os.O_RDWR)  # held open: readers never see EOF early


def _opened(pid, path):
    try:
        return any(os.readlink(f"/proc/{pid}/fd/{fd}") == path for fd in os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_racy_endings_always_return_the_first_failure(tmp_path):
    """Children released by one write to a FIFO end within microseconds of each other, many
    times over: all failing at once, one failing as the others succeed, a death by signal among
    successes, and a job with a role that never ends by itself (stopped after the grace)."""
    endings = {  # per child: a shell command run once released; the statuses that may win
        "all fail": (["exit 5", "exit 6", "exit 7"], {5, 6, 7}),
        "one fails as the others succeed": (["exit 0", "exit 3", "exit 0"], {3}),
        "a signal among successes": (["exit 0", "kill -9 $$", "exit 0"], {137}),
        "a role left running": (["exec sleep 30", "exit 4", "exit 0"], {4}),
    }
    repeats = 12
    lock = threading.Lock()
    runs = []
    for name, (commands, allowed) in endings.items():
        for i in range(repeats):
            path, fd = _fifo(tmp_path, f"{len(runs)}")
            children = [Child(f"{name} {i}.{j}", ["sh", "-c", f"read _ < \"$0\"; {cmd}", path],
                              os.environ, lock)
                        for j, cmd in enumerate(commands)]
            runs.append((name, allowed, path, fd, children))
    start = time.monotonic()
    try:
        for name, allowed, path, fd, children in runs:
            deadline = time.monotonic() + 30
            while not all(_opened(c.proc.pid, path) for c in children):
                assert time.monotonic() < deadline, f"{name}: children never opened {path}"
                time.sleep(0.005)
            os.write(fd, b"\n" * len(children))  # one line each: released together
            status = supervise(children, grace=0.2, timeout=None)
            assert status in allowed, (name, status, [c.code for c in children])
    finally:
        for *_, fd, children in runs:
            os.close(fd)
            for c in children:
                c.kill()
                c.join()
    print(f"{len(runs)} racy endings in {time.monotonic() - start:.1f} s")


# -- stopping: usage errors at once, Ctrl-C and SIGTERM within 2 s -----------------------------

def _local_job(*worker_args, servers=1):
    return subprocess.Popen([sys.executable, "-m", "adtopk_ps.launcher", "--local", "--num-workers", "2",
                             "--num-servers", str(servers), "--timeout", "120", "--",
                             sys.executable, "-m", "worker", "--config", "configs/digits-mlp.yaml",
                             *worker_args],
                            env={**os.environ, **FAST}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _read_until(proc, pattern, lines, limit=120):
    deadline = time.monotonic() + limit
    for line in proc.stdout:
        lines.append(line)
        if re.search(pattern, line):
            return line
        assert time.monotonic() < deadline, "".join(lines[-30:])
    raise AssertionError(f"{pattern!r} never came:\n" + "".join(lines[-30:]))


def _alive_with(marker):
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker in open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="ignore"):
                found.append(int(pid))
        except OSError:
            pass
    return found


def test_a_config_error_ends_the_local_job_at_once_naming_the_worker():
    """Status 2 (a usage or config error) stops the other roles without waiting the grace."""
    job = _local_job("--set", "batch_size=-32")
    lines = []
    try:
        _read_until(job, r"\[bpslaunch\] worker \d exited with status 2 \(a usage or configuration error\)",
                    lines)
        noticed = time.monotonic()
        rest, _ = job.communicate(timeout=30)
        elapsed = time.monotonic() - noticed
    finally:
        job.kill()
    out = "".join(lines) + rest
    assert job.returncode == 2, out[-3000:]
    assert elapsed < 2, (elapsed, out[-3000:])  # the grace would be 2 + 5 s here
    assert re.search(r"\[worker \d\] worker: config key batch_size=-32: must be an integer >= 1", out)
    assert "[bpslaunch] killing" not in out and "Traceback" not in out, out[-3000:]


@pytest.mark.parametrize("sig, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_interrupting_bpslaunch_stops_every_role_within_2_s_with_one_line_each(sig, status):
    marker = str(random.randint(10**8, 10**9))
    job = _local_job("--steps", "100000", "--set", f"seed={marker}", servers=2)
    lines = []
    try:
        _read_until(job, r"\[worker 0\] train:", lines)  # the progress bar is up: mid-training
        time.sleep(0.5)
        job.send_signal(sig)
        sent = time.monotonic()
        rest, _ = job.communicate(timeout=30)
        elapsed = time.monotonic() - sent
    finally:
        job.kill()
    out = "".join(lines) + rest
    assert job.returncode == status, out[-3000:]
    assert elapsed < 2, (elapsed, out[-3000:])
    assert "Traceback" not in out, out[-3000:]
    name = signal.Signals(sig).name
    after = rest.splitlines()
    assert [line for line in after if line.startswith("[bpslaunch]")] == \
        [f"[bpslaunch] interrupted by {name}; stopping every role"], rest
    for role in ("scheduler", "server 0", "server 1", "worker 0", "worker 1"):
        kind = role.split()[0]
        # one line each, on a line of its own: rank 0's is never glued onto its progress bar
        assert [line for line in after if "stopped by" in line and line.startswith(f"[{role}]")] \
            == [f"[{role}] {kind}: stopped by SIGTERM"], (role, rest)
    deadline = time.monotonic() + 5
    while _alive_with(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _alive_with(marker) == []


#: a --local worker that says it runs, then waits to be stopped (argv[1]: a marker to find it by)
SLEEPER = "import time; print('running', flush=True); time.sleep(120)"


def _sleepers(folder, workers=2):
    """bpslaunch --local with sleeping workers, its temporary directory ``folder``; and the
    marker in its workers' command lines."""
    marker = str(random.randint(10**8, 10**9))
    job = subprocess.Popen([*LAUNCH, "--local", "--num-workers", str(workers), "--timeout", "100",
                            "--", sys.executable, "-c", SLEEPER, marker],
                           env={**os.environ, **FAST, "TMPDIR": str(folder)},
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return job, marker


def _made(folder):
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("bpslaunch-"))


def _gone(marker):
    deadline = time.monotonic() + 10
    while _alive_with(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    return _alive_with(marker) == []


@pytest.mark.parametrize("sig, moment", [(signal.SIGTERM, "starting"), (signal.SIGINT, "starting"),
                                         (signal.SIGTERM, "running")])
def test_an_interrupted_bpslaunch_removes_its_folder(tmp_path, sig, moment):
    """SIGTERM or SIGINT while the roles start (as soon as the folder exists) or while they run:
    the roles stop, the folder goes, the status is 128+N."""
    job, marker = _sleepers(tmp_path, workers=6)  # more roles to start: a longer start-up
    lines = []
    try:
        if moment == "starting":
            deadline = time.monotonic() + 60
            while not _made(tmp_path) and time.monotonic() < deadline and job.poll() is None:
                time.sleep(0.001)
            assert _made(tmp_path), "bpslaunch made no folder"
        else:
            _read_until(job, r"\[worker 5\] running", lines)
        job.send_signal(sig)
        rest, _ = job.communicate(timeout=30)
    finally:
        job.kill()
    out = "".join(lines) + rest
    assert job.returncode == 128 + sig, out[-3000:]
    assert f"[bpslaunch] interrupted by {signal.Signals(sig).name}; stopping every role" in out
    assert _made(tmp_path) == [], out[-3000:]
    assert _gone(marker)


def test_a_folder_left_by_a_sigkill_is_removed_by_the_next_bpslaunch(tmp_path):
    """SIGKILL runs no cleanup: the folder stays (its roles go, deathsig.py) until the next
    bpslaunch in this pid namespace sees its bpslaunch is gone. Folders of a running bpslaunch,
    of another namespace (another container's) or of another naming are kept."""
    namespace = os.readlink("/proc/self/ns/pid").removeprefix("pid:[").removesuffix("]")
    running = tmp_path / f"bpslaunch-{namespace}-{os.getpid()}-running"
    foreign = tmp_path / f"bpslaunch-{int(namespace) + 1}-999999999-foreign"
    other = tmp_path / "bpslaunch-other"
    for folder in (running, foreign, other):
        folder.mkdir()
    job, marker = _sleepers(tmp_path)
    try:
        _read_until(job, r"\[worker 1\] running", [])
        killed = sorted(set(_made(tmp_path)) - {running.name, foreign.name, other.name})
        assert len(killed) == 1 and killed[0].startswith(f"bpslaunch-{namespace}-{job.pid}-")
        job.kill()
        job.wait(timeout=30)
    finally:
        job.kill()
    assert (tmp_path / killed[0]).is_dir()
    assert _gone(marker)
    result = bpslaunch("--local", "--num-workers", "1", "--", sys.executable, "-c", "pass",
                       env={"TMPDIR": str(tmp_path)}, timeout=60)
    assert result.returncode == 0, result.stdout[-2000:]
    assert _made(tmp_path) == sorted([running.name, foreign.name, other.name])


def test_local_workers_share_the_cores_unless_told_otherwise(tmp_path):
    """Each local worker gets cores // workers threads; a user's OMP_NUM_THREADS is kept (a blank
    one is unset); each takes its id as its device index (all share one host's GPUs). The three
    jobs run side by side; their workers end with status 5 once both have printed (the servers
    would otherwise wait for them to join)."""
    program = ("import os, sys, time, pathlib; print('threads', os.environ['OMP_NUM_THREADS'], "
               "'index', os.environ['DMLC_WORKER_ID'], os.environ['PS_DEVICE_INDEX'], flush=True); "
               f"d = pathlib.Path({str(tmp_path)!r}) / os.environ['CASE']; d.mkdir(exist_ok=True); "
               "(d / os.environ['DMLC_WORKER_ID']).touch(); end = time.time() + 20\n"
               "while len(list(d.iterdir())) < 2 and time.time() < end: time.sleep(0.05)\n"
               "sys.exit(5)")
    clean = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    expected = str(max(1, len(os.sched_getaffinity(0)) // 2))
    cases = [(clean, expected, "a"), ({**clean, "OMP_NUM_THREADS": "3"}, "3", "b"),
             ({**clean, "OMP_NUM_THREADS": " "}, expected, "c")]
    procs = [subprocess.Popen([sys.executable, "-m", "adtopk_ps.launcher", "--local", "--num-workers",
                               "2", "--num-servers", "1", "--", sys.executable, "-c", program],
                              env={**env, **FAST, "CASE": case}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for env, _, case in cases]
    try:
        outputs = [p.communicate(timeout=90)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for (_, threads, _), p, out in zip(cases, procs, outputs):
        assert p.returncode == 5, out
        assert re.findall(r"\[worker \d\] threads (\d+)", out) == [threads] * 2, out
        assert sorted(re.findall(r"index (\d) (\d)", out)) == [("0", "0"), ("1", "1")]


@pytest.mark.parametrize("value", ["abc", "0", "-1"])
def test_a_bad_omp_num_threads_is_refused_before_any_role_starts(value):
    run = _run(["--local", "--", "true"], OMP_NUM_THREADS=value)
    assert run.returncode == 2
    assert "environment variable OMP_NUM_THREADS" in run.stderr and "scheduler" not in run.stdout


@pytest.mark.parametrize("program", ["print('no cluster here')", "import sys; sys.exit(0)"])
def test_workers_that_exit_0_without_joining_end_the_local_job_at_once(program):
    """A script whose --help, argument error or early return comes before init()."""
    began = time.monotonic()
    result = bpslaunch("--local", "--num-workers", "2", "--", sys.executable, "-c", program,
                       timeout=60)
    assert result.returncode == 0, result.stdout[-2000:]
    assert "every worker exited 0 without joining the cluster" in result.stdout
    assert time.monotonic() - began < 20


def test_a_worker_that_exits_0_before_the_others_join_ends_the_job_as_a_failure():
    """Worker 1 leaves before init(); worker 0 would wait in init() for it forever."""
    program = ("import os, adtopk_ps.torch as bps\n"
               "if os.environ['DMLC_WORKER_ID'] == '0': bps.init()\n")
    began = time.monotonic()
    result = bpslaunch("--local", "--num-workers", "2", "--", sys.executable, "-c", program,
                       env={"PS_HEARTBEAT_TIMEOUT_MS": "1000"}, timeout=90)
    assert result.returncode == 1, result.stdout[-2000:]
    assert "worker 1 exited 0 without joining the cluster" in result.stdout
    assert time.monotonic() - began < 40


@pytest.mark.parametrize("variable, theirs", [("DMLC_NUM_WORKER", "3"), ("DMLC_NUM_SERVER", "2"),
                                              ("BYTEPS_PARTITION_BYTES", "1024"),
                                              ("PS_MIN_WORKERS", "1")])
def test_roles_given_another_cluster_shape_end_the_job_naming_the_variable(variable, theirs):
    """A server started with another DMLC_NUM_WORKER (or DMLC_NUM_SERVER, key size, elastic
    bound) than the scheduler: both end within seconds, naming the variable, each side's
    value and the host."""
    env = _by_hand(workers=2, servers=1)
    began = time.monotonic()
    scheduler = subprocess.Popen(LAUNCH, env={**env, "DMLC_ROLE": "scheduler"},
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    server = subprocess.Popen(LAUNCH, env={**env, "DMLC_ROLE": "server", variable: theirs},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        outs = [p.communicate(timeout=30)[0] for p in (scheduler, server)]
    finally:
        for p in (scheduler, server):
            p.kill()
            p.wait()
    assert scheduler.returncode == 2 and server.returncode != 0, outs
    assert time.monotonic() - began < 20
    words = f"the server at 127.0.0.1 has {variable}"
    for out in outs:
        assert words in out and "the scheduler" in out, out[-2000:]


def test_a_scheduler_whose_port_is_taken_says_so_and_exits_2():
    port = free_port()
    holder = socket.socket()
    holder.bind(("", port))
    holder.listen()
    try:
        env = {k: v for k, v in os.environ.items() if k not in CONTRACT}
        env.update({**FAST, "DMLC_ROLE": "scheduler", "DMLC_NUM_WORKER": "1",
                    "DMLC_NUM_SERVER": "1", "DMLC_PS_ROOT_URI": "127.0.0.1",
                    "DMLC_PS_ROOT_PORT": str(port)})
        out = subprocess.run([sys.executable, "-m", "adtopk_ps.launcher"], env=env,
                             capture_output=True, text=True, timeout=30)
    finally:
        holder.close()
    assert out.returncode == 2, out.stdout + out.stderr
    text = out.stdout + out.stderr
    assert f"cannot listen on DMLC_PS_ROOT_PORT={port}" in text and "Traceback" not in text


def _roles_by_hand(worker_argv: list[str]) -> tuple[list[int], list[str]]:
    """A scheduler, a server and two workers started by hand (role mode), each worker running
    ``worker_argv``: their exit statuses and outputs, in that order."""
    env = _by_hand(workers=2, servers=1)
    procs = [subprocess.Popen(LAUNCH, env={**env, "DMLC_ROLE": role},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for role in ("scheduler", "server")]
    procs += [subprocess.Popen([*LAUNCH, *worker_argv],
                               env={**env, "DMLC_ROLE": "worker", "DMLC_WORKER_ID": str(w)},
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
              for w in range(2)]
    try:
        outs = [p.communicate(timeout=60)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    return [p.returncode for p in procs], outs


def test_in_role_mode_a_worker_that_fails_fails_the_scheduler_and_the_servers_too():
    """On Kubernetes each role is its own Job: one whose worker raised must not show the
    scheduler and server Jobs as Complete. Every role exits non-zero, naming the error."""
    program = ("import os, torch, adtopk_ps.torch as bps\n"
               "bps.init()\n"
               "bps.allreduce(torch.ones(2), name='step')\n"
               "if bps.rank() == 1: raise RuntimeError('the data loader broke')\n")
    codes, outs = _roles_by_hand([sys.executable, "-c", program])
    assert codes == [1, 1, 0, 1], outs
    for out in outs[:2]:
        assert "RuntimeError: the data loader broke" in out, out[-2000:]


def test_in_role_mode_a_training_job_that_ends_on_its_own_error_fails_every_role(tmp_path):
    """The training job catches its errors (a refused checkpoint here), prints one line and
    exits 1, with no uncaught exception: its finish still fails the job on every role."""
    (tmp_path / "worker0-step00000004.pt").write_bytes(b"not a checkpoint")
    codes, outs = _roles_by_hand([sys.executable, "-m", "worker", "--config", DIGITS_CNN, "--steps", "8",
                                  "--checkpoint-dir", str(tmp_path), "--set", "progress=false"])
    assert codes == [1, 1, 1, 1], outs
    for out in outs:
        assert "CheckpointError: checkpoints refused on every worker" in out, out[-2000:]


def test_a_node_of_another_job_is_refused_by_a_scheduler_left_on_the_port():
    """PS_JOB_ID (bpslaunch --local sets one per run; set it yourself per job in role mode):
    a server of job b that finds job a's scheduler on the port is refused, naming both,
    instead of quietly joining the other job."""
    env = _by_hand(workers=1, servers=1)
    scheduler = subprocess.Popen(LAUNCH, env={**env, "DMLC_ROLE": "scheduler", "PS_JOB_ID": "job-a"},
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        server = subprocess.run(LAUNCH, env={**env, "DMLC_ROLE": "server", "PS_JOB_ID": "job-b"},
                                capture_output=True, text=True, timeout=60)
    finally:
        scheduler.kill()
        scheduler.wait()
    assert server.returncode != 0
    assert "this scheduler runs job 'job-a' (PS_JOB_ID); the server at 127.0.0.1 belongs to " \
           "job 'job-b'" in server.stdout + server.stderr
