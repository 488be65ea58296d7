"""Elastic jobs: a worker killed with SIGKILL at a bad moment leaves the others training.

Each job runs tests/programs/elastic_train.py (a horovod elastic script, the import changed)
under ``bpslaunch --local --min-workers``. Every time: the job exits 0, every survivor ends
at the same step count with bit-identical parameters, and each kill is followed by the next
step within 3 s (the kill's and the step's wall-clock times, printed by the processes)."""
from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from adtopk_ps.testing.roles import role_pids, run_and_kill
from adtopk_ps.testing.stats import join_to_first_step, kill_to_next_step
from procs import FAST, bpslaunch

PROGRAM = str(Path(__file__).resolve().parent / "programs" / "elastic_train.py")
STEPS = 16
GOAL_S = 3.0
JOIN_GOAL_S = 5.0  # from a joiner's registration to its first step
# a kill is seen by its closed connections (1 s), not by heartbeats: a heartbeat timeout well
# above that keeps a process starved for 2 s on a loaded machine from being taken for lost
ELASTIC = {"PS_HEARTBEAT_TIMEOUT_MS": "6000"}


def elastic_job(workers: int, servers: int, minimum: int, *args: str, steps: int = STEPS,
                launcher: tuple[str, ...] = (), wrapper: tuple[str, ...] = (), timeout: int = 100):
    """``wrapper``: a command that runs the training program (given after it)."""
    return bpslaunch("--local", "--num-workers", str(workers), "--num-servers", str(servers),
                     "--min-workers", str(minimum), "--timeout", str(timeout), *launcher, "--",
                     *wrapper, sys.executable, PROGRAM, "--steps", str(steps), *args,
                     timeout=timeout + 30, env=ELASTIC)


def survivors(out: str) -> list[tuple[int, str, int]]:
    """(step, digest, size) of every worker that finished."""
    return [(int(m[1]), m[3], int(m[2])) for m in
            re.finditer(r"done step=(\d+) size=(\d+) digest=(\w+)", out)]


def check_finished(result, workers: int, goal_s: float = GOAL_S, steps: int = STEPS) -> list[float]:
    assert result.returncode == 0, result.stdout  # whole: the first failure may come early
    done = survivors(result.stdout)
    assert len(done) == workers, result.stdout
    assert {(step, size) for step, _, size in done} == {(steps, workers)}
    assert len({digest for _, digest, _ in done}) == 1, done  # bit-identical replicas
    gaps = kill_to_next_step(result.stdout)
    assert all(gap <= goal_s for gap in gaps), gaps
    return gaps


def kills(seed: int, workers: int, count: int) -> list[str]:
    """``count`` distinct victims at distinct steps, the moment drawn from every kind."""
    rng = random.Random(seed)
    victims = rng.sample(range(workers), count)
    steps = sorted(rng.sample(range(1, STEPS - 2), count))
    return [f"--kill={v}:{s}" for v, s in zip(victims, steps)]


@pytest.mark.parametrize("when, seed", [(when, seed) for when in ("before-push", "mid-push")
                                        for seed in range(3)] + [("mid-commit", 0)])
def test_repeated_kills_at_bad_moments_leave_the_others_training(when, seed):
    # 5 workers, at least 2: three kills a job at random steps and ranks, before a push,
    # between the pushes and their answers (overlap), or in the middle of a commit: 21 kills
    # over the 7 jobs
    gaps = check_finished(elastic_job(5, 2, 2, "--when", when, *kills(seed, 5, 3)), 2)
    assert len(gaps) == 3


def test_a_worker_killed_in_the_start_up_agreement_leaves_the_others_training():
    result = elastic_job(3, 2, 2, "--when", "start-up", "--kill=1:0")
    check_finished(result, 2)
    assert "going on with 2 worker(s) and 2 server(s) (epoch 1" in result.stdout


def test_workers_killed_at_once_and_while_the_others_re_form():
    # two kills at one step (two re-forms within milliseconds: a request made in the first
    # must not be answered in the second), a third a step later, while the others re-form
    check_finished(elastic_job(5, 2, 2, "--when", "mid-push", "--kill=1:5", "--kill=3:5",
                               "--kill=0:6"), 2)


def test_below_the_minimum_the_job_waits_for_a_join_then_ends_naming_why(tmp_path):
    # worker 1's restart is on its way (it sleeps 60 s before it starts), so a worker may
    # still join: the job waits PS_ELASTIC_TIMEOUT_S for it, saying so, then ends
    started = time.monotonic()
    mark = tmp_path / "started"
    slow_restart = ("sh", "-c", f'mkdir "{mark}.$DMLC_WORKER_ID" 2>/dev/null || sleep 60; exec "$@"',
                    "sh")
    result = bpslaunch("--local", "--num-workers", "3", "--num-servers", "1", "--min-workers", "2",
                       "--restarts", "1", "--timeout", "100", "--", *slow_restart, sys.executable,
                       PROGRAM, "--steps", str(STEPS), "--kill=1:3", "--kill=2:8", timeout=130,
                       env={**ELASTIC, "PS_ELASTIC_TIMEOUT_S": "4"})
    assert result.returncode != 0
    # the survivor and the scheduler say what they wait for while they wait, then why it ended
    assert "only 1 worker(s) remain, below PS_MIN_WORKERS=2: waiting up to 4 s " \
           "(PS_ELASTIC_TIMEOUT_S) for 1 more to join" in result.stdout, result.stdout
    assert re.search(r"\[worker 0\] .*waiting up to 4 s", result.stdout), result.stdout
    assert "and no worker joined to make up the rest within 4 s (PS_ELASTIC_TIMEOUT_S)" \
        in result.stdout, result.stdout
    assert not survivors(result.stdout)
    assert time.monotonic() - started < 60


@pytest.mark.parametrize("wrapper", ["optimizer", "ddp"])
def test_a_restarted_worker_joins_the_running_job(wrapper):
    # worker 1 dies at step 5; bpslaunch starts it again and it joins: parameters, optimizer
    # state and step counter from a survivor, then the job ends with all 3, bit-identical
    # (byteps' DDP wrapper broadcasts as it is made, except in a joiner)
    result = elastic_job(3, 2, 2, "--kill=1:5", "--step-s=0.15", "--wrapper", wrapper, steps=50,
                         launcher=("--restarts", "1"))
    check_finished(result, 3, steps=50)
    joins = join_to_first_step(result.stdout)
    assert len(joins) == 1 and joins[0] <= JOIN_GOAL_S, joins
    assert "restarting worker 1 (restart 1 of 1)" in result.stdout


def test_below_the_minimum_a_joiner_lets_the_job_go_on():
    # 2 workers, at least 2: the loss pauses the job (the survivor waits) until the
    # restarted worker joins
    result = elastic_job(2, 2, 2, "--kill=1:5", "--step-s=0.1", steps=30,
                         launcher=("--restarts", "1"))
    # the kill's next step waits for a new process to start and join (the join's own goal)
    check_finished(result, 2, steps=30, goal_s=GOAL_S + JOIN_GOAL_S + 2)
    assert "waiting up to 600 s (PS_ELASTIC_TIMEOUT_S) for 1 more to join" in result.stdout
    joins = join_to_first_step(result.stdout)
    assert len(joins) == 1 and joins[0] <= JOIN_GOAL_S, joins


def test_a_worker_killed_as_it_joins_leaves_the_others_training(tmp_path):
    # the first restart of worker 1 kills itself as it builds its optimizer, whose agreement
    # the others wait in (they re-formed for it); the second restart gets in. 90 steps of at
    # least 0.15 s: each restart starts torch (and its first optimizer) before it registers,
    # seconds on a loaded machine, and the second must register before the job ends
    result = elastic_job(3, 2, 2, "--kill=1:4", f"--kill-joiner={tmp_path / 'once'}",
                         "--step-s=0.15", steps=90, launcher=("--restarts", "2"))
    check_finished(result, 3, steps=90)
    assert result.stdout.count("restarting worker 1") == 2


FLAPPING = str(Path(__file__).resolve().parent / "programs" / "flapping_worker.py")


def test_a_restart_that_fails_before_registering_leaves_the_next_ones_join_alone(tmp_path):
    # worker 1 is killed at step 4; its first restart fails before it registers, its second
    # joins. bpslaunch knows its restarts by their process group, not by their order: the
    # joiner is not taken for one that never joined and killed in its clean shutdown (137).
    # The last step waits for the join, however long the restart takes to start
    result = elastic_job(3, 2, 2, "--kill=1:4", "--step-s=0.1", f"--joins={tmp_path / 'joins'}:1",
                         steps=30, launcher=("--restarts", "2"),
                         wrapper=(sys.executable, FLAPPING, str(tmp_path / "starts"), "1", "--"))
    check_finished(result, 3, steps=30)
    assert "worker 1: restart 1 fails before it registers" in result.stdout
    assert result.stdout.count("restarting worker 1") == 2
    assert "never joined" not in result.stdout and "[bpslaunch] killing" not in result.stdout


def test_a_flapping_worker_ends_with_the_job_when_its_last_restart_joins(tmp_path):
    # worker 1's restarts: two fail before registering, the third dies as it joins (the job
    # re-forms for it and then without it), two more fail before registering, the sixth
    # joins and finishes with the others. The one that died after joining is the loss the
    # scheduler recorded, not one of those that never registered. The last step waits for
    # both joins; each starts torch first, tens of seconds on a loaded machine
    result = elastic_job(3, 2, 2, "--kill=1:4", f"--kill-joiner={tmp_path / 'once'}",
                         "--step-s=0.1", f"--joins={tmp_path / 'joins'}:2", steps=30,
                         launcher=("--restarts", "6"), timeout=200,
                         wrapper=(sys.executable, FLAPPING, str(tmp_path / "starts"), "1,2,4,5",
                                  "--"))
    check_finished(result, 3, steps=30)
    assert result.stdout.count("fails before it registers") == 4
    assert "killed as it joins" in result.stdout
    assert result.stdout.count("restarting worker 1") == 6
    assert "never joined" not in result.stdout and "[bpslaunch] killing" not in result.stdout


def test_a_worker_that_is_only_slow_is_not_evicted():
    # stopped for 3 s, under the heartbeat timeout (6 s): nobody re-forms
    result = elastic_job(3, 2, 2, "--pause=1:6", "--pause-s=3.0")
    check_finished(result, 3)
    assert "re-formed" not in result.stdout and "lost" not in result.stdout


@pytest.mark.parametrize("wrapper", ["ddp", "crossbarrier"])
def test_the_wrappers_re_form_when_a_loss_lands_mid_backward(wrapper):
    # the survivors sleep 2.5 s between the two layers' gradients of step 4 while worker 1
    # dies: the re-form aborts their backward pass half done (DDP had queued its end of
    # backward; CrossBarrier holds the last step's pending updates)
    check_finished(elastic_job(3, 2, 2, "--wrapper", wrapper, "--kill=1:4", "--slow=4:2.5"), 2,
                   goal_s=GOAL_S + 2.5)  # the survivors' sleep adds to the wait


def test_servers_that_hear_of_two_re_forms_late_keep_the_pushes_of_both():
    # two workers die at once and both servers are stopped for 2.5 s as it happens: the
    # survivors push in epoch 2 before a server has heard of epoch 1
    cmd = [sys.executable, "-m", "adtopk_ps.launcher", "--local", "--num-workers", "4",
           "--num-servers", "2", "--min-workers", "2", "--timeout", "100", "--", sys.executable,
           PROGRAM, "--steps", str(STEPS), "--kill=2:5", "--kill=3:5"]
    # heartbeats that outlast the stop: the servers are late, not lost
    launcher = subprocess.Popen(cmd, env={**os.environ, **FAST, **ELASTIC},
                                stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
    lines, stopped = [], []
    try:
        for line in launcher.stdout:
            lines.append(line)
            if not stopped and "killed after step" in line:
                stopped = role_pids(launcher.pid, "server")
                for pid in stopped:
                    os.kill(pid, signal.SIGSTOP)
                threading.Timer(2.5, lambda: [os.kill(p, signal.SIGCONT) for p in stopped]).start()
        launcher.wait(130)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert len(stopped) == 2
    result = subprocess.CompletedProcess(cmd, launcher.returncode, "".join(lines))
    check_finished(result, 2, goal_s=GOAL_S + 2.5)  # the servers' stop adds to the wait


def test_a_worker_that_fails_on_its_own_still_fails_an_elastic_job():
    # only a worker the job re-formed without is excused; one that exits 3 after finishing
    # its work fails the job with 3
    script = ("import sys, adtopk_ps.torch as hvd; hvd.init(); rank = hvd.rank(); "
              "hvd.shutdown(); sys.exit(3 if rank == 0 else 0)")
    result = bpslaunch("--local", "--num-workers", "2", "--num-servers", "1", "--min-workers", "1",
                       "--timeout", "60", "--", sys.executable, "-c", script, timeout=90)
    assert result.returncode == 3, result.stdout[-3000:]


@contextmanager
def idle_engine():
    """A worker's engine whose thread never starts, for driving its re-form by hand."""
    import zmq

    from adtopk_ps.client.engine import Engine
    from adtopk_ps.cluster.membership import ClusterConfig
    config = ClusterConfig.from_env({"DMLC_ROLE": "worker", "DMLC_NUM_WORKER": "2",
                                     "DMLC_NUM_SERVER": "1", "DMLC_PS_ROOT_URI": "127.0.0.1",
                                     "DMLC_PS_ROOT_PORT": "9"})
    ctx = zmq.Context()
    engine = Engine(config, ctx)
    try:
        yield engine
    finally:
        engine.stop(0)
        engine._wake_in.close(0)  # (the thread that closes it never ran)
        ctx.term()


def test_a_call_checked_before_a_re_form_cannot_slip_in_after_it():
    # the client checks for a re-form, then queues: the engine refuses under its lock too,
    # so a push or collective request of the old membership never goes out in the new one
    from adtopk_ps.client.errors import MembershipChanged
    with idle_engine() as engine:
        engine._reshape({"epoch": 1, "rank": 0, "num_workers": 1, "what": "worker 1 lost"})
        with pytest.raises(MembershipChanged, match="worker 1 lost; the job goes on with 1"):
            engine.submit(0, None, None, None, None, 0, None)
        with pytest.raises(MembershipChanged):
            engine.negotiate(engine.new_request(), {}, None)
        assert engine._jobs == [] and engine._agreements == {} and engine.size == 1


def test_an_acknowledgement_waits_until_the_old_membership_has_failed():
    # a worker that acknowledges a re-form while the engine is still failing the old
    # membership's calls could queue a request that fails there and still goes out (the
    # scheduler then sees it twice): acknowledgements wait for the end of the re-form, and
    # below the minimum for the next one
    from adtopk_ps.torch.elastic import HostsUpdatedInterrupt
    with idle_engine() as engine:
        seen = []
        fail_all = engine._fail_all
        engine._fail_all = lambda error: (seen.append(engine.resumed.is_set()), fail_all(error))
        engine._reshape({"epoch": 1, "rank": 0, "num_workers": 1, "what": "worker 1 lost",
                         "waiting": "only 1 worker(s) remain"})
        assert seen == [False] and not engine.resumed.is_set()  # paused: it waits on
        engine._reshape({"epoch": 2, "rank": 0, "num_workers": 2, "what": "worker 1 joined",
                         "joined": True})
        assert seen == [False, False] and engine.resumed.is_set()
        assert isinstance(engine.changed, HostsUpdatedInterrupt)  # joins only: horovod's name


def test_a_lost_server_moves_its_keys_and_the_job_goes_on():
    # server 1 is killed at step 6: its keys move to server 0, the workers push again from
    # their last commit, and all 3 finish bit-identical; the next step comes within the goal
    steps = 40
    cmd = [sys.executable, "-m", "adtopk_ps.launcher", "--local", "--num-workers", "3",
           "--num-servers", "2", "--min-workers", "2", "--timeout", "100", "--", sys.executable,
           PROGRAM, "--steps", str(steps), "--step-s=0.05"]
    result, killed = run_and_kill(cmd, {**os.environ, **FAST, **ELASTIC}, r"step 6 of 3 at",
                                  "server", 1, timeout=120)
    assert len(killed) == 1, result.stdout
    check_finished(result, 3, steps=steps)
    assert "its keys move to the other server(s); going on with 3 worker(s) and 1 server(s)" \
        in result.stdout
    gap = kill_to_next_step(f"{result.stdout}\nserver 1: killed after step 6 at {killed[0]}")
    assert gap[0] <= GOAL_S, (gap, result.stdout)


def test_a_server_lost_while_the_job_waits_below_its_minimum_keeps_it_waiting(tmp_path):
    # workers 1 and 2 die at step 5 (at least 2): the job waits; server 1 is then killed:
    # its keys move, but the one worker left must not train alone, and the wait runs out
    # (a restart of one of them is on its way, sleeping 60 s first: a worker may still join)
    slow_restart = ("sh", "-c", f'mkdir "{tmp_path}/started.$DMLC_WORKER_ID" 2>/dev/null || '
                    'sleep 60; exec "$@"', "sh")
    cmd = [sys.executable, "-m", "adtopk_ps.launcher", "--local", "--num-workers", "3",
           "--num-servers", "2", "--min-workers", "2", "--restarts", "1", "--timeout", "100", "--",
           *slow_restart, sys.executable, PROGRAM, "--steps", "40", "--step-s=0.05", "--kill=1:5",
           "--kill=2:5"]
    result, killed = run_and_kill(cmd, {**os.environ, **FAST, **ELASTIC, "PS_ELASTIC_TIMEOUT_S": "8"},
                                  r"for 1 more to join \(epoch", "server", 1, timeout=120)
    out = result.stdout
    assert len(killed) == 1 and result.returncode != 0, out
    assert "its keys move to the other server(s); only 1 worker(s) remain" in out, out
    assert "no worker joined to make up the rest within 8 s" in out, out
    assert not re.search(r"step \d+ of 1 at", out), out  # never a step below the minimum


def test_a_joiner_waiting_on_a_worker_whose_connection_came_back_is_taken_in():
    # a joiner registers while a worker's connection is closed (its loss would take the
    # joiner in with one re-form); the connection comes back: the joiner goes in all the same
    from adtopk_ps.cluster.membership import ClusterConfig
    from adtopk_ps.cluster.node import Node
    from adtopk_ps.cluster.scheduler import Scheduler
    from adtopk_ps.launcher import free_port
    env = {"DMLC_ROLE": "scheduler", "DMLC_PS_ROOT_URI": "127.0.0.1",
           "DMLC_PS_ROOT_PORT": str(free_port()), "DMLC_NUM_WORKER": "3", "DMLC_NUM_SERVER": "1",
           "PS_MIN_WORKERS": "2"}
    scheduler = Scheduler(ClusterConfig.from_env(env))
    try:
        now = time.monotonic()
        scheduler.nodes = {b"s0": Node(b"s0", "server", 0, "tcp://h:1", now, 10, started_as=0),
                           b"w0": Node(b"w0", "worker", 0, "h", now, 11, started_as=0),
                           b"w1": Node(b"w1", "worker", 1, "h", now, 12, started_as=1)}
        scheduler.started, scheduler.workers = True, 2
        scheduler.conns.open.update({10, 11, 12})
        scheduler._connection_closed(12)  # w1's connection closes (a blip, zmq reconnects)
        scheduler.conns.open.discard(12)
        scheduler._join(Node(b"j", "worker", -1, "h", now, 13, started_as=2))
        assert scheduler.joining and scheduler.epoch == 0  # held for w1's verdict
        scheduler.conns.open.add(14)  # w1 speaks again on a new connection
        w1 = scheduler.nodes[b"w1"]
        w1.fd, w1.last_seen = 14, time.monotonic()
        assert scheduler._closed_node() is None and w1.closed_at is None
        scheduler._take_in()
        assert not scheduler.joining and scheduler.epoch == 1 and scheduler.workers == 3
        assert scheduler.nodes[b"j"].rank == 2
    finally:
        scheduler.conns.close()
        scheduler.sock.close(0)


def test_a_worker_lost_after_the_others_finished_every_step_fails_nothing():
    # worker 2 dies in the commit after the last step: the others have finished every step
    # with it, so the job is done (exit 0), its loss recorded
    result = elastic_job(3, 2, 2, "--kill=2:16", "--when", "mid-commit")
    out = result.stdout
    assert result.returncode == 0, out
    done = survivors(out)
    assert len(done) == 2 and {(step, size) for step, _, size in done} == {(STEPS, 3)}, out
    assert len({digest for _, digest, _ in done}) == 1
    assert "the other workers had finished every step, so the job is done" in out


def test_losing_every_worker_ends_the_job_instead_of_starting_over():
    # both workers die at once: nobody holds the training state for a joiner, so restarts
    # would train from scratch and report success; the job ends, naming why
    result = elastic_job(2, 1, 1, "--kill=0:5", "--kill=1:5", "--step-s=0.05", steps=40,
                         launcher=("--restarts", "2"))
    assert result.returncode != 0, result.stdout
    assert "no other worker remains to hand the training state to one that joins" in result.stdout
    assert "done step=40" not in result.stdout


@pytest.mark.parametrize("restarts", ["0", "1"])
def test_below_the_minimum_with_no_restarts_left_the_job_ends_at_once(restarts, tmp_path):
    """3 workers, at least 2: two die (with a restart, the restart dies as it joins). Nothing
    can join any more, and bpslaunch says so: the one left ends the job within seconds,
    naming why, instead of waiting PS_ELASTIC_TIMEOUT_S (600 s)."""
    kills = ["--kill=1:5", "--kill=2:5"] + ([f"--kill-joiner={tmp_path / 'once'}"]
                                            if restarts == "1" else [])
    started = time.monotonic()
    result = elastic_job(3, 1, 2, *kills, "--step-s=0.05", steps=400,
                         launcher=("--restarts", restarts), timeout=120)
    took = time.monotonic() - started
    assert result.returncode == 1, result.stdout
    assert re.search(r"only 1 worker\(s\) remain, below PS_MIN_WORKERS=2, and no worker can "
                     r"join \(bpslaunch has no restarts left\)", result.stdout), result.stdout
    assert "done step=400" not in result.stdout and took < 100, took


def test_a_joiner_slow_to_start_is_named_then_dropped_and_the_job_goes_on(tmp_path):
    """Worker 1 dies and its restart joins, then sleeps 120 s before its first step (a slow
    data loader). The others wait in their next call: after PS_STALL_WARN_S the scheduler
    names the joiner, after PS_STALL_ABORT_S it drops it, telling it why, and the two others
    train to the end (before, they waited in silence for as long as it slept)."""
    result = bpslaunch("--local", "--num-workers", "3", "--num-servers", "1", "--min-workers",
                       "2", "--restarts", "1", "--timeout", "150", "--", sys.executable, PROGRAM,
                       "--steps", "60", "--kill=1:5", "--step-s=0.1", "--joiner-sleep-s=120",
                       f"--joins={tmp_path / 'joins'}:1", timeout=180,
                       env={**ELASTIC, "PS_STALL_WARN_S": "3", "PS_STALL_ABORT_S": "8"})
    out = result.stdout
    assert result.returncode == 0, out
    assert re.search(r"\[scheduler\] .*the other workers have waited \d+ s in .* for worker 2, "
                     r"joined in epoch 2 \(127\.0\.0\.1\), which has not called it .*"
                     r"\(PS_STALL_WARN_S\)", out), out
    assert re.search(r"\[worker 1\] worker 2: worker 2, joined in epoch 2 \(127\.0\.0\.1\) "
                     r"dropped from the job: .*\(PS_STALL_ABORT_S\)", out), out  # told why
    done = survivors(out)
    assert len(done) == 2 and {(step, size) for step, _, size in done} == {(60, 2)}, out
    assert len({digest for _, digest, _ in done}) == 1, done
