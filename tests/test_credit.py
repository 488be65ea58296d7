"""Pushes ordered by need behind a credit window (adtopk_ps/client/credit.py): an urgent
push overtakes the held queue, the bytes a server has not acknowledged never pass the
window (but for one push alone), and nothing is lost, sent twice or left behind; and a
real cluster trains with it, the servers sending receipts."""
from __future__ import annotations

import re
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from adtopk_ps import wire
from adtopk_ps.client.credit import Outbox
from adtopk_ps.client.engine import credit_window
from adtopk_ps.core.env import EnvError
from adtopk_ps.core.payload import Payload
from procs import DIGITS_CNN, bpslaunch

actions = st.lists(st.one_of(
    st.tuples(st.just("post"), st.integers(0, 2), st.integers(0, 9), st.integers(1, 50)),
    st.tuples(st.just("receive"), st.integers(0, 2), st.integers(0, 60)),
    st.tuples(st.just("send_all"))), max_size=80)


@settings(max_examples=300, deadline=None)
@given(window=st.integers(1, 120), script=actions)
def test_the_window_holds_orders_and_loses_nothing(window, script):
    outbox, sent, unacked, posted = Outbox(window), [], {0: {}, 1: {}, 2: {}}, 0
    sizes = {}

    def send(server, frames):
        tag, size = frames
        sent.append((server, tag))
        unacked[server][tag] = size

    for action in script:
        if action[0] == "post":
            _, server, priority, size = action
            tag = (posted, 0)
            sizes[tag] = size
            before = len(sent)
            outbox.post(server, priority, [tag, size], tag, size, send)
            posted += 1
            for server_, tag_ in sent[before:]:
                # what left passed the window, unless it went alone into an empty one
                total = sum(unacked[server_].values())
                assert total <= window or len(unacked[server_]) == 1
        elif action[0] == "receive":
            _, server, index = action
            if unacked[server]:
                tag = sorted(unacked[server])[index % len(unacked[server])]
                del unacked[server][tag]
                before = len(sent)
                outbox.received(server, tag, send)
                outbox.received(server, tag, send)  # a second receipt changes nothing
                assert all(s == server for s, _ in sent[before:])
        else:
            outbox.send_all(send)
            assert outbox.held == 0
    # every push leaves once every receipt has come, and exactly once
    while any(unacked.values()):
        server = next(s for s in unacked if unacked[s])
        tag = next(iter(unacked[server]))
        del unacked[server][tag]
        outbox.received(server, tag, send)
    assert outbox.held == 0
    assert sorted(tag for _, tag in sent) == [(i, 0) for i in range(posted)]


def test_an_urgent_push_overtakes_the_held_ones():
    outbox, sent = Outbox(window=100), []
    send = lambda server, frames: sent.append(frames[0])  # noqa: E731
    for name, priority in [("late-1", 5), ("late-2", 6), ("late-3", 7)]:
        outbox.post(0, priority, [name], (priority, 0), 60, send)
    assert sent == ["late-1"]  # 60 + 60 > 100: the others wait
    outbox.post(0, 0, ["first-layer"], (0, 0), 30, send)
    assert sent == ["late-1", "first-layer"]  # it fits beside late-1, and goes before the rest
    outbox.received(0, (5, 0), send)
    assert sent == ["late-1", "first-layer", "late-2"]
    outbox.send_all(send)
    assert sent[-1] == "late-3" and outbox.held == 0


def test_a_new_window_sends_what_now_fits_and_none_sends_everything():
    outbox, sent = Outbox(window=100), []
    send = lambda server, frames: sent.append(frames[0])  # noqa: E731
    for priority in range(4):
        outbox.post(0, priority, [priority], (priority, 0), 60, send)
    assert sent == [0] and outbox.held == 3
    outbox.resize(130, send)  # 60 + 60 fits: one more leaves, without waiting for a receipt
    assert sent == [0, 1] and outbox.held == 2
    outbox.resize(0, send)  # no window: everything held leaves, in order
    assert sent == [0, 1, 2, 3] and outbox.held == 0
    outbox.post(0, 9, [9], (9, 0), 10 ** 6, send)
    assert sent[-1] == 9


def test_no_window_sends_at_once_and_a_cleared_outbox_forgets():
    sent = []
    Outbox(0).post(1, 9, ["x"], (1, 0), 10 ** 9, lambda s, f: sent.append((s, f[0])))
    assert sent == [(1, "x")]
    outbox = Outbox(10)
    outbox.post(0, 1, ["a"], (1, 0), 10, lambda s, f: None)
    outbox.post(0, 2, ["b"], (2, 0), 10, lambda s, f: None)
    outbox.clear()
    assert outbox.held == 0
    outbox.received(0, (1, 0), lambda s, f: pytest.fail("a cleared push was sent"))


def test_the_credit_is_counted_in_bytes_and_checked():
    assert credit_window({"PS_CREDIT_BYTES": "16384"}) == 16384
    assert credit_window({}) == 0
    with pytest.raises(EnvError, match="PS_CREDIT_BYTES"):
        credit_window({"PS_CREDIT_BYTES": "-1"})
    with pytest.raises(EnvError, match="PS_CREDIT_BYTES"):
        credit_window({"PS_CREDIT_BYTES": "many"})


def test_a_receipt_is_asked_only_on_a_push():
    payload = Payload("dense", (2,), torch.float32, torch.ones(2))
    assert wire.decode(wire.encode(wire.Op.PUSH, key=1, round=0, payload=payload,
                                   ack=True)).extra["ack"] is True
    with pytest.raises(wire.WireError, match="field 'ack' must be a bool on a push, got True on finish"):
        wire.decode(wire.encode(wire.Op.FINISH, ack=True))
    with pytest.raises(wire.WireError, match="field 'ack' must be a bool on a push, got 1 on push"):
        wire.decode(wire.encode(wire.Op.PUSH, key=1, round=0, payload=payload, ack=1))


def test_a_cluster_trains_with_a_window_of_one_partition_and_its_replicas_agree():
    # partitions of 4 KiB and a window of 4 KiB: almost every push waits for a receipt
    result = bpslaunch("--local", "--num-workers", "3", "--num-servers", "2", "--", sys.executable,
                       "-m", "worker", "--config", DIGITS_CNN, "--steps", "30", "--checksums",
                       "--set", "progress=false",
                       env={"PS_CREDIT_BYTES": "4096", "BYTEPS_PARTITION_BYTES": "4096"},
                       timeout=240)
    out = result.stdout
    assert result.returncode == 0, out
    assert len(set(re.findall(r"checksum step 30: (\w+)", out))) == 1 and \
        out.count("checksum step 30:") == 3, out
    assert re.search(r"summary: accuracy=0\.[6-9]", out), out
