"""A live server under malformed and hostile messages keeps serving honest workers exactly."""
import threading

import msgpack
import torch
import zmq

from adtopk_ps import wire
from adtopk_ps.compression import create

from procs import clients as procs_clients
from procs import roles

ROUNDS = 12
SHAPES = [(64, 300), (200,), (16, 3, 5, 5)]


def _grad(shape, worker, rnd, i):
    gen = torch.Generator().manual_seed(worker * 1000 + rnd * 10 + i)
    return torch.randint(-8, 9, shape, generator=gen).float()


def _honest(client, results, progress):
    comp = create("adtopk", ratio=0.1)
    for rnd in range(ROUNDS):
        handles = [client.push_pull(_grad(s, client.rank, rnd, i), f"t{i}",
                                    comp if len(s) > 1 else None) for i, s in enumerate(SHAPES)]
        results[(client.rank, rnd)] = [h.wait(30) for h in handles]
        progress.set()


def _expected(rnd, i, shape):
    comp = create("adtopk", ratio=0.1) if len(shape) > 1 else create("none")
    total = sum(comp.decompress(comp.compress(_grad(shape, w, rnd, i), f"t{i}#0", rnd))
                for w in range(2))
    return total / 2


def _hostile_messages(honest_key):
    p = create("adtopk", ratio=0.1).compress(torch.randn(8, 40), "x", 0)
    push = [bytes(f) for f in wire.encode("push", key=999, round=0, sender=1, payload=p)]
    header = msgpack.unpackb(push[0])

    def with_header(**changes):
        return [msgpack.packb({**header, **changes}), *push[1:]]

    bad_index = bytearray(push[2])
    bad_index[0] = 200  # the axis is 40 long
    return {
        "garbage": ([b"\x00\xff\x13"], "not valid msgpack"),
        "protocol": (with_header(v=2), "protocol version 2"),
        "dtype": (with_header(vdtype="int64"), "vdtype 'int64' not allowed"),
        "index": ([push[0], push[1], bytes(bad_index)], "index out of range"),
        "truncated": ([push[0], push[1][:-3], push[2]], "values frame has"),
        "huge": (with_header(shape=[2**40, 8]), "exceeds the limit"),
        "negative": (with_header(count=-4), "count -4 outside"),
        "op": ([wire.encode("heartbeat")[0]], "not served here"),
        "rank": (with_header(sender=7), "sender 7 is not a worker rank"),
        "impersonation": (with_header(key=honest_key, sender=0), "bound to another connection"),
        "missing": (push[:2], "needs 2 buffer"),
    }


def test_server_answers_every_bad_message_and_honest_rounds_stay_exact():
    with roles(2, 1) as (config, procs):
        clients = procs_clients(config, 2)
        results, progress = {}, threading.Event()
        threads = [threading.Thread(target=_honest, args=(c, results, progress)) for c in clients]
        for t in threads:
            t.start()
        assert progress.wait(30), "no honest round completed"
        ctx = zmq.Context.instance()
        attacker = ctx.socket(zmq.DEALER)
        attacker.setsockopt(zmq.LINGER, 0)
        attacker.connect(clients[0].servers[0])
        replies = {}
        for case, (frames, words) in _hostile_messages(honest_key=0).items():
            attacker.send_multipart(frames)
            assert attacker.poll(5000), f"no reply to {case}"
            reply = wire.decode(attacker.recv_multipart())
            replies[case] = reply
            assert reply.op == "error" and words in reply.extra["message"], (case, reply.extra)
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
