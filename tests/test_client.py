"""The worker client against real scheduler and server processes."""
import json
import sys
from pathlib import Path

import pytest
import torch

from adtopk_ps.client.errors import PushPullError
from adtopk_ps.client.ps_client import PSClient
from adtopk_ps.compression import Compressor

from procs import bpslaunch
from procs import clients as start_clients
from procs import roles

PROGRAMS = Path(__file__).resolve().parent / "programs"


@pytest.fixture
def client():
    with roles(1, 1) as (config, _):
        c = PSClient(config)
        yield c
        c.shutdown()


def test_later_layers_go_first_when_keys_queue_up(client):
    # holding the queue's lock keeps the engine from taking any job until all are queued
    with client._engine.lock:
        handles = [client.push_pull(torch.full((10,), float(i)), f"layer{i}") for i in range(4)]
    for h in handles:
        h.wait(30)
    order = sorted(handles, key=lambda h: h.completed_at)
    assert [h.name for h in order] == ["layer3", "layer2", "layer1", "layer0"]


class Failing(Compressor):
    """A compressor that cannot compress one tensor."""

    def __init__(self, name: str):
        from adtopk_ps.compression import create
        self.inner, self.name = create("topk", ratio=0.25), name

    def compress(self, tensor, name, step=0, ratio=None):
        if name.startswith(self.name):
            raise ValueError(f"cannot compress {name}")
        return self.inner.compress(tensor, name, step, ratio)


def test_a_compression_error_fails_every_handle_at_once():
    # the tensor whose compression failed was off the queue and not yet in flight: its
    # handle must fail too, not wait out the push_pull timeout
    from adtopk_ps.cluster.transport import ClusterError
    with roles(1, 1) as (config, _):
        c = PSClient(config)
        comp = Failing("layer0")
        with c._engine.lock:
            handles = [c.push_pull(torch.ones(8, 8), f"layer{i}", comp) for i in range(4)]
        with pytest.raises(ClusterError, match="engine failed: cannot compress layer0"):
            handles[0].wait(30)
        assert all(h.done() for h in handles)
        with pytest.raises(ClusterError):
            c.push_pull(torch.ones(8, 8), "later")
        c.shutdown()


class Recording(Compressor):
    """top-k, noting each batch the engine hands it."""

    def __init__(self):
        from adtopk_ps.compression import create
        self.inner, self.batches = create("topk", ratio=0.25), []

    def compress(self, tensor, name, step=0, ratio=None):
        return self.inner.compress(tensor, name, step, ratio)

    def start(self, requests):
        self.batches.append([r.name for r in requests])
        return super().start(requests)


def test_tensors_queued_at_once_are_one_batch_for_each_compressor():
    # every tensor waiting when the engine wakes goes to its compressor in one start(), keys
    # of partitioned tensors included, in priority order; the answers are each tensor's own
    with roles(1, 1) as (config, _):
        c = PSClient(config)
        sparse, dense = Recording(), Recording()
        tensors = [torch.randn(64, 64) for _ in range(4)]
        with c._engine.lock:  # the engine wakes only after all four are queued
            handles = [c.push_pull(t, f"layer{i}", sparse if i % 2 else dense, priority=-i)
                       for i, t in enumerate(tensors)]
        for h, t in zip(handles, tensors):  # one worker: the answer is its own top quarter
            got = h.wait(30)
            assert torch.equal(got[got != 0], t[got != 0]) and int((got != 0).sum()) == 64 * 64 // 4
        assert sparse.batches == [["layer3#0", "layer1#0"]] and dense.batches == [["layer2#0", "layer0#0"]]
        c.shutdown()


def test_average_and_sum_and_declared_shapes(client):
    x = torch.arange(12.0).view(3, 4)
    assert torch.equal(client.push_pull(x, "x").wait(10), x)  # one worker: the mean is x
    assert torch.equal(client.push_pull(x, "x", average=False).wait(10), x)
    # a name pushed with another shape is another key; keys never depend on call order
    assert torch.equal(client.push_pull(torch.ones(4, 3), "x").wait(10), torch.ones(4, 3))
    assert client.declare("x", x) != client.declare("x", torch.ones(4, 3))
    assert client.declare("y", x) == client.declare("y", torch.zeros(3, 4))


def test_overlapping_pushes_of_one_name_are_refused():
    with roles(2, 1) as (config, _):
        clients = start_clients(config, 2)
        first = clients[0].push_pull(torch.ones(8, 8), "w")  # waits for worker 1's push
        with pytest.raises(ValueError, match="still in flight"):
            clients[0].push_pull(torch.ones(8, 8), "w")
        other = clients[1].push_pull(torch.full((8, 8), 3.0), "w")
        assert torch.equal(first.wait(30), torch.full((8, 8), 2.0))
        assert torch.equal(other.wait(30), torch.full((8, 8), 2.0))
        for c in clients:
            c.shutdown()


def test_a_refused_push_fails_its_handle_with_the_servers_reason(client):
    client.push_pull(torch.zeros(4, 4), "a").wait(10)
    key = client.declare("a", torch.zeros(4, 4)) << 16
    client._engine.customer.rounds[key] = 5  # desynchronise the key's round, as a buggy worker would
    handle = client.push_pull(torch.zeros(4, 4), "a")
    with pytest.raises(PushPullError, match=f"push for round 5 of key {key}, which is at round 1"):
        handle.wait(10)


def test_answers_land_in_place_averaged_for_every_codec():
    """``out=tensor`` (what the optimizer uses): dense, sparse and multi-key answers are
    written into the pushed tensor itself, averaged, and equal a fresh-buffer push_pull."""
    from adtopk_ps.compression import create
    with roles(2, 2, BYTEPS_PARTITION_BYTES="4096") as (config, _):
        clients = start_clients(config, 2)
        for comp in (None, create("adtopk", ratio=0.1), create("topk", ratio=0.3)):
            for shape in ((6, 7), (64, 40)):  # (64, 40) spans several keys
                grads = [torch.randn(shape, generator=torch.Generator().manual_seed(w)) for w in range(2)]
                fresh = [c.push_pull(g, f"fresh{shape}{comp}", comp) for c, g in zip(clients, grads)]
                want = [h.wait(30).clone() for h in fresh]
                inplace = [g.clone() for g in grads]
                handles = [c.push_pull(t, f"inplace{shape}{comp}", comp, out=t)
                           for c, t in zip(clients, inplace)]
                for h, t, w in zip(handles, inplace, want):
                    assert h.wait(30) is t
                    assert torch.equal(t, w)
                assert torch.equal(want[0], want[1])
        with pytest.raises(ValueError, match=r"out for 'bad' is torch.float32 \(3,\)"):
            clients[0].push_pull(torch.zeros(4), "bad", out=torch.zeros(3))
        for c in clients:
            c.shutdown()


def test_the_gil_switch_interval_is_shortened_unless_turned_off():
    import sys

    from adtopk_ps.client.engine import shorten_gil_switch
    from adtopk_ps.core.env import EnvError
    before = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.005)
        shorten_gil_switch({"PS_GIL_SWITCH_US": "0"})
        assert sys.getswitchinterval() == 0.005
        shorten_gil_switch({})
        assert abs(sys.getswitchinterval() - 200e-6) < 1e-9
        shorten_gil_switch({"PS_GIL_SWITCH_US": "1000"})  # never lengthens what is shorter
        assert abs(sys.getswitchinterval() - 200e-6) < 1e-9
        with pytest.raises(EnvError, match="PS_GIL_SWITCH_US"):
            shorten_gil_switch({"PS_GIL_SWITCH_US": "soon"})
    finally:
        sys.setswitchinterval(before)


def test_a_round_that_a_finished_worker_never_pushed_fails_within_seconds():
    # worker 1 finishes without pushing "only-mine": worker 0 must hear so from the server,
    # not wait out the push_pull timeout; a round worker 1 did push still completes
    import time
    with roles(2, 1) as (config, _):
        w0, w1 = start_clients(config, 2)
        for c, names in ((w0, ("shared", "only-mine", "last", "later")),
                         (w1, ("later", "last", "shared"))):  # keys come from names alone
            for name in names:
                c.declare(name, torch.ones(4))
        shared = [c.push_pull(torch.full((4,), float(c.rank + 1)), "shared", average=False) for c in (w0, w1)]
        assert [h.wait(30).tolist() for h in shared] == [[3.0] * 4] * 2
        stranded = w0.push_pull(torch.ones(4), "only-mine")
        w1.push_pull(torch.full((4,), 5.0), "last", average=False)  # in flight as it finishes
        started = time.monotonic()
        w1.shutdown()
        with pytest.raises(PushPullError, match=r"worker\(s\) \[1\] finished without pushing round 0 of key"):
            stranded.wait(30)
        assert time.monotonic() - started < 10
        # pushed before it finished: the round completes with worker 1's part in it
        assert w0.push_pull(torch.ones(4), "last", average=False).wait(30).tolist() == [6.0] * 4
        # a round it can never push fails as soon as it is pushed, and so does every later one
        for _ in range(2):
            with pytest.raises(PushPullError, match=r"worker\(s\) \[1\] finished without pushing round 0"):
                w0.push_pull(torch.ones(4), "later").wait(10)
        w0.shutdown()


def test_a_collective_name_that_cannot_travel_is_refused_before_anything_is_sent():
    """A name over the limit or not valid UTF-8 raises ValueError on the calling worker, naming
    the limit, before anything is sent (the scheduler's answer to a 30 KB name used to pass
    the wire's header limit and end the job; a lone surrogate killed the engine thread). The
    next collectives are agreed as ever, every worker's own part reaching every worker: a
    sum's, alike on every worker and holding a long key name, and parts that differ."""
    from adtopk_ps.cluster.coordinator import MAX_AGREED_NAME_BYTES
    with roles(2, 1) as (config, _):
        w0, w1 = start_clients(config, 2)
        for name, text in (("x" * 30000, f"of 30000 bytes exceeds the limit of "
                                         f"{MAX_AGREED_NAME_BYTES} bytes"),
                           ("y" * (1 << 20), f"of {1 << 20} bytes exceeds the limit"),
                           ("bad\ud800", r"not valid UTF-8 \(lone surrogate '\\ud800' at position 3\)")):
            with pytest.raises(ValueError, match=text):
                w0.collective(name, {"kind": "x"})
        assert not w0.engine._agreements  # nothing was asked of the scheduler
        key = ["k" * (MAX_AGREED_NAME_BYTES - 20) + "|float32|3", "float32", [3]]
        sums = [c.collective("sum", {"kind": "x"}, own=key, standin=True) for c in (w0, w1)]
        assert [h.wait(30).own for h in sums] == [{0: key, 1: key}] * 2
        rows = [c.collective("rows", {"kind": "x"}, own=c.rank + 5) for c in (w0, w1)]
        assert [h.wait(30).own for h in rows] == [{0: 5, 1: 6}] * 2
        w0.shutdown()
        w1.shutdown()


def test_a_barrier_goes_on_when_the_worker_it_waits_for_finishes_instead():
    import threading
    import time
    with roles(2, 1) as (config, _):
        w0, w1 = start_clients(config, 2)
        outcome = []

        def wait_at_barrier():
            started = time.monotonic()
            try:
                w0.barrier(timeout=30)
                outcome.append(time.monotonic() - started)
            except Exception as exc:  # the assertion below shows it
                outcome.append(exc)
        waiter = threading.Thread(target=wait_at_barrier)
        waiter.start()
        time.sleep(0.5)  # worker 0 is at the barrier before worker 1 finishes
        w1.shutdown()
        waiter.join(40)
        assert len(outcome) == 1 and isinstance(outcome[0], float) and outcome[0] < 10, outcome
        w0.shutdown()


def test_two_rounds_of_one_key_in_flight_are_answered_in_order():
    """A joined worker's stand-in answer may still be on its way when the worker pushes the
    same key's next round (horovod's test_horovod_join_allreduce met this under load): the
    engine keeps both, and each answer lands in its own round's output."""
    import types

    import zmq

    from adtopk_ps import wire
    from adtopk_ps.client.handle import Handle
    from adtopk_ps.client.customer import Part
    from adtopk_ps.client.engine import Engine
    from adtopk_ps.cluster.membership import ClusterConfig
    from adtopk_ps.compression import Dense
    from adtopk_ps.core.payload import Payload
    config = ClusterConfig.from_env({"DMLC_ROLE": "worker", "DMLC_NUM_WORKER": "2",
                                     "DMLC_NUM_SERVER": "1", "DMLC_PS_ROOT_URI": "127.0.0.1",
                                     "DMLC_PS_ROOT_PORT": "9"})
    ctx = zmq.Context()
    engine = Engine(config, ctx)  # its thread is never started: the test plays its part
    try:
        owner = types.SimpleNamespace(size=2, timeout=5.0)
        handles = [Handle(owner, f"round{r}", torch.zeros(3), 1, False) for r in range(2)]
        for r, h in enumerate(handles):
            engine.customer.sent(7, 0, 0, Part(h, h.out, r, Dense(), f"round{r}#0", False))
        for r in range(2):
            answer = Payload("dense", (3,), torch.float32, torch.full((3,), float(r + 1)))
            engine._on_answer(0, wire.encode(wire.Op.RESULT, key=7, round=r, payload=answer))
        assert [h.wait(1).tolist() for h in handles] == [[1.0] * 3, [2.0] * 3]
        assert engine.customer.inflight == {}
    finally:  # a context with open sockets would block whoever collects it
        engine.stop(0)
        engine._wake_in.close(0)
        ctx.term()


def test_tens_of_thousands_of_keys_to_one_server_in_one_burst():
    """Every key is one message; zmq's default high-water mark (1,000) made the server drop
    answers and the push_pull hang. 20,000 keys of 1 KiB from each of two workers, both in this
    process: at the default heartbeat timeout (10 s), not the tests' 2 s, which two engines
    sharing one interpreter on a loaded 2-core machine can miss while 40,000 keys go by."""
    with roles(2, 1, BYTEPS_PARTITION_BYTES="1024", PS_HEARTBEAT_TIMEOUT_MS="10000") as (config, _):
        workers = start_clients(config, 2)
        grads = [torch.randn(20000, 256, generator=torch.Generator().manual_seed(w))
                 for w in range(2)]
        handles = [c.push_pull(g, "burst", average=False) for c, g in zip(workers, grads)]
        assert len(workers[0]._layouts[("burst", torch.float32, (20000, 256))].keys) == 20000
        for handle in handles:
            assert torch.allclose(handle.wait(60), grads[0] + grads[1])
        for c in workers:
            c.shutdown()


@pytest.mark.parametrize("server_compressor, width",
                         [("", 150), ("topk", 100), ("topk:2x", 150), ("topk:0.001", 20)])
def test_the_ledger_counts_bytes_per_server_and_the_answers_width(server_compressor, width):
    """Two workers' top-k selections (100 of 20,000 each) overlap by half: the answer carries
    their union (150), or re-sparsified by the servers as wide as a push (100), no wider
    than twice a push (the union: nothing to cut) or at the density they were given (20);
    the dense push counts for bytes only, and the servers' shares add up."""
    out = bpslaunch("--local", "--num-workers", "2", "--num-servers", "2", "--",
                    sys.executable, str(PROGRAMS / "ledger_check.py"), timeout=120,
                    env={"BYTEPS_SERVER_COMPRESSOR": server_compressor})
    assert out.returncode == 0, out.stdout
    tallies = [json.loads(line.split("tally ", 1)[1]) for line in out.stdout.splitlines()
               if "tally " in line]
    assert len(tallies) == 2, out.stdout
    for t in tallies:
        assert t["answer_elements"] == width and t["answer_numel"] == 20000
        assert t["answer_density"] == width / 20000
        assert sum(t["pushed"].values()) == t["bytes_pushed"] > 3000 * 4
        assert sum(t["pulled"].values()) == t["bytes_pulled"] > 3000 * 4
        assert set(t["pushed"]) == set(t["pulled"]) <= {"0", "1"}
    # both workers' keys land on the same servers; the answers are the same bytes
    assert tallies[0]["pulled"] == tallies[1]["pulled"]


def test_a_checkpoints_server_residuals_are_checked_against_this_jobs_keys(client):
    """Servers that do not re-sparsify hold nothing back: a checkpoint takes nothing of
    theirs. What a checkpoint brings back must be the key its tensor's partition has here;
    and servers that hold nothing back refuse what is brought back, at the key's next push."""
    grad = torch.ones(64, 64)
    client.push_pull(grad, "w", average=False).wait(30)
    assert client.server_residuals(timeout=30) == []
    key = client._layouts[("w", torch.float32, (64, 64))].keys[0]
    entry = {"key": key, "name": "w", "dtype": "float32", "shape": [64, 64], "part": 0,
             "residual": torch.zeros(64, 64)}
    with pytest.raises(ValueError, match=r"residual of 'w' \(partition 1, key \d+\) fits no key of this job"):
        client.restore_server_residuals([{**entry, "part": 1}])
    with pytest.raises(ValueError, match=r"residual of 'w' \(partition 0, key \d+\) fits no key"):
        client.restore_server_residuals([{**entry, "shape": [64, 65]}])
    with pytest.raises(ValueError, match=r"residual of 'w' \(partition 0, key \d+\) fits no key"):
        client.restore_server_residuals([{**entry, "residual": torch.zeros(64, 63)}])
    for shape, complaint in [([1 << 40, 1], r"needs \d+ partitions"),  # not laid out first
                             ([1 << 62, 1], r"needs \d+ partitions")]:
        with pytest.raises(ValueError, match=f"names a tensor of shape .* cannot be laid out: .*{complaint}"):
            client.restore_server_residuals([{**entry, "shape": shape}])
    for bad in ({**entry, "dtype": "nn"}, {k: v for k, v in entry.items() if k != "residual"}, 7,
                {**entry, "residual": "zeros"}, {**entry, "part": True}):
        with pytest.raises(ValueError, match="a server residual entry must hold key, name, dtype|fits no key"):
            client.restore_server_residuals([bad])
    for residual, complaint in [(torch.zeros(64, 64, dtype=torch.float64), "got torch.float64 torch.strided"),
                                (torch.zeros(64, 64, device="meta"), "on meta"),
                                (torch.zeros(64, 64).to_sparse(), "torch.sparse_coo"),
                                (torch.full((64, 64), float("nan")), "holds a NaN or an infinity")]:
        with pytest.raises(ValueError, match=rf"residual of 'w' \(partition 0\) .*{complaint}"):
            client.restore_server_residuals([{**entry, "residual": residual}])
    refusal = r"worker 0 put back a residual the server cannot hold: .* does not re-sparsify its answers"
    with pytest.raises(PushPullError, match=rf"server 0 refused the residual put back for key \d+: {refusal}"):
        client.restore_server_residuals([entry])
    with pytest.raises(PushPullError, match=rf"server 0 refused key \d+ of 'w': {refusal}"):
        client.push_pull(grad, "w", average=False).wait(30)


def test_the_engine_batches_what_is_ready_for_a_server_within_its_limits(monkeypatch):
    """Messages for one server leave as batches of at most PS_BATCH_BYTES (one larger message
    alone) and at most wire.MAX_BATCH messages, in order, and nothing waits after a flush."""
    import zmq

    from adtopk_ps import wire
    from adtopk_ps.client.engine import Engine
    from adtopk_ps.cluster.membership import ClusterConfig
    monkeypatch.setenv("PS_BATCH_BYTES", "4096")
    config = ClusterConfig.from_env({"DMLC_ROLE": "worker", "DMLC_NUM_WORKER": "1",
                                     "DMLC_NUM_SERVER": "1", "DMLC_PS_ROOT_URI": "127.0.0.1",
                                     "DMLC_PS_ROOT_PORT": "9"})
    ctx = zmq.Context()
    engine = Engine(config, ctx)  # its thread is never started: the test drives the sends
    near, far = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    near.bind("inproc://batches")
    far.connect("inproc://batches")
    try:
        engine._sockets = [near]
        small = [wire.encode(wire.Op.FETCH, key=k, sender=0) for k in range(wire.MAX_BATCH + 10)]
        big = wire.encode(wire.Op.RESIDUAL, key=1, payload=create_dense(3000))
        for frames in small[:100] + [big] + small[100:]:
            engine._send_to(0, frames)
        engine._flush()
        assert engine._batches.waiting == {}
        keys, sizes = [], []
        while far.poll(100):
            frames = far.recv_multipart()
            msg = wire.decode(frames)
            parts = wire.unbatch(frames, msg) if msg.op == wire.Op.BATCH else [frames]
            assert len(parts) <= wire.MAX_BATCH
            sizes.append(sum(len(f) for p in parts for f in p))  # the messages', not the header's
            keys += [wire.decode(p).key for p in parts]
        assert keys == list(range(100)) + [1] + list(range(100, wire.MAX_BATCH + 10))
        big_size = sum(len(bytes(f)) for f in big)
        assert all(size <= 4096 or size == big_size for size in sizes) and big_size in sizes
    finally:
        near.close(0)
        far.close(0)
        engine.stop(0)
        engine._wake_in.close(0)
        ctx.term()


def create_dense(n):
    from adtopk_ps.compression import Dense
    return Dense().compress(torch.ones(n), "residual")


def test_a_renumbered_worker_speaks_as_the_rank_it_had(caplog):
    """Worker 2 hears that worker 1 was lost and becomes rank 1: its notice says so as worker
    2 (before, "worker 1: worker 1 (127.0.0.1) lost", as if it had lost itself)."""
    import logging

    import zmq

    from adtopk_ps.client.engine import Engine
    from adtopk_ps.cluster.membership import ClusterConfig
    config = ClusterConfig.from_env({"DMLC_ROLE": "worker", "DMLC_NUM_WORKER": "3",
                                     "DMLC_NUM_SERVER": "1", "DMLC_PS_ROOT_URI": "127.0.0.1",
                                     "DMLC_PS_ROOT_PORT": "9", "PS_MIN_WORKERS": "2"})
    ctx = zmq.Context()
    engine = Engine(config, ctx)  # its thread is never started: the test plays the scheduler
    try:
        engine.rank = 2
        with caplog.at_level(logging.WARNING, logger="adtopk_ps"):
            engine._reshape({"what": "worker 1 (127.0.0.1) lost", "rank": 1, "epoch": 1,
                             "num_workers": 2})
        assert engine.rank == 1
        (line,) = [r.getMessage() for r in caplog.records if "lost" in r.getMessage()]
        assert line.startswith("worker 2: worker 1 (127.0.0.1) lost; the job goes on with 2 "
                               "worker(s), this one now rank 1 (epoch 1)"), line
    finally:  # a context with open sockets would block whoever collects it
        engine.stop(0)
        engine._wake_in.close(0)
        ctx.term()
