"""``bpslaunch``: start a role from the DMLC environment, or a whole cluster on this host.

    DMLC_ROLE=worker ... bpslaunch python train.py     # one process per local device
    DMLC_ROLE=server ... bpslaunch                     # runs the server role
    bpslaunch --local --num-workers 2 --num-servers 2 -- python -m worker --config ...
    bpslaunch keygen DIR                               # a CURVE key pair for PS_CURVE_KEYS
    DMLC_ROLE=worker ... bpslaunch --colocate-servers python train.py  # and a server beside it

With ``--local`` it starts a scheduler, the servers and the workers on free
ports and prefixes each line of their output with the role. Server ``i`` gets
``PS_SERVER_ID=i``, which it asks the scheduler for as its rank, so the prefix
names the same server as its own messages do.

``--colocate-servers`` (or ``BYTEPS_COLOCATE_SERVERS=1``) deploys as BytePS does
without spare machines: a server beside every worker host, so S = W. With
``--local`` it starts one server per worker; on a worker host it also starts the
host's server, whose ``PS_SERVER_ID`` is the host's ``DMLC_WORKER_ID``, and
supervises it with the workers: the host exits with the first failure among them.
In an elastic job the host's other roles run on without one that failed, as the
job does; a restarted or joining host cannot bring its server back (servers join
only as the job starts), so start it without the switch.

Every mode exits with the status of the first process that failed (a death by
signal N as 128+N, as a shell reports it), 0 when every one succeeded. A usage
or configuration error (status 2) stops the others at once; SIGINT or SIGTERM
stops every role (SIGTERM, then SIGKILL) and exits 130 or 143.

``--local`` keeps the scheduler's records of the job in a temporary folder, removed on
every exit, an interrupt's included; a folder that a SIGKILL left (no cleanup runs) is
removed by the next ``--local`` run (:func:`job_folder`).
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Callable, Mapping, Sequence

from adtopk_ps.allocator import keep_freed_memory
from adtopk_ps.cluster import security
from adtopk_ps.cluster.membership import ClusterConfig
from adtopk_ps.cluster.stop import EXIT_GRACE_S
from adtopk_ps.core.env import EnvError, env_int
from adtopk_ps.deathsig import guarded

#: the server role's entry point, run as ``python -m server`` (``server/__main__.py``): the
#: server package sits above this one, so the launcher names it instead of importing it
SERVER_MODULE = "server"
#: the scheduler role's (``adtopk_ps/cluster/scheduler.py``'s ``main``)
SCHEDULER_MODULE = "adtopk_ps.cluster.scheduler"


def _python_module(module: str) -> list[str]:
    return [sys.executable, "-u", "-m", module]


class Child:
    """A role process whose output is copied line by line with a prefix."""

    def __init__(self, label: str, argv: Sequence[str], env: Mapping[str, str], lock: threading.Lock):
        self.label = label
        self.code: int | None = None  # the exit status, as a shell reports it
        self.ended_at = 0.0  # when ``poll`` first saw it ended
        self.proc = subprocess.Popen(guarded(argv), env=dict(env), stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self._pump = threading.Thread(target=self._copy, args=(lock,), daemon=True)
        self._pump.start()

    def poll(self) -> int | None:
        """The exit status once it has ended (a death by signal N is 128+N, as a shell says)."""
        if self.code is None and (code := self.proc.poll()) is not None:
            self.ended_at = time.monotonic()
            self.code = 128 - code if code < 0 else code
        return self.code

    def _copy(self, lock: threading.Lock) -> None:
        """Line by line, where a carriage return (a progress bar's update) also ends a line."""
        pending = b""
        fd = self.proc.stdout.fileno()
        while True:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            pending += chunk
            *lines, pending = re.split(rb"[\r\n]", pending)
            self._write(lock, lines)
        self._write(lock, [pending])

    def _write(self, lock: threading.Lock, lines: list[bytes]) -> None:
        text = "".join(f"[{self.label}] {line.decode(errors='replace')}\n" for line in lines if line)
        if text:
            with lock:
                sys.stdout.write(text)
                sys.stdout.flush()

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the child's whole process group, if it still runs."""
        if self.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def join(self) -> None:
        """Wait for the child and for its output to be passed on."""
        self.proc.wait()
        self.poll()
        self._pump.join(2)


def free_port() -> int:
    """A TCP port free on this host now, for ``--local`` clusters."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def run_local(num_workers: int, num_servers: int, command: Sequence[str],
              timeout: float | None = None, environ: Mapping[str, str] | None = None,
              restarts: int = 0) -> int:
    """A whole cluster on this host; returns the first failure's status, or 0. ``restarts``
    (an elastic job): a worker that dies is started again, up to that many times in all, and
    joins the running job."""
    base = keep_freed_memory(os.environ if environ is None else environ)
    base.update({
        "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": str(free_port()),
        "DMLC_NUM_WORKER": str(num_workers), "DMLC_NUM_SERVER": str(num_servers),
        "DMLC_NODE_HOST": "127.0.0.1", "BYTEPS_LOCAL_SIZE": "1", "BYTEPS_LOCAL_RANK": "0",
        "PYTHONUNBUFFERED": "1", "PS_JOB_ID": os.environ.get("PS_JOB_ID") or uuid.uuid4().hex[:12],
    })
    base.setdefault("PS_EXIT_GRACE_S", str(int(EXIT_GRACE_S)))  # a hung worker ends by itself
    base.setdefault("PS_LISTEN_HOST", "127.0.0.1")  # nothing off this host reaches the job
    share_cores(base, num_workers)
    grace = env_int("PS_HEARTBEAT_TIMEOUT_MS", 10000, environ=base) / 1000 + 5
    elastic = any(base.get(v, "").strip() for v in ("PS_MIN_WORKERS", "PS_MAX_WORKERS"))
    lock = threading.Lock()
    # SIGINT and SIGTERM are noted from before the folder exists to after it is gone: one that
    # comes while the roles start stops the job as one that comes later does, and the folder
    # is removed either way
    with _Interrupts() as interrupts:
        folder = job_folder()
        try:
            formed = folder / "formed"
            reformed = folder / "reformed"  # the workers an elastic job went without, or took in
            # made once no worker can join any more (no restarts left, none on its way): a job
            # below its minimum then ends at once instead of waiting PS_ELASTIC_TIMEOUT_S
            closed = folder / "no-joiners"
            if elastic and not restarts:
                closed.touch()

            def changes(event: str) -> list[tuple[str, int]]:
                """(label, process group) of each child lost, or joined (reform.py's record)"""
                lines = reformed.read_text().splitlines() if reformed.exists() else []
                return [(f"{role} {rank}", int(group)) for kind, role, rank, group in
                        (line.split() for line in lines) if kind == event]

            def worker(i: int) -> Child:
                return Child(f"worker {i}", command, {**base, "DMLC_ROLE": "worker",
                                                      "DMLC_WORKER_ID": str(i),
                                                      "PS_DEVICE_INDEX": str(i)}, lock)
            children = [Child("scheduler", _python_module(SCHEDULER_MODULE),
                              {**base, "DMLC_ROLE": "scheduler", "PS_FORMED_FILE": str(formed),
                               "PS_REFORMED_FILE": str(reformed),
                               **({"PS_NO_JOINERS_FILE": str(closed)} if elastic else {})}, lock)]
            children += [Child(f"server {i}", _python_module(SERVER_MODULE),
                               {**base, "DMLC_ROLE": "server", "PS_SERVER_ID": str(i)}, lock)
                         for i in range(num_servers)]
            children += [worker(i) for i in range(num_workers)]
            again = _Restarts(restarts, children[0], children[-num_workers:], worker,
                              lambda: {group for _, group in changes("joined")}, closed) \
                if elastic and restarts else None
            return supervise(children, grace, timeout, workers=children[-num_workers:],
                             formed=formed.exists,
                             left_behind=(lambda: [label for label, _ in changes("lost")])
                             if elastic else None, restart=again, interrupts=interrupts)
        finally:
            shutil.rmtree(folder, ignore_errors=True)


#: what ``bpslaunch --local``'s folder's name starts with in the temporary directory
FOLDER_PREFIX = "bpslaunch-"


def _pid_namespace() -> str | None:
    """This process's pid namespace (Linux's ``pid:[N]``: N), in which the pids in the
    folders' names are looked up; None where there is none to read."""
    try:
        number = os.readlink("/proc/self/ns/pid").removeprefix("pid:[").removesuffix("]")
    except OSError:
        return None
    return number if number.isdigit() else None


def job_folder() -> Path:
    """A new folder for ``bpslaunch --local``'s job (the scheduler's records), after removing
    those a bpslaunch killed with SIGKILL left: a SIGKILL runs no cleanup, so each name carries
    its bpslaunch's pid namespace and pid (``bpslaunch-NS-PID-…``), and a folder of this
    user's, in this namespace, whose bpslaunch is gone is removed. A pid that is running again
    (reused) keeps its folder; one of another namespace (a container sharing the temporary
    directory) is never taken for gone."""
    namespace = _pid_namespace()
    if namespace is None:  # no way to tell a live bpslaunch from a gone one: leave them all
        return Path(tempfile.mkdtemp(prefix=FOLDER_PREFIX))
    for left in Path(tempfile.gettempdir()).glob(f"{FOLDER_PREFIX}{namespace}-*-*"):
        pid = left.name.split("-")[2]
        try:
            theirs = left.is_dir() and left.stat().st_uid == os.getuid()
        except OSError:  # another bpslaunch removed it first
            continue
        if theirs and pid.isdigit() and not _running(int(pid)):
            shutil.rmtree(left, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=f"{FOLDER_PREFIX}{namespace}-{os.getpid()}-"))


def _running(pid: int) -> bool:
    """Whether ``pid`` names a process, any user's, in this pid namespace."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


class _Interrupts:
    """SIGINT and SIGTERM to bpslaunch, noted instead of acted on while in use (``with``), in
    the order they came: :func:`supervise` then stops every role, and the status is 128+N
    for the first (a shell's), after whatever bpslaunch made is removed."""

    def __init__(self) -> None:
        self.signals: list[int] = []
        self._before: dict[int, object] = {}

    def __enter__(self) -> _Interrupts:
        self._before = {s: signal.signal(s, self._note) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def __exit__(self, *_exc: object) -> None:
        for s, handler in self._before.items():
            signal.signal(s, handler)

    def _note(self, signum: int, _frame: object) -> None:
        self.signals.append(signum)


class _Restarts:
    """``bpslaunch --local --restarts N``: a worker that dies is started again (the same
    DMLC_WORKER_ID) while the job runs, up to N times in all, and joins the running job. One
    that never joined because the job finished first is stopped then, and is no failure.

    Restarts are told apart by their process group, not by their order: a worker's restarts
    share its DMLC_WORKER_ID, and one that dies before it registers never joins, so the n-th
    join of a worker need not be its n-th restart's."""

    def __init__(self, limit: int, scheduler: Child, workers: Sequence[Child],
                 start: Callable[[int], Child], joined: Callable[[], set[int]],
                 closed: Path | None = None):
        self.limit, self.scheduler, self.workers = limit, scheduler, list(workers)
        self.start, self.joined = start, joined  # joined: the process groups the job took in
        self.closed = closed  # made once none can join any more (the scheduler reads it)
        self.made: list[Child] = []
        self.stopped: list[Child] = []  # stragglers stopped after the job finished

    def __call__(self, dead: Child) -> Child | None:
        """A new process for ``dead``, or None: a server (servers do not join), no restarts
        left, or the job is ending."""
        if dead.label.split()[0] != "worker" or len(self.made) >= self.limit or \
                self.scheduler.poll() is not None or \
                any(w.poll() == 0 for w in self.workers):
            return None
        wid = int(dead.label.split()[-1])
        print(f"[bpslaunch] restarting {dead.label} (restart {len(self.made) + 1} of "
              f"{self.limit}): it joins the running job", file=sys.stderr, flush=True)
        child = self.start(wid)
        self.made.append(child)
        self.workers.append(child)
        return child

    def never_joined(self, child: Child) -> bool:
        """A restarted worker that the job never took in: the scheduler records each join with
        the process group of the worker it took in, and each child leads a group of its own
        (``start_new_session``)."""
        return child in self.made and child.proc.pid not in self.joined()

    def note_none_can_join(self) -> None:
        """Once every restart is used and none is still alive (on its way to join, or in
        the job), say so to the scheduler: no worker can join any more."""
        if self.closed is not None and len(self.made) >= self.limit and \
                all(c.poll() is not None for c in self.made) and not self.closed.exists():
            self.closed.touch()

    def stop_stragglers(self) -> None:
        """After the job finished (the scheduler exited 0): stop the restarts still waiting
        to join it."""
        if self.scheduler.poll() != 0:
            return
        for child in self.made:
            if child.poll() is None and child not in self.stopped and self.never_joined(child):
                self.stopped.append(child)
                print(f"[bpslaunch] {child.label} (restarted) never joined: the job finished "
                      f"first; stopping it", file=sys.stderr, flush=True)
                child.kill()


USAGE_ERROR = 2  # what our roles and the training job exit with on a usage or config error
STOP_GRACE = 1.0  # seconds between SIGTERM and SIGKILL when bpslaunch stops its children


def supervise(children: list[Child], grace: float, timeout: float | None,
              workers: Sequence[Child] = (), formed: Callable[[], bool] | None = None,
              left_behind: Callable[[], list[str]] | None = None,
              restart: _Restarts | None = None, independent: bool = False,
              interrupts: _Interrupts | None = None) -> int:
    """Wait for every child and return the status of the first to fail, or 0. Every exit is
    recorded, however close together they come, until the last child has ended.

    With ``workers`` and ``formed`` (whether the cluster has formed: ``--local``), the job
    also ends when its workers end before the cluster formed: at once, with 0, when every
    one exited 0 (none joined, so the scheduler and servers have nothing to wait for);
    with a failure when some exited 0 and the others still wait ``grace`` later (they wait
    in ``init()`` for workers that will never come).

    After the first failure the rest get ``grace`` seconds to end on their own (to report
    what they saw), unless it was a usage error (status 2): then they are stopped at once,
    as they are on SIGINT or SIGTERM to bpslaunch (status 130 or 143). Stopping is SIGTERM,
    then SIGKILL after ``STOP_GRACE`` seconds.

    ``left_behind`` (an elastic job): the labels of the workers and servers the scheduler
    re-formed the job without, once for each time. A worker or server that fails after the
    cluster formed is judged when the job ends: no failure where the job went on without it,
    a failure otherwise (one that exits non-zero on its own, say). ``restart``: new processes for such workers, which join
    the running job (:class:`_Restarts`).

    ``independent`` (a colocated worker host of an elastic job): a failure stops nothing but
    a usage error; the job goes on without the process that failed, so the host's others
    run to their own end, and the first failure is still the status.

    ``interrupts``: the caller's, in use since before it started the children (SIGINT or
    SIGTERM while they start); by default, noted from this call on.
    """
    with _Interrupts() if interrupts is None else contextlib.nullcontext(interrupts) as seen:
        return _supervise(children, grace, timeout, workers, formed, left_behind, restart,
                          independent, seen.signals)


def _supervise(children: list[Child], grace: float, timeout: float | None,
               workers: Sequence[Child], formed: Callable[[], bool] | None,
               left_behind: Callable[[], list[str]] | None, restart: _Restarts | None,
               independent: bool, interrupted: list[int]) -> int:
    spare = [c for c in children if c.label.split()[0] in ("worker", "server")]
    job = _Supervision(children, grace, timeout, spare if left_behind else (), formed, restart,
                       independent)
    try:
        while job.running():
            now = time.monotonic()
            job.record_exits(now)
            if restart is not None:
                restart.stop_stragglers()
                restart.note_none_can_join()
            if formed is not None:
                job.check_unformed(now, workers, formed)
            if interrupted and job.term_at is None:
                name = signal.Signals(interrupted[0]).name
                print(f"[bpslaunch] interrupted by {name}; stopping every role",
                      file=sys.stderr, flush=True)
                job.term_at = now
            job.check_deadline(now)
            job.stop_due(now)
            time.sleep(0.02)
    finally:
        for child in children:
            child.kill()
            child.join()
    if interrupted:
        return 128 + interrupted[0]
    if left_behind is not None:
        gone = collections.Counter(left_behind())
        for child in job.deferred:
            if restart is not None and restart.never_joined(child):
                # never in the job, so none of its losses: no failure once the job succeeded
                if restart.scheduler.code != 0:
                    job.failures.append((child.ended_at, child.code))
            elif gone[child.label] > 0:
                gone[child.label] -= 1
            else:
                job.failures.append((child.ended_at, child.code))
    return min(job.failures)[1] if job.failures else 0


class _Supervision:
    """What :func:`supervise` knows as the children end: which have ended, the failures (time
    of exit, status), and when the rest are stopped: SIGKILL once the grace after a failure is
    over (``stop_at``), or SIGTERM (``term_at``) then SIGKILL (``kill_at``)."""

    def __init__(self, children: list[Child], grace: float, timeout: float | None,
                 spare: Sequence[Child] = (), formed: Callable[[], bool] | None = None,
                 restart: _Restarts | None = None, independent: bool = False):
        self.children, self.grace, self.timeout, self.restart = children, grace, timeout, restart
        self.independent = independent  # a failure stops no other child: see supervise
        self.spare, self.formed = [id(c) for c in spare], formed  # roles the job can lose
        self.deferred: list[Child] = []  # spare roles that failed: judged at the end
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.seen: set[int] = set()
        self.failures: list[tuple[float, int]] = []
        self.stop_at: float | None = None
        self.term_at: float | None = None
        self.kill_at: float | None = None
        self.unformed_since: float | None = None  # when a worker first ended before forming

    def running(self) -> bool:
        """Whether some child has not been seen to end."""
        return len(self.seen) < len(self.children)

    def record_exits(self, now: float) -> None:
        """Note every child that ended since the last look; the first failure sets the stop."""
        for child in [c for c in self.children if id(c) not in self.seen and c.poll() is not None]:
            self.seen.add(id(child))
            if child.code == 0 or self.term_at is not None:
                continue  # after bpslaunch stops the job, a status is its doing
            if id(child) in self.spare and self.formed is not None and self.formed():
                print(f"[bpslaunch] {child.label} exited with status {child.code}; an elastic "
                      f"job (PS_MIN_WORKERS): the scheduler decides whether it goes on",
                      file=sys.stderr, flush=True)
                self.deferred.append(child)
                again = self.restart(child) if self.restart is not None else None
                if again is not None:
                    self.children.append(again)
                    self.spare.append(id(again))
                continue
            self.failures.append((child.ended_at, child.code))
            if len(self.failures) == 1:
                self._first_failure(child, now)

    def _first_failure(self, child: Child, now: float) -> None:
        if child.code == USAGE_ERROR:
            print(f"[bpslaunch] {child.label} exited with status 2 (a usage or "
                  f"configuration error); stopping the others", file=sys.stderr, flush=True)
            self.term_at = now
        elif self.running() and self.independent:
            print(f"[bpslaunch] {child.label} exited with status {child.code}; an elastic job "
                  f"goes on without it, and so do this host's other roles", file=sys.stderr, flush=True)
        elif self.running():
            print(f"[bpslaunch] {child.label} exited with status {child.code}; waiting up "
                  f"to {self.grace:g} s for the others", file=sys.stderr, flush=True)
            self.stop_at = now + self.grace
        else:
            print(f"[bpslaunch] {child.label} exited with status {child.code}",
                  file=sys.stderr, flush=True)

    def check_unformed(self, now: float, workers: Sequence[Child],
                       formed: Callable[[], bool]) -> None:
        """Workers that ended before the cluster formed: see :func:`supervise`."""
        ended = [w for w in workers if w.poll() is not None]
        if not ended or self.failures or self.term_at is not None or formed():
            return
        if len(ended) == len(workers):
            print("[bpslaunch] every worker exited 0 without joining the cluster (none called "
                  "init()); stopping the scheduler and the servers", file=sys.stderr, flush=True)
            self.term_at = now
            return
        self.unformed_since = self.unformed_since or now
        if now - self.unformed_since > self.grace:
            gone = ", ".join(w.label for w in ended)
            print(f"[bpslaunch] {gone} exited 0 without joining the cluster, and the other "
                  f"workers have waited {self.grace:g} s for it in init(); the cluster cannot "
                  f"form: stopping the job", file=sys.stderr, flush=True)
            self.failures.append((now, 1))
            self.term_at = now

    def check_deadline(self, now: float) -> None:
        """Past --timeout with nothing failed: a failure of its own (124), and the stop."""
        if self.deadline is not None and now > self.deadline and not self.failures and self.term_at is None:
            self.failures.append((now, 124))
            print(f"[bpslaunch] the job ran past its {self.timeout:.0f} s timeout; stopping it",
                  file=sys.stderr, flush=True)
            self.stop_at = now

    def stop_due(self, now: float) -> None:
        """Send whatever signal is due by ``now``."""
        if self.stop_at is not None and now >= self.stop_at and self.kill_at is None:
            for child in self.children:
                if child.poll() is None:
                    print(f"[bpslaunch] killing {child.label}", file=sys.stderr, flush=True)
                    child.kill()
            self.kill_at = now
        if self.term_at is not None and self.kill_at is None:
            for child in self.children:
                child.kill(signal.SIGTERM)
            self.kill_at = now + STOP_GRACE
        if self.kill_at is not None and now >= self.kill_at:
            for child in self.children:
                child.kill()


def share_cores(env: dict, workers: int) -> None:
    """Give each of ``workers`` processes on this host its share of the cores, unless the user
    set OMP_NUM_THREADS: each would otherwise take them all, and they would slow each other."""
    if env.get("OMP_NUM_THREADS", "").strip():
        env_int("OMP_NUM_THREADS", minimum=1, environ=env)  # torch would ignore a bad one
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    env["OMP_NUM_THREADS"] = str(max(1, cores // workers))


def local_size(environ: Mapping[str, str]) -> int:
    """Worker processes for this host: BYTEPS_LOCAL_SIZE, else one per visible GPU, else 1."""
    if environ.get("BYTEPS_LOCAL_SIZE", "").strip():
        return env_int("BYTEPS_LOCAL_SIZE", minimum=1, environ=environ)
    visible = environ.get("CUDA_VISIBLE_DEVICES", environ.get("NVIDIA_VISIBLE_DEVICES", "")).strip()
    if visible and visible not in ("all", "none", "void"):
        return len([d for d in visible.split(",") if d.strip()])
    import torch  # only a worker host asks, and only when nothing above says
    return max(1, torch.cuda.device_count())


COLOCATE_VARIABLE = "BYTEPS_COLOCATE_SERVERS"


def colocating(flag: bool, environ: Mapping[str, str]) -> bool:
    """Whether servers run beside the workers: ``--colocate-servers``, or
    ``BYTEPS_COLOCATE_SERVERS=1`` (for pods, whose command line is shared); 0 or unset is off."""
    raw = environ.get(COLOCATE_VARIABLE, "").strip()
    if raw not in ("", "0", "1"):
        raise EnvError(f"environment variable {COLOCATE_VARIABLE}={raw!r} must be 0 or 1")
    return flag or raw == "1"


def colocated_server(env: Mapping[str, str]) -> dict[str, str]:
    """The environment of the server a worker host starts beside its workers: its
    ``PS_SERVER_ID`` is the host's ``DMLC_WORKER_ID``, so every host runs a different one and
    there is one per host (``DMLC_NUM_SERVER`` = ``DMLC_NUM_WORKER``).

    Example::

        env = colocated_server({**os.environ, "DMLC_WORKER_ID": "1"})  # PS_SERVER_ID=1
    """
    why = f"--colocate-servers ({COLOCATE_VARIABLE}=1) starts one server beside each worker host"
    if not env.get("DMLC_WORKER_ID", "").strip():
        raise EnvError(f"{why}, named by the host's DMLC_WORKER_ID, which is not set")
    host = env_int("DMLC_WORKER_ID", minimum=0, environ=env)
    hosts, servers = (env_int(v, minimum=1, environ=env) for v in ("DMLC_NUM_WORKER", "DMLC_NUM_SERVER"))
    if servers != hosts:
        raise EnvError(f"{why}, so DMLC_NUM_SERVER={servers} must equal DMLC_NUM_WORKER={hosts} "
                       f"(servers on hosts of their own: leave the switch off)")
    given = env.get("PS_SERVER_ID", "").strip()
    if given and given != str(host):
        raise EnvError(f"{why}: its PS_SERVER_ID is DMLC_WORKER_ID={host}, but PS_SERVER_ID={given} is set")
    server = {k: v for k, v in env.items() if k not in ("BYTEPS_LOCAL_RANK", "PS_DEVICE_INDEX")}
    return {**server, "DMLC_ROLE": "server", "PS_SERVER_ID": str(host)}


def run_role(command: Sequence[str], environ: Mapping[str, str] | None = None,
             colocate: bool = False) -> int:
    """Run this host's role from ``DMLC_ROLE``: the scheduler or a server in process, or the
    command once per local worker (and, with ``colocate``, the host's server beside them)."""
    env = keep_freed_memory(os.environ if environ is None else environ)
    config = ClusterConfig.from_env(env)  # validates the whole contract up front
    if colocate and config.role == "server":
        raise EnvError(f"DMLC_ROLE=server with --colocate-servers ({COLOCATE_VARIABLE}=1): with "
                       f"it every server runs beside a worker, so a server host would be one too "
                       f"many; start servers on hosts of their own without the switch")
    if config.role == "scheduler":
        from adtopk_ps.cluster.scheduler import main as scheduler_main
        return scheduler_main()
    if config.role == "server":
        server = Child("server", _python_module(SERVER_MODULE), env, threading.Lock())
        return supervise([server], config.heartbeat_timeout + 5, None)
    if not command:
        raise EnvError("DMLC_ROLE=worker needs the training command after bpslaunch")
    size = local_size(env)
    env["BYTEPS_LOCAL_SIZE"] = str(size)
    env.setdefault("PS_EXIT_GRACE_S", str(int(EXIT_GRACE_S)))  # a hung worker ends by itself
    if size > 1:
        share_cores(env, size)
    ClusterConfig.from_env(env)  # the local size must agree with the rest of the contract
    server = colocated_server(env) if colocate else None
    lock = threading.Lock()
    children = [Child(f"server {server['PS_SERVER_ID']}", _python_module(SERVER_MODULE), server, lock)] \
        if server else []
    children += [Child(f"worker {config.worker_id or 0}.{rank}" if size > 1 else "worker",
                       command, {**env, "BYTEPS_LOCAL_RANK": str(rank)}, lock)
                 for rank in range(size)]
    return supervise(children, config.heartbeat_timeout + 5, None,
                     independent=server is not None and config.elastic)


def keygen(argv: Sequence[str]) -> int:
    """``bpslaunch keygen DIR``: write the cluster's CURVE key pair."""
    ap = argparse.ArgumentParser(prog="bpslaunch keygen",
                                 description="Write a cluster key pair; point PS_CURVE_KEYS at DIR "
                                             "on every role to authenticate and encrypt all traffic.")
    ap.add_argument("directory")
    secret = security.keygen(ap.parse_args(argv).directory)
    print(f"wrote {secret} and {secret.with_suffix('.key')}; set PS_CURVE_KEYS={secret.parent}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``bpslaunch``'s entry point; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["keygen"]:
        return keygen(argv[1:])
    ap = argparse.ArgumentParser(prog="bpslaunch", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--local", action="store_true", help="run a whole cluster on this host")
    ap.add_argument("--num-workers", type=int, default=2, help="with --local (default 2)")
    ap.add_argument("--num-servers", type=int, default=None,
                    help="with --local (default 1, or --num-workers with --colocate-servers)")
    ap.add_argument("--colocate-servers", action="store_true",
                    help=f"a server beside every worker, S = W (also {COLOCATE_VARIABLE}=1): with "
                         f"--local one server per worker; on a worker host (DMLC_ROLE=worker) the "
                         f"host's server too, PS_SERVER_ID=DMLC_WORKER_ID, which needs "
                         f"DMLC_NUM_SERVER=DMLC_NUM_WORKER")
    ap.add_argument("--timeout", type=float, default=None,
                    help="with --local: stop the job after this many seconds (status 124)")
    ap.add_argument("--min-workers", type=int, default=None,
                    help="with --local: an elastic job (PS_MIN_WORKERS) that goes on without a "
                         "lost worker while this many remain; a worker's death is then no "
                         "failure of the job")
    ap.add_argument("--restarts", type=int, default=0,
                    help="with --local: start a worker that dies again, up to this many times "
                         "in all; it joins the running job (elastic: --min-workers defaults to "
                         "--num-workers)")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="the worker command")
    args = ap.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    try:
        colocate = colocating(args.colocate_servers, os.environ)
        if args.local:
            if colocate and args.num_servers not in (None, args.num_workers):
                raise EnvError(f"--colocate-servers starts one server per worker: --num-servers "
                               f"{args.num_servers} contradicts --num-workers {args.num_workers} "
                               f"(leave --num-servers out)")
            args.num_servers = args.num_workers if colocate else \
                (1 if args.num_servers is None else args.num_servers)
            if args.num_workers < 1 or args.num_servers < 1:
                raise EnvError("--num-workers and --num-servers must be at least 1")
            if not command:
                raise EnvError("--local needs the worker command after --")
            if args.min_workers is not None and not 1 <= args.min_workers <= args.num_workers:
                raise EnvError(f"--min-workers must be between 1 and --num-workers "
                               f"({args.num_workers}), got {args.min_workers}")
            if args.restarts < 0:
                raise EnvError(f"--restarts must not be negative, got {args.restarts}")
            minimum = args.num_workers if args.min_workers is None and args.restarts else \
                args.min_workers
            environ = None if minimum is None else {**os.environ, "PS_MIN_WORKERS": str(minimum)}
            return run_local(args.num_workers, args.num_servers, command, args.timeout, environ,
                             args.restarts)
        return run_role(command, colocate=colocate)
    except EnvError as exc:
        print(f"bpslaunch: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
