"""The pinned staging's order of uploads, copies and waits, on a CPU machine: CudaCalls
replaced by fakes that model a stream's queue (a recorded event is pending until it is
synchronized or waited for), so that a rewrite of memory a queued copy still reads fails."""
from __future__ import annotations

import torch

from adtopk_ps.compression.staging import Stage, StagePool


class Event:
    def __init__(self, log: list, name: str):
        self.log, self.name, self.queued = log, name, False

    def record(self, stream=None) -> None:
        self.log.append(f"record {self.name}")
        self.queued = True

    def synchronize(self) -> None:
        self.log.append(f"sync {self.name}")
        self.queued = False


class Stream:
    def __init__(self, log: list):
        self.log = log

    def wait_event(self, event: Event) -> None:
        self.log.append(f"wait {event.name}")

    def wait_stream(self, other) -> None:
        self.log.append("side waits")


class Calls:
    """CudaCalls on the CPU; the stage's pinned table is checked at each upload."""

    def __init__(self):
        self.log: list[str] = []
        self.events = iter(["copied", "uploaded"])

    def empty(self, size, dtype):
        return torch.empty(size, dtype=dtype)

    def pinned(self, size, dtype):
        return torch.empty(size, dtype=dtype)

    def stream(self):
        return Stream(self.log)

    def event(self):
        return Event(self.log, next(self.events))

    def current_stream(self):
        return Stream(self.log)

    def on(self, stream):
        import contextlib
        return contextlib.nullcontext()


def _stage() -> tuple[Stage, Calls]:
    calls = Calls()
    return Stage(torch.device("cuda"), cuda=calls), calls


def test_the_pinned_table_is_rewritten_only_after_its_upload_ran():
    stage, calls = _stage()
    for rows in ([1, 2, 3], [4, 5], list(range(100))):  # the last one grows the buffers
        assert stage._uploaded.queued is False or calls.log[-1] == "record uploaded"
        table = stage.table(torch.tensor(rows))
        assert table.tolist() == rows
        assert stage._uploaded.queued  # this upload is in the stream
    uploads = [e for e in calls.log if e.endswith("uploaded")]
    # each upload is synchronized before the next rewrite: sync, record, sync, record, ...
    assert uploads == ["sync uploaded", "record uploaded"] * 3


def test_the_device_buffer_is_reused_only_after_the_copy_that_reads_it():
    stage, calls = _stage()
    stage.device_buffer(64)[:] = 7
    host = stage.to_host(64)
    assert calls.log[-2:] == ["side waits", "record copied"]
    stage.device_buffer(64)  # the copy may still be queued: the compute stream waits for it
    assert calls.log[-1] == "wait copied"
    stage.wait()
    assert calls.log[-1] == "sync copied" and host.tolist() == [7] * 64
    calls.log.clear()
    stage.device_buffer(64)  # nothing queued any more: no wait
    assert calls.log == []


def test_a_pool_reuses_a_stage_only_once_nothing_in_it_is_read():
    pool = StagePool(cuda=FreshCalls())
    first = pool.take(torch.device("cuda"), ["a", "b"])
    second = pool.take(torch.device("cuda"), ["c"])  # the next batch, while a and b are on the wire
    assert second is not first
    pool.release("a")
    assert pool.take(torch.device("cuda"), ["d"]) is not first  # b still reads the first
    pool.release("b")
    assert pool.take(torch.device("cuda"), ["e"]) is first and len(pool) == 3


def test_staging_a_name_again_frees_its_earlier_payload():
    # callers that never restore (a DDP hook, a probe) compress a name again only after its
    # previous round: that releases the stage, so the pool does not grow step after step
    pool = StagePool(cuda=FreshCalls())
    stages = [pool.take(torch.device("cuda"), ["w", "b"]) for _ in range(5)]
    assert all(s is stages[0] for s in stages) and len(pool) == 1
    pool.release("never staged")  # an answer for a payload not staged here: nothing to free
    assert len(pool) == 1


class FreshCalls(Calls):
    """Calls for a pool: every stage it makes takes two new events."""

    def event(self):
        return Event(self.log, f"event{len(self.log)}")


def test_a_pool_pickles_empty():
    # a compressor saved with byteps' DDP hook state carries its pool: the copy starts empty
    import pickle
    pool = StagePool(cuda=FreshCalls())
    pool.take(torch.device("cuda"), ["a"])
    copy = pickle.loads(pickle.dumps(pool))
    assert len(copy) == 0 and len(pool) == 1
    assert copy.take(torch.device("cpu"), ["a"]).device == torch.device("cpu")
