"""Real servers under many workers: W synthetic workers replay recorded ADTopk pushes to S
real server processes over loopback, and every server's bytes, CPU and answers are measured.

Real workers cannot reach W = 64 on two cores; synthetic ones can, because they do no model
compute: each registers with a real scheduler as a worker does (its own ``SchedulerLink``,
with heartbeats), opens a DEALER to every server, pushes every key of a round, waits for
every answer and pushes the next round (bulk-synchronous, as the engine). A few driver
processes run them all, each a single-threaded loop over its workers' sockets. The servers
are the real role (``python -m server``), started with a real scheduler as soak.py starts
them.

What they push was recorded once, at the start of the run, from real gradients: the
Fashion-MNIST CNN of configs/fashion-cnn.yaml trained to ``--at`` steps, then W gradients of
it, each on a batch of its own, at each of a few consecutive steps (union_density.py's
``trained_gradients``: W real gradients of one model state are what W data-parallel
workers push at one step, and their union is what union_density.py measures). Each worker
keeps its own error-feedback residual over ``--feedback-steps`` steps before the recorded
``--steps``, and its pushes are ADTopk of gradient plus residual, cut into the keys of the
placement under test, as the engine cuts them. The run prints the union of those pushes next
to union_density.py's union of the same gradients without feedback, and the servers' answer
density next to both.

Measured, per server, over the rounds after ``--warmup``: bytes in (pushes) and out
(answers, every copy), CPU (utime + stime of the process from /proc/<pid>/stat), CPU per byte,
the answers' density (values answered over elements of the keys), and per round the latency
from the last worker's last push to the last answer's arrival (median and p90). Every
answer is checked against the sum of the replayed pushes computed here. The per-server
points of every run are fitted as server CPU = sigma x bytes + mu x pushes received, the
form of benchmarks/step_model.py's server term, which reads them from docs/loadgen.json.

    python benchmarks/loadgen.py                      # W = 16, 32, 64 at S = 4 and S = W/4
    python benchmarks/loadgen.py --workers 16 --servers 4 --rounds 20 --repeats 1
    python benchmarks/loadgen.py --report runs/*.json --json docs/loadgen.json   # pooled, fit

tests/test_loadgen.py runs a small one (W = 4, S = 2) on the digits CNN, without Fashion-MNIST.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import pickle
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import NamedTuple

import msgpack
import torch
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from union_density import CONFIG, trained_gradients, union_density  # noqa: E402

from adtopk_ps import wire  # noqa: E402
from adtopk_ps.cluster.membership import (ClusterConfig, make_key, part_name,  # noqa: E402
                                          partition_rows, server_of)
from adtopk_ps.cluster.transport import SchedulerLink, drain, make_socket  # noqa: E402
from adtopk_ps.compression import ResidualMemory, create  # noqa: E402
from adtopk_ps.launcher import free_port  # noqa: E402
from adtopk_ps.wire import Op  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TICKS = os.sysconf("SC_CLK_TCK")
PLACEMENTS = ("djb2", "balanced")
PHASE_TIMEOUT_S = 600.0  # the longest a cluster may take to form, warm up or run its rounds


class Key(NamedTuple):
    """One key of a placement: the tensor it is cut from, its rows, its number and server."""

    tensor: str
    start: int
    length: int
    key: int
    server: int


def place(shapes: dict[str, tuple[int, ...]], servers: int, how: str, partition_bytes: int,
          ratio: float) -> list[Key]:
    """The keys ``shapes`` (declared in this order) are cut into and the server of each:
    byteps' partitions placed by djb2 of the key (``membership.server_of``), or the balanced
    placement's row ranges (``placement.plan``), as a worker of a cluster of ``servers``
    would send them.

    Example::

        place({"fc.weight": (256, 1568)}, 4, "djb2", 4096000, 0.01)   # one key on server 3
    """
    keys = []
    if how == "djb2":
        for tid, (name, shape) in enumerate(shapes.items()):
            for index, (start, length) in enumerate(partition_rows(shape, 4, partition_bytes)):
                key = make_key(tid, index)
                keys.append(Key(name, start, length, key, server_of(key, servers)))
        return keys
    from adtopk_ps.cluster import placement
    names = list(shapes)
    plan = placement.plan([placement.Item(tid, shape, 4, placement.push_bytes(shape, 4, ratio))
                           for tid, shape in enumerate(shapes.values())], servers, partition_bytes)
    where = plan.assign(servers)
    for tid, blocks in sorted(plan.blocks.items()):
        for index, (start, length) in enumerate(blocks):
            key = make_key(tid, index)
            keys.append(Key(names[tid], start, length, key, where[key]))
    return keys


# ---- the recording ------------------------------------------------------------------------

def record(config: Path, workers: int, at: int, feedback_steps: int, steps: int, ratio: float,
           layouts: dict[str, list[Key]], seed: int) -> tuple[dict, dict]:
    """Each layout's pushes, ``pushes[worker][step][k]`` the encoded frames of its k-th key
    (round 0; a driver re-stamps the round), and the unions of the last step's pushes
    beside union_density.py's of the same gradients.

    Every worker compresses gradient plus its residual with ADTopk and keeps what was not
    sent (``ResidualMemory``), over whole tensors; a key's push is ADTopk of its rows of
    the same compensated gradient, which is what the engine's per-key residuals give, as
    ADTopk keeps every axis-1 fibre whole."""
    adtopk = create("adtopk", ratio=ratio)
    memories = [ResidualMemory() for _ in range(workers)]
    pushes = {name: [[] for _ in range(workers)] for name in layouts}
    unions: dict = {}
    points = list(range(at, at + feedback_steps + steps))
    for point, grads in trained_gradients(config, points, workers, seed):
        compensated = []
        for w, grad in enumerate(grads):
            sent = {n: memories[w].compensate(n, g) for n, g in grad.items()}
            if point >= points[-steps]:
                for name, keys in layouts.items():
                    pushes[name][w].append([encoded(adtopk, sent[k.tensor], k, w) for k in keys])
            if point == points[-1]:
                compensated.append({n: c.clone() for n, c in sent.items()})
            for n, c in sent.items():
                memories[w].update(n, c, adtopk.compress(c, n))
    spec = {"compressor": "adtopk", "k": ratio}
    counts = sorted({w for w in (1, 2, 4, 8, 16, 32, 64, 128, 256) if w <= workers} | {workers})
    unions["pushes"] = union_density(compensated, spec, counts)["union"]
    unions["without feedback"] = union_density(list(grads), spec, counts)["union"]
    return pushes, unions


def encoded(adtopk, tensor: torch.Tensor, k: Key, worker: int) -> list[bytes]:
    """One key's push as the engine sends it: ADTopk of the key's rows, encoded."""
    rows = tensor.narrow(0, k.start, k.length)
    payload = adtopk.compress(rows, part_name(k.tensor, k.key & 0xFFFF))
    return [bytes(f) for f in wire.encode(Op.PUSH, key=k.key, round=0, sender=worker, payload=payload)]


def expected_sums(pushes: list, workers: int, step: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact sum (float64) of the first ``workers`` workers' pushes of one key at one
    step, and the sum of their magnitudes (which bounds float32's rounding)."""
    total = absolute = None
    for w in range(workers):
        payload = wire.decode(pushes[w][step][index]).payload
        if total is None:
            total = torch.zeros(payload.shape, dtype=torch.float64)
            absolute = torch.zeros(payload.shape, dtype=torch.float64)
        payload.accumulate_into(total)
        payload.values = payload.values.abs()
        payload.accumulate_into(absolute)
    return total, absolute


def check_answers(pushes: list, keys: list[Key], workers: int, answers: dict) -> int:
    """Check every answer ((round, key index) -> its frames) against the sum of the pushes
    replayed in that round: the same positions, and every value within the rounding that
    float32 additions in the server's order allow, ``(W - 1) 2^-24`` of the magnitudes'
    sum. Raises AssertionError naming the first that is not; returns how many were checked."""
    steps = len(pushes[0])
    sums = {}
    for (rnd, index), frames in sorted(answers.items()):
        step = rnd % steps
        if (step, index) not in sums:
            sums[step, index] = expected_sums(pushes, workers, step, index)
        total, absolute = sums[step, index]
        msg = wire.decode(frames)
        assert msg.op == Op.RESULT and msg.key == keys[index].key and msg.round == rnd, \
            f"answer of round {rnd} of key {keys[index].key} is {msg.op} {msg.key} {msg.round}"
        got = msg.payload.decompress().double()
        bound = (workers - 1) * 2.0 ** -24 * absolute + 2.0 ** -60
        worst = float(((got - total).abs() - bound).max())
        assert worst <= 0, f"round {rnd} key {keys[index].key}: an answer is {worst:.3g} " \
                           f"beyond the exact sum's float32 rounding"
    return len(answers)


# ---- a driver: the synthetic workers of one process -----------------------------------------

class Synthetic:
    """One synthetic worker: its scheduler link, a DEALER per server, its rounds' times."""

    def __init__(self, ctx: zmq.Context, rank: int):
        self.rank = rank
        self.config = ClusterConfig.from_env({**os.environ, "DMLC_WORKER_ID": str(rank)}, "worker")
        self.link = SchedulerLink(ctx, self.config)
        self.socks: list[zmq.Socket] = []
        self.next_round = 0
        self.waiting = 0  # answers of the current round still to come
        self.pushed: dict[int, float] = {}  # round -> when its last push left
        self.answered: dict[int, float] = {}  # round -> when its last answer came

    def connect(self, ctx: zmq.Context) -> None:
        for index, address in enumerate(self.link.book["servers"]):
            sock = make_socket(ctx, zmq.DEALER, f"{self.link.identity}-e0-s{index}", curve="client",
                               data=self.config)
            sock.connect(address)
            self.socks.append(sock)


def drive(args: argparse.Namespace) -> int:
    """A driver process: register its workers, run the warm-up rounds, say ``WARM``, wait
    for ``GO``, run the measured rounds, say ``DONE`` and its figures, wait for ``FIN``, then
    finish every worker as a real one does (a finish to each server and to the scheduler)."""
    with open(args.drive, "rb") as f:
        recording = pickle.load(f)
    keys = [Key(**k) for k in recording["keys"]]
    pushes = recording["pushes"]
    steps = len(pushes[0])
    headers = [[[msgpack.unpackb(frames[0]) for frames in step] for step in worker] for worker in pushes]
    ctx = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, 16384)
    workers = [Synthetic(ctx, rank) for rank in args.ranks]
    failures: list[BaseException] = []

    def register(s: Synthetic) -> None:
        try:
            s.link.register()
        except BaseException as exc:  # reported below, after every thread is done
            failures.append(exc)
    threads = [threading.Thread(target=register, args=(s,)) for s in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failures:
        raise failures[0]
    for s in workers:
        s.connect(ctx)
    poller = zmq.Poller()
    owner = {}
    for s in workers:
        for index, sock in enumerate(s.socks):
            poller.register(sock, zmq.POLLIN)
            owner[sock] = (s, index)
        poller.register(s.link.sock, zmq.POLLIN)
    poller.register(sys.stdin.fileno(), zmq.POLLIN)
    rounds = args.warmup + args.rounds
    counts = {phase: {"in": [0] * len(workers[0].socks), "out": [0] * len(workers[0].socks),
                      "pushes": [0] * len(workers[0].socks), "answered": [0] * len(workers[0].socks)}
              for phase in ("all", "measured")}
    answers: dict[tuple[int, int], list[bytes]] = {}  # (round, key index) -> the answer's frames
    arrivals: dict[tuple[int, int], int] = {}
    index_of = {k.key: i for i, k in enumerate(keys)}

    def push_round(s: Synthetic) -> None:
        rnd = s.next_round
        s.next_round += 1
        step = rnd % steps
        for index, (k, frames) in enumerate(zip(keys, pushes[s.rank][step])):
            header = dict(headers[s.rank][step][index], round=rnd)
            out = [msgpack.packb(header), *frames[1:]]
            s.socks[k.server].send_multipart(out, copy=False)
            size = sum(len(f) for f in out)
            for phase in ("all", "measured") if rnd >= args.warmup else ("all",):
                counts[phase]["in"][k.server] += size
                counts[phase]["pushes"][k.server] += 1
        s.waiting = len(keys)
        s.pushed[rnd] = time.monotonic()

    def on_answer(s: Synthetic, server: int, frames: list) -> None:
        header = msgpack.unpackb(frames[0].bytes)
        if header["op"] != Op.RESULT.value:
            raise RuntimeError(f"worker {s.rank} got {header} from server {server}")
        rnd, index = header["round"], index_of[header["key"]]
        data = [f.bytes for f in frames]
        size = sum(len(f) for f in data)
        for phase in ("all", "measured") if rnd >= args.warmup else ("all",):
            counts[phase]["out"][server] += size
            counts[phase]["answered"][server] += header["count"]
        seen = answers.setdefault((rnd, index), data)
        if seen != data:
            raise RuntimeError(f"worker {s.rank}'s answer of round {rnd} of key {header['key']} "
                               f"differs from another worker's")
        arrivals[rnd, index] = arrivals.get((rnd, index), 0) + 1
        s.waiting -= 1
        if s.waiting == 0:
            s.answered[rnd] = time.monotonic()

    links = {s.link.sock: s for s in workers}
    ticked = 0.0

    def serve_until(done, phase_end: int) -> None:
        """Push each worker's next round as soon as its last one is answered (up to
        ``phase_end``), take in answers and the scheduler's word, heartbeat; until ``done()``."""
        nonlocal ticked
        deadline = time.monotonic() + PHASE_TIMEOUT_S
        while not done():
            if time.monotonic() > deadline:
                raise TimeoutError(f"driver of workers {args.ranks}: no progress in {PHASE_TIMEOUT_S} s")
            for s in workers:
                if s.waiting == 0 and s.next_round < phase_end:
                    push_round(s)
            for sock, _ in poller.poll(100):
                if sock in owner:
                    s, server = owner[sock]
                    for frames in drain(sock):
                        on_answer(s, server, frames)
                elif sock in links:
                    for frames in drain(sock):
                        links[sock].link.handle(frames)
            if time.monotonic() - ticked > 0.1:  # heartbeats, and the links' liveness
                ticked = time.monotonic()
                for s in workers:
                    s.link.tick()

    def wait_for(word: str) -> None:
        """Serve (heartbeats, no rounds) until the benchmark says ``word`` on stdin."""
        said: list[str] = []

        def heard() -> bool:
            if not said and select.select([sys.stdin], [], [], 0)[0]:
                said.append(sys.stdin.readline().strip())
            return bool(said)
        serve_until(heard, 0)
        if said[0] != word:
            raise RuntimeError(f"driver: expected {word!r} from the benchmark, got {said[0]!r}")

    serve_until(lambda: all(s.next_round == args.warmup and s.waiting == 0 for s in workers), args.warmup)
    print("WARM", flush=True)
    wait_for("GO")
    started = time.monotonic()
    serve_until(lambda: all(s.next_round == rounds and s.waiting == 0 for s in workers), rounds)
    measured = range(args.warmup, rounds)
    with open(args.answers, "wb") as f:
        pickle.dump(answers, f)
    print("DONE " + json.dumps({
        "started": started, "counts": counts,
        "pushed": [max(s.pushed[r] for s in workers) for r in measured],
        "answered": [max(s.answered[r] for s in workers) for r in measured],
        "ports": [int(a.rsplit(":", 1)[1]) for a in workers[0].link.book["servers"]]}), flush=True)
    wait_for("FIN")
    for s in workers:  # behind the last push on each connection, as the engine's finish
        for sock in s.socks:
            sock.send_multipart(wire.encode(Op.FINISH, sender=s.rank), copy=False)
        s.link.finish()
    deadline = time.monotonic() + 30
    while not all(s.link.shutdown for s in workers) and time.monotonic() < deadline:
        for s in workers:
            for frames in drain(s.link.sock):
                s.link.handle(frames)
        time.sleep(0.01)
    for s in workers:
        for sock in s.socks:
            sock.close(2000)
        s.link.close()
    ctx.term()
    return 0 if all(s.link.shutdown for s in workers) else 1


# ---- one cluster run ------------------------------------------------------------------------

def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, from /proc/<pid>/stat (its threads' included)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def kernel_bytes(port: int) -> tuple[int, int]:
    """Bytes the kernel carried to and from local port ``port`` (a server's) on its established
    TCP connections, from ``ss``: what the wire carried, zmq's framing and heartbeats included.
    Both figures are read where the bytes were received (the server's ends for what came in,
    the peers' ends for what went out): a sender's ``bytes_acked`` can lag what its peer
    already holds by a delayed ACK."""
    def received(side: str) -> int:
        out = subprocess.run(["ss", "-tinH", "state", "established", side, "=", f":{port}"],
                             capture_output=True, text=True, check=True).stdout
        return sum(int(t.split(":")[1]) for t in out.split() if t.startswith("bytes_received:"))
    return received("sport"), received("dport")


class Cluster:
    """The processes of one run, each ended when the run is (``close``)."""

    def __init__(self):
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, argv: list[str], env: dict, **kw) -> subprocess.Popen:
        self.procs[name] = subprocess.Popen(argv, env=env, cwd=ROOT, start_new_session=True, **kw)
        return self.procs[name]

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def read_line(proc: subprocess.Popen, word: str, timeout: float = PHASE_TIMEOUT_S) -> str:
    """The next line a driver says, which must start with ``word``."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    line = proc.stdout.readline() if ready else ""
    if not line.startswith(word):
        raise RuntimeError(f"a driver said {line.strip()!r} (exit {proc.poll()}), expected {word}")
    return line[len(word):].strip()


def run_once(recording: Path, keys: list[Key], workers: int, servers: int, args: argparse.Namespace,
             scratch: Path) -> dict:
    """One cluster: a scheduler, ``servers`` servers and the drivers of ``workers`` synthetic
    workers replaying ``recording``; its figures, every answer's frames by driver, and
    every process's pid (each has exited when this returns)."""
    env = {**os.environ, "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": str(free_port()),
           "DMLC_NUM_WORKER": str(workers), "DMLC_NUM_SERVER": str(servers),
           "DMLC_NODE_HOST": "127.0.0.1", "BYTEPS_PARTITION_BYTES": str(args.partition_bytes),
           "OMP_NUM_THREADS": "1", "PS_REGISTER_TIMEOUT_S": "120", "PYTHONPATH": str(ROOT)}
    logs = open(scratch / "roles.log", "w")
    cluster = Cluster()
    try:
        cluster.start("scheduler", [sys.executable, "-m", "adtopk_ps.cluster.scheduler"],
                      {**env, "DMLC_ROLE": "scheduler"}, stdout=logs, stderr=subprocess.STDOUT)
        for j in range(servers):
            cluster.start(f"server{j}", [sys.executable, "-m", "server"],
                          {**env, "DMLC_ROLE": "server", "PS_SERVER_ID": str(j)}, stdout=logs,
                          stderr=subprocess.STDOUT)
        share = -(-workers // min(args.drivers, workers))
        drivers = []
        for d, first in enumerate(range(0, workers, share)):
            drivers.append(cluster.start(
                f"driver{d}", [sys.executable, __file__, "--drive", str(recording), "--answers",
                               str(scratch / f"answers{d}.pkl"), "--warmup", str(args.warmup),
                               "--rounds", str(args.rounds), "--ranks",
                               *map(str, range(first, min(workers, first + share)))],
                {**env, "DMLC_ROLE": "worker"}, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=logs, text=True))
        for proc in drivers:
            try:
                read_line(proc, "WARM")
            except RuntimeError as exc:
                logs.flush()
                raise RuntimeError(f"{exc}; the roles said:\n"
                                   + (scratch / "roles.log").read_text()[-3000:]) from None
        pids = {name: p.pid for name, p in cluster.procs.items()}
        before = {name: cpu_seconds(pid) for name, pid in pids.items()}
        for proc in drivers:
            proc.stdin.write("GO\n")
            proc.stdin.flush()
        done = [json.loads(read_line(proc, "DONE")) for proc in drivers]
        after = {name: cpu_seconds(pid) for name, pid in pids.items()}
        wire_bytes = [kernel_bytes(port) for port in done[0]["ports"]]
        for proc in drivers:
            proc.stdin.write("FIN\n")
            proc.stdin.flush()
        statuses = {name: p.wait(timeout=60) for name, p in cluster.procs.items()}
    finally:
        cluster.close()
        logs.close()
    if any(statuses.values()):
        raise RuntimeError(f"exit statuses {statuses}; see {scratch / 'roles.log'}:\n"
                           + (scratch / "roles.log").read_text()[-3000:])
    answers = {}
    for d in range(len(drivers)):
        with open(scratch / f"answers{d}.pkl", "rb") as f:
            answers[d] = pickle.load(f)
    cpu = {name: after[name] - before[name] for name in pids}
    total, every = ({c: [sum(d["counts"][phase][c][j] for d in done) for j in range(servers)]
                     for c in ("in", "out", "pushes", "answered")} for phase in ("measured", "all"))
    latency = sorted(max(d["answered"][r] for d in done) - max(d["pushed"][r] for d in done)
                     for r in range(args.rounds))
    wall = max(d["answered"][-1] for d in done) - min(d["started"] for d in done)
    numel = [sum(k.length * math.prod(args.shapes[k.tensor][1:]) for k in keys if k.server == j)
             for j in range(servers)]
    per_server = [{
        "in": total["in"][j] / args.rounds, "out": total["out"][j] / args.rounds,
        "pushes": total["pushes"][j] / args.rounds, "cpu_s": cpu[f"server{j}"] / args.rounds,
        "keys": sum(k.server == j for k in keys),
        "density": total["answered"][j] / (workers * args.rounds * numel[j]) if numel[j] else None,
        "counted_all": {"in": every["in"][j], "out": every["out"][j], "pushes": every["pushes"][j]},
        "kernel_all": {"in": wire_bytes[j][0], "out": wire_bytes[j][1]},
    } for j in range(servers)]
    moved = sum(s["in"] + s["out"] for s in per_server)
    return {
        "workers": workers, "servers": servers, "rounds": args.rounds, "wall_s": wall,
        "latency_s": latency, "per_server": per_server,
        "cpu_per_byte_s": sum(s["cpu_s"] for s in per_server) / moved,
        "density": sum(total["answered"]) / (workers * args.rounds * sum(numel)),
        "cpu_s": {"servers": sum(cpu[f"server{j}"] for j in range(servers)),
                  "drivers": sum(cpu[f"driver{d}"] for d in range(len(drivers))),
                  "scheduler": cpu["scheduler"]},
        "pids": pids, "answers": answers,
    }


# ---- the benchmark --------------------------------------------------------------------------

def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def fit(points: list[dict], per_push: bool = True) -> dict:
    """sigma (s per byte in and out) and, with ``per_push``, mu (s per push received) of
    server CPU per round, non-negative least squares over every server of every run that had
    keys; how many points it puts within 15% and its worst error."""
    import numpy as np
    from scipy.optimize import nnls
    rows = [(s["in"] + s["out"], s["pushes"], s["cpu_s"]) for s in points if s["pushes"]]
    terms = np.array([r[:2] if per_push else r[:1] for r in rows])
    found, _ = nnls(terms, np.array([r[2] for r in rows]))
    sigma, mu = float(found[0]), float(found[1]) if per_push else 0.0
    errors = [float((sigma * b + mu * p) / c - 1) for b, p, c in rows if c > 0]
    return {"sigma_s_per_byte": sigma, "mu_s_per_push": mu, "points": len(rows),
            "within_15pct": sum(abs(e) <= 0.15 for e in errors),
            "worst_error": max(errors, key=abs, default=0.0)}


def summary_row(w: int, s: int, how: str, runs: list[dict]) -> tuple[str, dict]:
    """One table row (medians over the repeats, lowest-highest) and its JSON."""
    def med(values: list[float]) -> tuple[float, float, float]:
        return statistics.median(values), min(values), max(values)
    busiest = [max(p["in"] + p["out"] for p in r["per_server"]) for r in runs]
    mean = [statistics.mean(p["in"] + p["out"] for p in r["per_server"]) for r in runs]
    cpu_busy = [max(p["cpu_s"] for p in r["per_server"]) for r in runs]
    row = {
        "workers": w, "servers": s, "placement": how, "repeats": len(runs),
        "latency_p50_ms": med([1000 * statistics.median(r["latency_s"]) for r in runs]),
        "latency_p90_ms": med([1000 * quantile(r["latency_s"], 0.9) for r in runs]),
        "rounds_per_s": med([r["rounds"] / r["wall_s"] for r in runs]),
        "density": med([r["density"] for r in runs]),
        "busiest_mb_per_round": med([b / 1e6 for b in busiest]),
        "busiest_over_mean": med([b / m for b, m in zip(busiest, mean)]),
        "busiest_cpu_ms_per_round": med([1000 * c for c in cpu_busy]),
        "ns_per_byte": med([1e9 * r["cpu_per_byte_s"] for r in runs]),
        "cores_busy": med([sum(r["cpu_s"].values()) / r["wall_s"] for r in runs]),
        "server_cores_busy": med([r["cpu_s"]["servers"] / r["wall_s"] for r in runs]),
        "keys": sum(p["keys"] for p in runs[0]["per_server"]),
    }

    def cell(name: str, fmt: str) -> str:
        m, lo, hi = row[name]
        return f"{m:{fmt}} ({lo:{fmt}}-{hi:{fmt}})"
    text = (f"| {w} | {s} | {how} | {row['keys']} | {cell('density', '.4f')} | "
            f"{cell('busiest_mb_per_round', '.2f')} | {cell('busiest_over_mean', '.2f')} | "
            f"{cell('busiest_cpu_ms_per_round', '.1f')} | {cell('ns_per_byte', '.2f')} | "
            f"{cell('latency_p50_ms', '.1f')} | {cell('latency_p90_ms', '.1f')} | "
            f"{cell('rounds_per_s', '.1f')} | {cell('cores_busy', '.2f')} |")
    return text, row


HEADER = ["| W | S | placement | keys | answer density | busiest server MB in+out per round "
          "| busiest / mean | busiest server CPU ms per round | server CPU ns per byte "
          "| round latency p50 ms | p90 ms | rounds/s | cores busy |",
          "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]


def placements_available(wanted: list[str]) -> list[str]:
    """The placements asked for that this tree has (the balanced one needs
    ``adtopk_ps.cluster.placement``)."""
    if importlib.util.find_spec("adtopk_ps.cluster.placement") is not None:
        return wanted
    print("loadgen: adtopk_ps.cluster.placement is not in this tree; djb2 only", flush=True)
    return [p for p in wanted if p == "djb2"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--workers", type=int, nargs="+", default=[16, 32, 64])
    ap.add_argument("--servers", nargs="+", default=["4", "W/4"],
                    help="server counts; W/4 is a quarter of the workers")
    ap.add_argument("--placements", nargs="+", default=list(PLACEMENTS), choices=PLACEMENTS)
    ap.add_argument("--rounds", type=int, default=30, help="measured rounds per run")
    ap.add_argument("--warmup", type=int, default=3, help="rounds before the measured ones")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--drivers", type=int, default=2, help="processes the synthetic workers share")
    ap.add_argument("--config", type=Path, default=CONFIG, help="the job whose model and data give the gradients")
    ap.add_argument("--at", type=int, default=1500,
                    help="training steps before the recording (union.json's point is 1500)")
    ap.add_argument("--feedback-steps", type=int, default=10,
                    help="steps each worker's residual builds over before the recorded ones")
    ap.add_argument("--steps", type=int, default=3, help="recorded steps, replayed in turn")
    ap.add_argument("--ratio", type=float, default=0.01)
    ap.add_argument("--partition-bytes", type=int, default=4096000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--keep", help="keep each run's recording and answers under this folder")
    ap.add_argument("--report", nargs="+",
                    help="print the report of stored runs (--json; several pooled, and with --json "
                         "written there with their fit) and exit")
    ap.add_argument("--drive", help=argparse.SUPPRESS)
    ap.add_argument("--answers", help=argparse.SUPPRESS)
    ap.add_argument("--ranks", type=int, nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.drive:
        return drive(args)
    if args.report:
        stored = [json.loads(Path(path).read_text()) for path in args.report]
        pooled = {**stored[0], "rows": [r for d in stored for r in d["rows"]],
                  "answers_checked": sum(d["answers_checked"] for d in stored)}
        if args.json:  # the pooled runs and their fit, as benchmarks/step_model.py reads them
            pooled["fit"] = fit([p for r in pooled["rows"] for run in r["runs"] for p in run["per_server"]])
            Path(args.json).write_text(json.dumps(pooled, indent=1) + "\n")
        print(report(pooled))
        return 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a run's processes end with it
    torch.set_num_threads(1)
    configs = sorted({(w, int(s.replace("W/4", str(max(1, w // 4))))) for w in args.workers
                      for s in args.servers})
    placements = placements_available(args.placements)
    shapes = sparsified_shapes(args.config)
    args.shapes = shapes
    layouts = {f"{how}-S{s}": place(shapes, s, how, args.partition_bytes, args.ratio)
               for how in placements for _, s in configs}
    began = time.monotonic()
    pushes, unions = record(args.config, max(args.workers), args.at, args.feedback_steps, args.steps,
                            args.ratio, layouts, args.seed)
    print(f"recorded {args.steps} steps of {max(args.workers)} workers at step {args.at} of "
          f"{args.config.name} ({', '.join(f'{n} {s}' for n, s in shapes.items())}) in "
          f"{time.monotonic() - began:.0f} s", flush=True)
    print("union of W workers' pushes (with feedback) | union_density.py's, same gradients, "
          "without: " + ", ".join(f"W={w}: {unions['pushes'][w]:.4f} | {unions['without feedback'][w]:.4f}"
                                  for w in unions["pushes"]), flush=True)
    print("\n".join(HEADER), flush=True)
    rows, checked = [], 0
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(args.keep or tmp)
        for w, s in configs:
            for how in placements:
                name = f"{how}-S{s}"
                runs = []
                for rep in range(args.repeats):
                    scratch = base / f"W{w}-{name}-r{rep}"
                    scratch.mkdir(parents=True, exist_ok=True)
                    recording = scratch / "recording.pkl"
                    with open(recording, "wb") as f:
                        pickle.dump({"keys": [k._asdict() for k in layouts[name]],
                                     "pushes": pushes[name][:w]}, f)
                    run = run_once(recording, layouts[name], w, s, args, scratch)
                    for answers in run.pop("answers").values():
                        checked += check_answers(pushes[name], layouts[name], w, answers)
                    runs.append(run)
                print(summary_row(w, s, how, runs)[0], flush=True)
                rows.append({"workers": w, "servers": s, "placement": how, "runs": runs})
                data = {"config": args.config.name, "at": args.at, "steps": args.steps,
                        "feedback_steps": args.feedback_steps, "ratio": args.ratio, "shapes": shapes,
                        "unions": unions, "answers_checked": checked, "rows": rows}
                if args.json:  # after every row: a run cut short keeps what it measured
                    Path(args.json).write_text(json.dumps(data, indent=1) + "\n")
    print("\n" + report(data))
    return 0


def report(data: dict) -> str:
    """The report of a stored run (``--json``): the table, the answers checked and the
    server-CPU fits, with and without a cost per push."""
    rows = [summary_row(r["workers"], r["servers"], r["placement"], r["runs"]) for r in data["rows"]]
    points = [p for r in data["rows"] for run in r["runs"] for p in run["per_server"]]
    lines = [*HEADER, *(text for text, _ in rows), "",
             f"Every answer exact: {data['answers_checked']} checked, each within float32's "
             f"rounding of the sum of the pushes replayed.", ""]
    for per_push in (True, False):
        f = fit(points, per_push)
        lines.append(f"Server CPU per round fit over {f['points']} server points: "
                     f"sigma = {1e9 * f['sigma_s_per_byte']:.3f} ns per byte in and out"
                     + (f", mu = {1e6 * f['mu_s_per_push']:.1f} us per push received" if per_push else
                        " (no cost per push)")
                     + f"; within 15%: {f['within_15pct']} of {f['points']}, worst "
                     f"{f['worst_error']:+.0%}.")
    return "\n".join(lines)


def sparsified_shapes(config: Path) -> dict[str, tuple[int, ...]]:
    """The shapes of the tensors the job of ``config`` sparsifies, in declaration order."""
    import yaml

    from union_density import sparsified
    from worker.models import build
    cfg = yaml.safe_load(config.read_text())
    model = build(cfg["model"], cfg.get("model_args") or {})
    params = dict(model.named_parameters())
    return {n: tuple(params[n].shape) for n in sparsified(cfg, model)}


if __name__ == "__main__":
    sys.exit(main())
