"""A live server under malformed and hostile messages keeps serving honest workers exactly."""
import itertools
import threading

import msgpack
import pytest
import torch
import zmq
from hypothesis import strategies as st

from adtopk_ps import wire
from adtopk_ps.compression import create

from procs import clients as procs_clients
from procs import insider
from procs import roles

ROUNDS = 12
SHAPES = [(64, 300), (200,), (16, 3, 5, 5)]


def _grad(shape, worker, rnd, i):
    gen = torch.Generator().manual_seed(worker * 1000 + rnd * 10 + i)
    grad = torch.randint(-8, 9, shape, generator=gen).float()
    grad[(torch.arange(shape[0]) + worker + rnd) % 5 == 0] = 0  # dead units: pushes with row sets
    return grad


def _honest(client, results, progress, stop=None):
    """Rounds up to ``stop["at"]`` (ROUNDS without one): the test moves the end out while an
    attack runs, and both workers must stop at the same round, or one waits for the other."""
    comp = create("adtopk", ratio=0.1)
    stop = {"at": ROUNDS} if stop is None else stop
    for rnd in itertools.count():
        if rnd >= stop["at"]:
            return
        handles = [client.push_pull(_grad(s, client.rank, rnd, i), f"t{i}",
                                    comp if len(s) > 1 else None) for i, s in enumerate(SHAPES)]
        try:
            results[(client.rank, rnd)] = [h.wait(30) for h in handles]
        except Exception as exc:  # reported by the test, not lost in a thread
            results["failed"] = f"worker {client.rank} round {rnd}: {exc!r}"
            progress.set()
            return
        progress.set()


def _expected(rnd, i, shape):
    comp = create("adtopk", ratio=0.1) if len(shape) > 1 else create("none")
    total = sum(comp.decompress(comp.compress(_grad(shape, w, rnd, i), f"t{i}#0", rnd))
                for w in range(2))
    return total / 2


def _hostile_messages(honest_key):
    p = create("adtopk", ratio=0.1).compress(torch.randn(8, 40), "x", 0)
    push = [bytes(f) for f in wire.encode(wire.Op.PUSH, key=999, round=0, sender=1, payload=p)]
    header = msgpack.unpackb(push[0])

    def with_header(**changes):
        return [msgpack.packb({**header, **changes}), *push[1:]]

    bad_index = bytearray(push[2])
    bad_index[0] = 200  # the axis is 40 long
    dead = torch.randn(8, 40)
    dead[::2] = 0  # rows 1, 3, 5, 7 carried: a list of 4 rows against a 1-byte bitmap
    rows = [bytes(f) for f in wire.encode(wire.Op.PUSH, key=999, round=0, sender=1,
                                          payload=create("adtopk", ratio=0.1).compress(dead, "x", 0))]
    assert msgpack.unpackb(rows[0])["rowset"] == "bitmap"
    dense = create("none").compress(torch.randn(8, 40), "r")
    return {
        "row set": ([*rows[:3], bytes([0b10101011])], "row set bitmap names 5 rows, the metadata says 4"),
        "row count": ([msgpack.packb({**msgpack.unpackb(rows[0]), "rows": 8, "count": 32}), *rows[1:]],
                      "rows 8 outside [0, 8)"),
        "row frame": (rows[:3], "with a row set needs 3 buffer(s), got 2"),
        "garbage": ([b"\x00\xff\x13"], "not valid msgpack"),
        "protocol": (with_header(v=1), "protocol version 1 is not supported"),  # before seeded.py
        "dtype": (with_header(vdtype="int64"), "vdtype 'int64' not allowed"),
        "index": ([push[0], push[1], bytes(bad_index)], "index out of range"),
        "truncated": ([push[0], push[1][:-3], push[2]], "values frame has"),
        "huge": (with_header(shape=[2**40, 8]), "exceeds the limit"),
        "negative": (with_header(count=-4), "count -4 outside"),
        "op": ([wire.encode(wire.Op.HEARTBEAT)[0]], "not served here"),
        "rank": (with_header(sender=7), "sender 7 is not a worker rank"),
        "impersonation": (with_header(key=honest_key, sender=0), "bound to another connection"),
        # a finish fails every round its worker has not pushed: only that worker may send it
        "finish rank": (wire.encode(wire.Op.FINISH, sender=7), "sender 7 is not a worker rank"),
        "finish impersonation": (wire.encode(wire.Op.FINISH, sender=0), "bound to another connection"),
        "missing": (push[:2], "needs 2 buffer"),
        # a checkpoint's residuals, out and in: only the workers' own ranks, bound as pushes are
        "fetch rank": (wire.encode(wire.Op.FETCH, key=honest_key, sender=7), "sender 7 is not a worker rank"),
        "fetch data": (wire.encode(wire.Op.FETCH, key=honest_key, sender=7) + push[1:2],
                       "fetch carries no tensor"),
        "residual rank": (wire.encode(wire.Op.RESIDUAL, key=honest_key, sender=7, payload=dense),
                          "sender 7 is not a worker rank"),
        "residual impersonation": (wire.encode(wire.Op.RESIDUAL, key=honest_key, sender=0, payload=dense),
                                   "bound to another connection"),
        # a batch's own frame counts are checked; each message in it is served on its own
        "batch counts": ([msgpack.packb({**msgpack.unpackb(wire.batch([push])[0]), "counts": [5]}),
                          *push], "batch field 'counts'"),
        "batch nested": (wire.batch([wire.batch([push])]), "batches do not nest"),
        "batch impersonation": (wire.batch([with_header(key=honest_key, sender=0)]),
                                "bound to another connection"),
    }


def test_server_answers_every_bad_message_and_honest_rounds_stay_exact():
    with roles(2, 1) as (config, procs):
        clients = procs_clients(config, 2)
        results, progress = {}, threading.Event()
        threads = [threading.Thread(target=_honest, args=(c, results, progress)) for c in clients]
        for t in threads:
            t.start()
        assert progress.wait(30), "no honest round completed"
        attacker = insider(clients[0].servers[0])
        replies = {}
        for case, (frames, words) in _hostile_messages(honest_key=0).items():
            attacker.send_multipart(frames)
            assert attacker.poll(5000), f"no reply to {case}"
            reply = wire.decode(attacker.recv_multipart())
            replies[case] = reply
            assert reply.op == wire.Op.ERROR and words in reply.extra["message"], (case, reply.extra)
        attacker.close()
        for t in threads:
            t.join(60)
        assert len(results) == 2 * ROUNDS
        for (rank, rnd), outs in results.items():
            for i, (shape, got) in enumerate(zip(SHAPES, outs)):
                assert torch.equal(got, _expected(rnd, i, shape)), (rank, rnd, i)
        assert procs[1].poll() is None  # the server is still up
        for c in clients:
            c.shutdown()
        assert procs[1].wait(10) == 0
        assert "rejected" in procs[1].stderr.read()


def test_limits_refuse_what_exceeds_them_and_the_server_keeps_serving():
    """A message over PS_MAX_MESSAGE_BYTES, a key past PS_MAX_KEYS and a key whose buffers
    would pass PS_SERVER_MAX_BYTES each get an error naming the limit; nothing is allocated
    for them, and keys within the limits go on summing exactly."""
    from adtopk_ps.client.errors import PushPullError
    from adtopk_ps.client.ps_client import PSClient
    limits = {"PS_MAX_MESSAGE_BYTES": str(64 << 10), "PS_MAX_KEYS": "3",
              "PS_SERVER_MAX_BYTES": "100000", "BYTEPS_PARTITION_BYTES": str(1 << 20)}
    with roles(1, 1, **limits) as (config, procs):
        client = PSClient(config)
        ok = torch.arange(100.0)
        assert torch.equal(client.push_pull(ok, "small").wait(10), ok)
        with pytest.raises(PushPullError, match=r"message of \d+ bytes exceeds the limit of 65536"):
            client.push_pull(torch.ones(20000), "too-long").wait(10)  # 80 KB in one key
        with pytest.raises(PushPullError, match="needs 128000 bytes; the server holds 800 of its "
                                                "100000 byte limit"):
            client.push_pull(torch.ones(16000), "too-big").wait(10)  # 64 KB, in two buffers
        assert torch.equal(client.push_pull(ok * 2, "second").wait(10), ok * 2)
        assert torch.equal(client.push_pull(ok * 3, "third").wait(10), ok * 3)
        with pytest.raises(PushPullError, match="limit of 3 keys"):
            client.push_pull(ok, "fourth").wait(10)
        assert torch.equal(client.push_pull(ok * 4, "small").wait(10), ok * 4)
        assert procs[1].poll() is None
        client.shutdown()


_FIELDS = ["v", "op", "key", "round", "sender", "codec", "shape", "dtype", "vdtype", "idtype",
           "count", "view", "k", "seed", "rows", "rowset"]
_VALUES = st.one_of(st.integers(-2**63, 2**64 - 1), st.integers(-3, 70), st.text(max_size=8), st.none(),
                    st.lists(st.integers(-5, 2**40), max_size=5), st.binary(max_size=8),
                    st.floats(allow_nan=True), st.booleans())
MUTATIONS = st.one_of(
    st.tuples(st.just("field"), st.sampled_from(_FIELDS), _VALUES),
    st.tuples(st.just("drop-field"), st.sampled_from(_FIELDS)),
    st.tuples(st.just("truncate"), st.integers(0, 3), st.integers(0, 400)),
    st.tuples(st.just("drop-frame"), st.integers(0, 3)),
    st.tuples(st.just("extra-frame"), st.binary(max_size=64)),
    st.tuples(st.just("flip"), st.integers(0, 3), st.integers(0, 10**6), st.integers(1, 255)),
)


def _mutate(frames, mutation):
    frames = [bytearray(f) for f in frames]
    kind, *args = mutation
    if kind in ("field", "drop-field"):
        header = msgpack.unpackb(bytes(frames[0]))
        if kind == "field":
            header[args[0]] = args[1]
        else:
            header.pop(args[0], None)
        frames[0] = bytearray(msgpack.packb(header))
    elif kind == "truncate" and args[0] < len(frames):
        frames[args[0]] = frames[args[0]][:args[1]]
    elif kind == "drop-frame" and len(frames) > 1:
        del frames[args[0] % len(frames)]
    elif kind == "extra-frame":
        frames.append(bytearray(args[0]))
    elif kind == "flip" and args[0] < len(frames) and frames[args[0]]:
        frames[args[0]][args[1] % len(frames[args[0]])] ^= args[2]
    return [bytes(f) for f in frames]


def test_structured_mutations_get_error_replies_and_honest_rounds_stay_exact():
    """Hypothesis mutates valid pushes of every codec (header fields replaced by values of
    any type or removed, frames truncated, dropped, added, bytes flipped) and sends them to
    a live server while two honest workers run their rounds. Every message is answered
    with an error; the honest sums stay exact and the server stays up."""
    from hypothesis import HealthCheck, given, settings
    bases = [wire.encode(wire.Op.PUSH, key=999, round=0, sender=1,
                         payload=create(name, ratio=0.2).compress(torch.randn(8, 40), "x", 0))
             for name in ("adtopk", "topk", "randomk")]
    bases.append(wire.encode(wire.Op.PUSH, key=998, round=0, sender=1,
                             payload=create("none").compress(torch.randn(30), "x", 0)))
    dead = torch.randn(8, 40)
    dead[[0, 3, 4]] = 0  # a fibre payload with a row set (a third frame)
    bases.append(wire.encode(wire.Op.PUSH, key=997, round=0, sender=1,
                             payload=create("adtopk", ratio=0.2).compress(dead, "x", 0)))
    with roles(2, 1) as (config, procs):
        clients = procs_clients(config, 2)
        results, progress = {}, threading.Event()
        stop = {"at": 1 << 30}
        threads = [threading.Thread(target=_honest, args=(c, results, progress, stop)) for c in clients]
        for t in threads:
            t.start()
        assert progress.wait(30), "no honest round completed"  # both ranks are bound now
        attacker = insider(clients[0].servers[0])
        kinds = set()

        @settings(max_examples=150, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(st.sampled_from(range(len(bases))), MUTATIONS)
        def attack(base, mutation):
            attacker.send_multipart(_mutate([bytes(f) for f in bases[base]], mutation))
            assert attacker.poll(15000), f"no reply to {mutation!r}"
            reply = wire.decode(attacker.recv_multipart())
            assert reply.op == wire.Op.ERROR and reply.extra["message"], mutation
            kinds.add(mutation[0])

        attack()
        attacker.close()
        during = len(results)
        stop["at"] = max(k[1] for k in list(results) if k != "failed") + 2  # BSP: a round apart at most
        for t in threads:
            t.join(60)
        assert "failed" not in results, results["failed"]
        assert len(kinds) == 6
        assert during > 2 * ROUNDS  # honest rounds went on while the attack ran
        assert len(results) % 2 == 0 and all((1 - r, n) in results for r, n in results)
        for (rank, rnd), outs in results.items():
            for i, (shape, got) in enumerate(zip(SHAPES, outs)):
                assert torch.equal(got, _expected(rnd, i, shape)), (rank, rnd, i)
        assert procs[1].poll() is None
        for c in clients:
            c.shutdown()
