"""The scheduler's coordinator as plain state: who gets which answer, and when."""
import pytest
from hypothesis import given
from hypothesis import strategies as st

from adtopk_ps import wire
from adtopk_ps.cluster import coordinator
from adtopk_ps.cluster.coordinator import (JOIN, MAX_AGREED_NAME_BYTES, MAX_NAME_BYTES,
                                           Coordinator, check_name)
from adtopk_ps.wire.messages import _MAX_HEADER_BYTES

SHAPE = {"kind": "allreduce", "dtype": "float32", "shape": [17, 17]}


def answers(out, op="agreed"):
    return {o.rank: o.fields for o in out if o.op == op}


def parts(fields):
    """Every worker's own part in an agreement, by rank (each distinct part travels once)."""
    return {int(r): fields["owns"][i] for r, i in fields["own"].items()}


def test_an_agreed_call_answers_every_worker_at_once_with_every_workers_own_part():
    c = Coordinator(3)
    assert c.request(0, 1, "allgather.x", SHAPE, own=4) == []
    assert c.request(2, 7, "allgather.x", SHAPE, own=1) == []
    got = answers(c.request(1, 3, "allgather.x", SHAPE, own=2))
    assert set(got) == {0, 1, 2} and all(a["ok"] for a in got.values())
    assert [got[r]["reqid"] for r in range(3)] == [1, 3, 7]
    assert parts(got[0]) == {0: 4, 1: 2, 2: 1} and got[0]["last"] == 1
    assert c.items == {} and c.agreed == 1


def test_a_difference_is_named_with_each_workers_side_and_sent_to_all():
    c = Coordinator(2)
    c.request(0, 1, "allreduce.x", SHAPE)
    got = answers(c.request(1, 1, "allreduce.x", {**SHAPE, "shape": [18, 17]}))
    assert {a["ok"] for a in got.values()} == {False}
    assert got[0]["message"] == got[1]["message"] == (
        "allreduce.x: the workers' calls differ (shape: worker 0 (17, 17), worker 1 (18, 17))")


def test_a_failed_side_is_refused_when_the_last_worker_asks_naming_the_reason():
    c = Coordinator(2)
    assert c.request(0, 1, "broadcast_object.o", {}, failed="TypeError: cannot pickle") == []
    got = answers(c.request(1, 5, "broadcast_object.o", {"kind": "broadcast_object"}))
    assert got[1]["message"] == "broadcast_object.o: worker 0: TypeError: cannot pickle"
    assert not got[0]["ok"]


def test_a_name_in_flight_twice_on_one_worker_is_refused_there_only():
    c = Coordinator(2)
    c.request(0, 1, "allgather.d", SHAPE)
    got = c.request(0, 2, "allgather.d", SHAPE)
    assert [(o.rank, o.fields["reqid"], o.fields["ok"]) for o in got] == [(0, 2, False)]
    assert answers(c.request(1, 1, "allgather.d", SHAPE))[0]["reqid"] == 1  # the first goes on


def test_after_a_skipped_call_the_workers_line_up_again_with_one_more_refusal():
    """Worker 1 skips x (an exception in its code): it waits in y while 0 and 2 wait in x.
    Both are refused; 0 and 2's next call, y, is refused at once (worker 1's y is spent), and
    from z on every call meets. The same holds for an extra call on one worker."""
    c = Coordinator(3)
    for rank, name in ((0, "x"), (2, "x"), (1, "y")):
        c.request(rank, 1, name, SHAPE)
        broke = c.block(rank, 1)
    assert {(o.rank, o.fields["name"]) for o in broke} == {(0, "x"), (2, "x"), (1, "y")}
    for rank in (0, 2):
        assert not answers(c.request(rank, 2, "y", SHAPE))[rank]["ok"]  # at once
    assert c.request(1, 2, "z", SHAPE) == [] and c.request(0, 3, "z", SHAPE) == []
    assert all(a["ok"] for a in answers(c.request(2, 3, "z", SHAPE)).values())
    assert c.tombstones == {} and c.items == {}
    # the next round of the loop: x meets again on every worker
    for rank in range(3):
        out = c.request(rank, 9, "x", SHAPE)
    assert all(a["ok"] for a in answers(out).values())


def test_threads_of_one_worker_get_the_grace_before_a_deadlock_is_declared():
    now = [0.0]
    c = Coordinator(2, grace=0.5, clock=lambda: now[0])
    c.request(0, 1, "a", SHAPE)
    c.request(1, 1, "b", SHAPE)
    assert c.block(0, 1) == [] and c.block(1, 1) == []
    now[0] = 0.3
    assert c.tick() == []  # within the grace
    got = answers(c.request(0, 2, "b", SHAPE))  # worker 0's other thread
    assert got[0]["ok"] and got[1]["ok"]
    now[0] = 0.9
    assert c.tick() == []  # worker 1 no longer waits
    got = answers(c.request(1, 2, "a", SHAPE))
    assert got[0]["ok"] and got[1]["ok"] and c.items == {}
    # and a real deadlock is refused once the grace has passed
    c.request(0, 3, "p", SHAPE)
    c.request(1, 3, "q", SHAPE)
    assert c.block(0, 3) == [] and c.block(1, 3) == []
    now[0] = 1.2
    assert c.tick() == []
    now[0] = 1.5
    assert len(c.tick()) == 2


def test_a_withdrawn_request_refuses_the_call_on_every_worker_that_asked():
    c = Coordinator(3)
    c.request(0, 1, "x", SHAPE)
    c.request(1, 4, "x", SHAPE)
    got = answers(c.withdraw(0, 1))
    assert set(got) == {0, 1} and "worker 0 stopped waiting" in got[1]["message"]
    assert c.withdraw(0, 1) == [] and c.items == {}


def test_pending_names_are_bounded_a_new_one_beyond_is_refused_to_its_asker(monkeypatch):
    monkeypatch.setattr(coordinator, "MAX_PENDING", 3)
    c = Coordinator(2)
    for i in range(3):
        assert c.request(0, i, f"n{i}", SHAPE) == []
    got = c.request(0, 9, "n9", SHAPE)
    assert [(o.rank, o.fields["ok"]) for o in got] == [(0, False)]
    assert "already waiting" in got[0].fields["message"] and len(c.items) == 3
    assert answers(c.request(1, 1, "n0", SHAPE))[1]["ok"]  # existing names still complete


def test_workers_blocked_in_calls_the_others_never_make_are_refused_not_left_waiting():
    c = Coordinator(3)
    c.request(0, 1, "allreduce.a", SHAPE)
    c.request(1, 1, "allreduce.b", SHAPE)
    c.request(2, 1, "allreduce.a", SHAPE)
    assert c.block(0, 1) == [] and c.block(2, 1) == []  # worker 1 may still call a
    got = answers(c.block(1, 1))
    assert set(got) == {0, 1, 2} and not any(a["ok"] for a in got.values())
    assert "worker(s) [1] have not called it" in got[0]["message"]
    assert "worker 1 waits in 'allreduce.b'" in got[0]["message"]
    assert c.items == {} and not any(c.blocked.values())


def test_a_stale_block_for_an_answered_request_is_ignored():
    c = Coordinator(2)
    c.request(0, 1, "x", SHAPE)
    c.request(1, 1, "x", SHAPE)
    assert c.block(0, 1) == [] and not any(c.blocked.values())
    c.request(0, 2, "y", SHAPE)
    c.block(0, 2)
    c.unblock(0, 2)  # an interrupted wait
    assert not any(c.blocked.values())


def test_a_finished_worker_fails_the_calls_it_did_not_make_but_releases_a_barrier():
    c = Coordinator(3)
    c.request(0, 1, "allreduce.x", SHAPE)
    c.request(0, 2, ".barrier", {"kind": "barrier"}, release=True)
    c.request(2, 1, ".barrier", {"kind": "barrier"}, release=True)
    got = c.finished(1)
    refused = [o for o in got if o.fields["name"] == "allreduce.x"]
    assert [o.rank for o in refused] == [0]
    assert "worker(s) [1] finished" in refused[0].fields["message"]
    # a call made after a worker finished cannot include it: refused at once, naming it
    late = answers(c.request(0, 3, "allgather.late", SHAPE))
    assert "worker(s) [1] finished" in late[0]["message"]
    assert {o.rank for o in got if o.fields["name"] == ".barrier" and o.fields["ok"]} == {0, 2}


def test_join_stands_in_with_zeros_for_sums_refuses_other_kinds_and_returns_the_last():
    c = Coordinator(3)
    assert c.request(0, 1, JOIN, {"kind": "join"}) == []
    push = ["allreduce.s|float32|3", "float32", [3]]
    c.request(1, 1, "allreduce.s", SHAPE, own=push, standin=True)
    got = c.request(2, 1, "allreduce.s", SHAPE, own=push, standin=True)
    assert answers(got)[1]["standins"] == [0] and answers(got, "standin")[0]["push"] == push
    refused = answers(c.request(1, 2, "allgather.g", SHAPE))
    assert "worker(s) [0] called join()" in refused[1]["message"]
    c.request(2, 2, JOIN, {"kind": "join"})
    done = answers(c.request(1, 3, JOIN, {"kind": "join"}))
    assert {r: a["last"] for r, a in done.items()} == {0: 1, 1: 1, 2: 1}


@given(st.lists(st.tuples(st.integers(0, 3), st.sampled_from("abc"), st.booleans(),
                          st.booleans()), max_size=40))
def test_every_request_is_answered_exactly_once_by_the_time_every_worker_finished(events):
    """Random requests (matching or not), blocks and finishes, in any order."""
    c = Coordinator(4)
    made, answered, reqid = set(), [], 0
    for rank, name, same, finish in events:
        if rank not in c.active:
            continue
        if finish:
            answered += [(o.rank, o.fields["reqid"]) for o in c.finished(rank)]
            continue
        reqid += 1
        made.add((rank, reqid))
        out = c.request(rank, reqid, name, {"v": name if same else rank}) + c.block(rank, reqid)
        answered += [(o.rank, o.fields["reqid"]) for o in out]
    for rank in sorted(c.active):
        answered += [(o.rank, o.fields["reqid"]) for o in c.finished(rank)]
    assert sorted(answered) == sorted(made) and c.items == {} and not any(c.blocked.values())


def test_a_name_is_checked_for_its_length_in_bytes_and_for_utf8():
    at_limit = "é" * (MAX_NAME_BYTES // 2)  # two bytes a character
    assert check_name(at_limit) == at_limit
    with pytest.raises(ValueError, match=f"of {MAX_NAME_BYTES + 2} bytes exceeds the limit of "
                                         f"{MAX_NAME_BYTES} bytes"):
        check_name(at_limit + "é")
    with pytest.raises(ValueError, match="of 30000 bytes exceeds the limit"):
        check_name("x" * 30000)
    with pytest.raises(ValueError, match=r"not valid UTF-8 \(lone surrogate '\\ud800' at position 3\)"):
        check_name("bad\ud800")
    for wrong in ("", None, 7):
        with pytest.raises(ValueError, match="must be a non-empty string"):
            check_name(wrong)


def test_a_name_over_the_limit_is_refused_to_its_asker_without_quoting_it_whole():
    c = Coordinator(2)
    got = c.request(0, 1, "x" * 30000, SHAPE)
    assert [(o.rank, o.fields["ok"]) for o in got] == [(0, False)]
    message = got[0].fields["message"]
    assert f"of 30000 bytes exceeds the limit of {MAX_AGREED_NAME_BYTES} bytes" in message
    assert len(message) < 300 and len(got[0].fields["name"]) < 100 and c.items == {}
    c.request(0, 2, "next", SHAPE)
    assert all(a["ok"] for a in answers(c.request(1, 1, "next", SHAPE)).values())


# the longest name a call is agreed under, four bytes a character; a rank's own starts with it
LONGEST = "allreduce." + "\U0001F600" * ((MAX_AGREED_NAME_BYTES - 14) // 4)


def _largest_header(workers):
    """The largest header the scheduler sends, over the answers that carry names (an agreed
    sum, with a joined worker standing in; a failure on every side, each reason quoting the
    name; every worker waiting in a call of its own), when ``workers`` workers call the
    longest names there are."""
    sizes = []

    def sent(out):
        for o in out:
            fields = dict(o.fields)
            op = wire.Op.AGREED if o.op == "agreed" else wire.Op.STANDIN
            sizes.append(len(wire.encode(op, round=fields.pop("reqid", 0), **fields)[0]))
        return out

    c = Coordinator(workers)
    sent(c.request(0, 1, JOIN, {"kind": "join"}))
    push = [f"{LONGEST}|float32|3", "float32", [3]]  # a sum's own part: its key's name
    for rank in range(1, workers):
        sent(c.request(rank, 1, LONGEST, SHAPE, own=push, standin=True))
    assert sizes and c.agreed == 1
    c = Coordinator(workers)
    for rank in range(workers):
        sent(c.request(rank, 1, LONGEST, {}, failed=f"ValueError: {LONGEST!r} is wrong here"))
    assert c.refused == 1
    c = Coordinator(workers)
    for rank in range(workers):
        c.request(rank, 1, f"allreduce.{rank:04d}{LONGEST[10:]}", SHAPE)
        broke = sent(c.block(rank, 1))
    assert len(broke) == workers
    return max(sizes)


def test_no_answer_grows_with_the_workers_times_the_names_length():
    """The scheduler's answer to a 30 KB name used to be four times its size (the name, and
    every worker's own part, which held it) and passed the wire's 64 KiB header limit: each
    distinct own part now travels once, and a refusal groups the workers by call and reason,
    naming a few. With names at the limit, 200 workers' answers are a few bytes a worker
    larger than 2 workers', and well under the header limit."""
    assert len(LONGEST.encode()) > MAX_AGREED_NAME_BYTES - 8
    few, many = _largest_header(2), _largest_header(200)
    assert many < _MAX_HEADER_BYTES // 2, many
    assert many - few < 16 * 200, (few, many)


def test_a_refusal_names_the_workers_by_the_call_they_wait_in():
    c = Coordinator(5)
    for rank, name in ((0, "a"), (1, "b"), (2, "a"), (3, "a"), (4, "a")):
        c.request(rank, 1, name, SHAPE)
        out = c.block(rank, 1)
    assert "(workers 0 and 2-4 wait in 'a', worker 1 waits in 'b')" in out[0].fields["message"]
    c = Coordinator(5)
    for rank in range(5):
        c.request(rank, 1, f"n{rank}", SHAPE)
        out = c.block(rank, 1)
    assert ("(worker 0 waits in 'n0', worker 1 waits in 'n1', worker 2 waits in 'n2', and 2 "
            "other calls)") in out[0].fields["message"]
    c = Coordinator(3)
    c.request(0, 1, "o", {}, failed="TypeError: cannot pickle")
    c.request(1, 1, "o", {}, failed="TypeError: cannot pickle")
    got = answers(c.request(2, 1, "o", {}, failed="ValueError: root 5"))
    assert got[2]["message"] == "o: workers 0 and 1: TypeError: cannot pickle; worker 2: ValueError: root 5"


def test_a_call_others_wait_in_while_one_waits_in_nothing_is_a_stall():
    """Worker 0 waits in a call worker 1 has not made, worker 1 waiting in nothing (a slow
    data loader): a stall, with its age. Once worker 1 waits elsewhere it is a deadlock,
    which the grace refuses, not a stall."""
    now = [100.0]
    c = Coordinator(2, grace=60.0, clock=lambda: now[0])
    c.request(0, 1, "allreduce.x", SHAPE)
    assert c.stalls() == []  # asked, not yet waiting
    c.block(0, 1)
    now[0] = 112.5
    assert c.stalls() == [("'allreduce.x'", [1], 12.5)]
    c.request(1, 1, "allreduce.y", SHAPE)
    c.block(1, 1)
    assert c.stalls() == []
