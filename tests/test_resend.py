"""A worker's unanswered pushes are sent again after a reconnect (client/resend.py), and a
link that loses the same message again is named."""
import msgpack
import pytest

from adtopk_ps.client.resend import LinkDropsLargeMessages, Resender


def frames(key: int, rnd: int, size: int = 10) -> list:
    return [msgpack.packb({"op": "push", "key": key, "round": rnd}), b"x" * size]


def test_what_is_unanswered_is_sent_again_oldest_first_asking_for_a_receipt():
    r = Resender()
    for key in (3, 1, 2):
        r.sent(0, key, 0, frames(key, 0), 10)
    r.sent(1, 9, 0, frames(9, 0), 10)
    assert r.answered(0, 1, 0)
    again = r.reconnected(0, "worker 0", "server 0")
    assert [msgpack.unpackb(f[0]) for f in again] == [
        {"op": "push", "key": 3, "round": 0, "ack": True},
        {"op": "push", "key": 2, "round": 0, "ack": True}]
    assert [f[1] for f in again] == [b"x" * 10] * 2
    assert r.reconnected(1, "worker 0", "server 1")[0][1] == b"x" * 10  # each link its own


def test_a_second_answer_of_a_push_sent_again_is_dropped_once():
    r = Resender()
    r.sent(0, 7, 4, frames(7, 4), 10)
    r.reconnected(0, "worker 0", "server 0")
    assert r.answered(0, 7, 4)  # the first answer counts
    assert not r.answered(0, 7, 4)  # the server's second answer of it is dropped
    r.sent(0, 7, 5, frames(7, 5), 10)
    assert r.answered(0, 7, 5)  # a push never sent again: its answer counts


def test_a_message_lost_again_after_a_reconnect_names_the_link():
    r = Resender()
    r.sent(0, 1, 0, frames(1, 0, 10), 100)
    r.sent(0, 2, 0, frames(2, 0, 5000), 5000)
    r.reconnected(0, "worker 1", "server 0 (tcp://10.0.0.2:5)")
    r.received(0, 1, 0)  # the small one's receipt came: it crossed the link
    with pytest.raises(LinkDropsLargeMessages, match=r"worker 1 -> server 0 \(tcp://10.0.0.2:5\): "
                                                     r"messages are not delivered: .* \(1 message\(s\), "
                                                     r"the largest 5000 bytes\) was lost again"):
        r.reconnected(0, "worker 1", "server 0 (tcp://10.0.0.2:5)")


def test_reconnects_whose_messages_each_got_through_are_not_a_black_hole():
    r = Resender()
    for rnd in range(5):
        r.sent(0, 1, rnd, frames(1, rnd), 100)
        r.reconnected(0, "worker 0", "server 0")
        r.received(0, 1, rnd)  # delivered (the round waits for the other workers)
        assert r.answered(0, 1, rnd)
    assert r.resent_total == 5


def test_a_second_answer_is_dropped_even_after_another_reconnect():
    r = Resender()
    r.sent(0, 7, 4, frames(7, 4), 10)
    r.reconnected(0, "worker 0", "server 0")
    assert r.answered(0, 7, 4)
    r.received(0, 7, 4)
    r.reconnected(0, "worker 0", "server 0")  # the copy's answer is still on its way
    assert not r.answered(0, 7, 4)
    assert r.answered(0, 7, 5)  # the next round's answer counts


def test_a_link_that_flaps_faster_than_the_heartbeat_timeout_is_not_a_black_hole():
    """A black hole closes the connection only a heartbeat timeout after the lost message:
    two closes in quick succession, the receipts not back yet, are a flapping link."""
    r = Resender(heartbeat_timeout=60.0)
    r.sent(0, 1, 0, frames(1, 0, 5000), 5000)
    r.reconnected(0, "worker 1", "server 0")
    assert len(r.reconnected(0, "worker 1", "server 0")) == 1  # sent again once more
