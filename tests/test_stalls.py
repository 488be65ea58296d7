"""The server's stall watch as plain state: rounds grouped by the workers they wait for."""
from server.stalls import StallWatch


def test_stalls_are_told_once_grouped_by_missing_workers_then_past_the_abort_threshold():
    watch = StallWatch(warn_s=60, abort_s=300)
    missing = {1: [2], 2: [2], 3: [0, 2]}
    for key in missing:
        watch.start(key, now=0.0)
    watch.start(1, now=50.0)  # a later push of the same round keeps its start
    assert watch.check(59.0, missing.get) == ([], [])
    warn, abort = watch.check(61.0, missing.get)
    assert sorted((s.missing, sorted(s.keys)) for s in warn) == [((0, 2), [3]), ((2,), [1, 2])]
    assert abort == [] and watch.check(120.0, missing.get) == ([], [])  # told once
    watch.end(2)
    warn, abort = watch.check(301.0, missing.get)
    assert warn == [] and sorted(k for s in abort for k in s.keys) == [1, 3]


def test_abort_zero_never_ends_the_job_and_a_new_round_is_watched_afresh():
    watch = StallWatch(warn_s=1, abort_s=0)
    watch.start(7, now=0.0)
    assert len(watch.check(2.0, lambda key: [1])[0]) == 1
    assert watch.check(10_000.0, lambda key: [1]) == ([], [])
    watch.end(7)
    watch.start(7, now=20_000.0)
    assert len(watch.check(20_002.0, lambda key: [1])[0]) == 1
