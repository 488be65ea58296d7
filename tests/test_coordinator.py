"""The scheduler's coordinator as plain state: who gets which answer, and when."""
from hypothesis import given
from hypothesis import strategies as st

from adtopk_ps import coordinator
from adtopk_ps.coordinator import JOIN, Coordinator

SHAPE = {"kind": "allreduce", "dtype": "float32", "shape": [17, 17]}


def answers(out, op="agreed"):
    return {o.rank: o.fields for o in out if o.op == op}


def test_an_agreed_call_answers_every_worker_at_once_with_every_workers_own_part():
    c = Coordinator(3)
    assert c.request(0, 1, "allgather.x", SHAPE, own=4) == []
    assert c.request(2, 7, "allgather.x", SHAPE, own=1) == []
    got = answers(c.request(1, 3, "allgather.x", SHAPE, own=2))
    assert set(got) == {0, 1, 2} and all(a["ok"] for a in got.values())
    assert [got[r]["reqid"] for r in range(3)] == [1, 3, 7]
    assert got[0]["own"] == {"0": 4, "1": 2, "2": 1} and got[0]["last"] == 1
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
    assert c.items == {} and c.blocked == {}


def test_a_stale_block_for_an_answered_request_is_ignored():
    c = Coordinator(2)
    c.request(0, 1, "x", SHAPE)
    c.request(1, 1, "x", SHAPE)
    assert c.block(0, 1) == [] and c.blocked == {}
    c.request(0, 2, "y", SHAPE)
    c.block(0, 2)
    c.unblock(0, 2)
    assert c.blocked == {}


def test_a_finished_worker_fails_the_calls_it_did_not_make_but_releases_a_barrier():
    c = Coordinator(3)
    c.request(0, 1, "allreduce.x", SHAPE)
    c.request(0, 2, ".barrier", {"kind": "barrier"}, release=True)
    c.request(2, 1, ".barrier", {"kind": "barrier"}, release=True)
    got = c.finished(1)
    refused = [o for o in got if o.fields["name"] == "allreduce.x"]
    assert [o.rank for o in refused] == [0] and "worker 1 finished" in refused[0].fields["message"]
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
    assert sorted(answered) == sorted(made) and c.items == {} and c.blocked == {}
