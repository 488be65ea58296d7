"""The dense part all-reduced among the workers, the sparse part through the servers.

Through the servers every dense byte goes up to a server and comes back,
and the servers spend CPU on each; a ring all-reduce moves about as many
bytes per worker and needs no server at all. Where sparsifying does not pay
(a fast link, small layers) that makes it the cheaper dense route: the
paper's hybrid communication. The workers form a gloo group of their own;
the parameter server only tells them where worker 0's rendezvous store
listens.

gloo matches collectives by the order they start in, so every worker starts
them in one fixed order (the order backward produces the tensors) whatever
order they become ready in: a tensor ready before its predecessors waits
for them.

A peer that dies closes its connections and gloo fails at once; one that
hangs, or whose host drops off the network, gloo would wait out for the
whole timeout. So a wait also watches the parameter server's heartbeats,
which name such a peer within seconds.

A NaN or an infinity in any worker's tensor makes the sum non-finite, and
every worker gets the same sum: each reads its result once to see it, alike.
Which workers it came from each knows of itself (it reads its own tensor
before sending it); :meth:`DenseLane.flagging_ranks` tells the others, only
when a result was non-finite.
"""
from __future__ import annotations

import datetime
import threading
import time
import weakref
from typing import Callable

import torch
import torch.distributed as dist

from ..client import PSClient
from ..compression.select import all_finite
from ..transport import ClusterError
from .objects import broadcast_object
from .runtime import client

TRANSPORTS = ("ps", "allreduce", "auto")
HEALTH_CHECK_S = 0.2  # how often a wait looks at the parameter server's view of the job
_groups: "weakref.WeakKeyDictionary[PSClient, dist.ProcessGroupGloo]" = weakref.WeakKeyDictionary()


def check_transport(transport: str) -> str:
    if transport not in TRANSPORTS:
        raise ValueError(f"dense_transport must be one of {list(TRANSPORTS)}, got {transport!r}")
    return transport


def worker_group() -> dist.ProcessGroupGloo:
    """This job's gloo group of every worker (made once per client; every worker must call it).

    gloo neither authenticates nor encrypts, so it is refused where the
    parameter server's own traffic is (``PS_CURVE_KEYS``).
    """
    c = client()
    group = _groups.get(c)
    if group is not None:
        return group
    if c.encrypted:
        raise ValueError("dense_transport='allreduce' would send gradients over gloo, which neither "
                         "authenticates nor encrypts; with PS_CURVE_KEYS set use dense_transport='ps'")
    timeout = datetime.timedelta(seconds=c.timeout)
    host = c.config.node_host
    store = dist.TCPStore(host, 0, c.size, True, timeout, wait_for_workers=False) \
        if c.rank == 0 else None
    root, port = broadcast_object((host, store.port) if store else None, 0, "allreduce.rendezvous")
    if store is None:
        store = dist.TCPStore(root, port, c.size, False, timeout)
    options = dist.ProcessGroupGloo._Options()  # what torch.distributed itself builds for gloo
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]  # the announced address
    group = _groups[c] = dist.ProcessGroupGloo(store, c.rank, c.size, options)
    return group


class Reduction:
    """A dense tensor's all-reduce: waits like a push_pull handle, answers the average."""

    def __init__(self, name: str, tensor: torch.Tensor, lane: "DenseLane"):
        self.name, self.lane = name, lane
        # gloo reduces contiguous memory only; a strided gradient goes through a copy
        self.tensor = tensor if tensor.is_contiguous() else tensor.contiguous()
        self.work: dist.Work | None = None
        self._done = threading.Event()
        self._averaged = False  # a second wait must not divide again
        self.local_nonfinite = not all_finite(self.tensor)  # this worker's own part
        self.nonfinite = False  # the average: alike on every worker (set by wait)

    def launch(self, group: dist.ProcessGroupGloo) -> None:
        self.work = group.allreduce([self.tensor])
        self.work.get_future().add_done_callback(lambda _: self._done.set())

    def wait(self, timeout: float | None = None) -> torch.Tensor:
        if self.work is None:
            raise RuntimeError(f"the all-reduce of {self.name!r} has not started: a tensor before "
                               f"it in the order every worker starts them in is not ready yet")
        timeout = self.lane.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while not self._done.wait(HEALTH_CHECK_S):
            self.lane.check()  # a peer the heartbeats lost
            if time.monotonic() > deadline:
                raise TimeoutError(f"dense all-reduce of {self.name!r} not done within {timeout:.1f} s")
        try:
            self.work.wait()
        except RuntimeError as exc:
            raise ClusterError(f"dense all-reduce of {self.name!r} failed: {exc}") from None
        if not self._averaged:
            self.tensor.div_(self.lane.size)
            self.nonfinite = not all_finite(self.tensor)
            self._averaged = True
        return self.tensor


class DenseLane:
    """Starts all-reduces in ``order`` (names) on every worker, one round after another."""

    def __init__(self, group: dist.ProcessGroupGloo, order: list[str], timeout: float,
                 check: Callable[[], None] = lambda: None):
        """``check`` raises once the job cannot go on (the PS client's :meth:`check`)."""
        self.group, self.timeout, self.check, self.size = group, timeout, check, group.size()
        self._index = {name: i for i, name in enumerate(order)}
        self._waiting: dict[int, Reduction] = {}
        self._next = 0
        # what a ring all-reduce sends and receives per worker: 2 (W - 1) / W of the tensor
        # each way (gloo does not count its bytes; this is its algorithm's figure)
        self.bytes_moved = 0

    def flagging_ranks(self, local: list[bool]) -> list[list[int]]:
        """For tensors whose average came out non-finite (every worker lists the same ones, in
        one order, and calls this at the same point), the ranks whose own tensor held a NaN or
        an infinity, from ``local``: this worker's flags for them. None flagged: the sum itself
        overflowed."""
        table = torch.zeros(len(local), self.size)
        table[:, self.group.rank()] = torch.tensor(local, dtype=table.dtype)
        self.group.allreduce([table]).wait()
        return [[r for r in range(self.size) if row[r]] for row in table.tolist()]

    def start(self, name: str, tensor: torch.Tensor) -> Reduction:
        index = self._index[name]
        if index < self._next or index in self._waiting:
            raise RuntimeError(f"{name!r} all-reduced twice in one round; with gradient "
                               f"accumulation set backward_passes_per_step")
        reduction = self._waiting[index] = Reduction(name, tensor, self)
        while self._next in self._waiting:
            ready = self._waiting.pop(self._next)
            ready.launch(self.group)
            self.bytes_moved += 4 * (self.size - 1) * ready.tensor.nbytes // self.size
            self._next += 1
        if self._next == len(self._index):
            self._next = 0
        return reduction
