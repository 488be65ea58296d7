"""The dense part all-reduced among the workers, the sparse part through the servers.

Through the servers every dense byte goes up to a server and comes back,
and the servers spend CPU on each; a ring all-reduce moves about as many
bytes per worker and needs no server at all. Where sparsifying does not pay
(a fast link, small layers) that makes it the cheaper dense route. This lane
for the dense part, with the sparse part through the servers, is what the
paper (and ``ps-adtopk+hybrid`` in the benchmarks) calls hybrid
communication. The workers form a group of their own: NCCL
where every worker's gradients live on a GPU of its own, gloo otherwise (CPU
tensors, or workers sharing a GPU, which NCCL refuses); the parameter server
only tells them where worker 0's rendezvous store listens.

gloo and NCCL match collectives by the order they start in, so every worker
starts them in one fixed order (the order backward produces the tensors) whatever
order they become ready in: a tensor ready before its predecessors waits
for them.

A peer that dies closes its connections and gloo fails at once; one that
hangs, or whose host drops off the network, gloo or NCCL would wait out for
the whole timeout. So a wait also watches the parameter server's heartbeats,
which name such a peer within seconds.

A NaN or an infinity in any worker's tensor makes the sum non-finite, and
every worker gets the same sum: each reads its result once to see it, alike.
Which workers it came from each knows of itself (it reads its own tensor
before sending it); :meth:`DenseLane.find_flagging` tells the others, only
when a result was non-finite.
"""
from __future__ import annotations

import datetime
import socket
import threading
import time
import warnings
import weakref
from typing import Callable, Iterable, Union

import torch
import torch.distributed as dist

from adtopk_ps.client.ps_client import PSClient
from adtopk_ps.cluster.transport import ClusterError
from adtopk_ps.compression.select import all_finite
from adtopk_ps.core.timing import fastest, wait_for_device
from adtopk_ps.torch.objects import allgather_object
from adtopk_ps.torch.runtime import client

HEALTH_CHECK_S = 0.2  # how often a wait looks at the parameter server's view of the job
NCCL_POLL_S = 0.0002  # how often a wait asks whether NCCL's kernels have finished
# (ProcessGroupNCCL exists only in torch's CUDA builds: the annotation is a string)
Group = Union["dist.ProcessGroupGloo", "dist.ProcessGroupNCCL"]
# per client, a group per gpu_key: one process may all-reduce on the CPU and on a GPU
_groups: "weakref.WeakKeyDictionary[PSClient, dict[str | None, Group]]" = weakref.WeakKeyDictionary()


def gpu_key(devices: Iterable[torch.device]) -> str | None:
    """The GPU that all of ``devices`` are, by its UUID (unique across hosts, and the same for
    two processes that share one GPU); None where any is not a GPU, or they are several."""
    found = set(devices)
    if len(found) != 1 or next(iter(found)).type != "cuda":
        return None
    device = next(iter(found))
    uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    return str(uuid) if uuid is not None else f"{socket.gethostname()}/{device.index}"


def backend_for(gpus: list[str | None], nccl: bool) -> str:
    """``"nccl"`` where every worker reduces on a GPU of its own (``gpus``: each worker's
    :func:`gpu_key`) and this torch has NCCL; ``"gloo"`` otherwise: CPU tensors, mixed
    devices, or workers sharing a GPU, which NCCL refuses. A function of what the workers
    gathered alone, so that all choose alike."""
    return "nccl" if nccl and all(gpus) and len(set(gpus)) == len(gpus) else "gloo"


def worker_group(devices: Iterable[torch.device] = ()) -> Group:
    """This job's group of every worker, for tensors on ``devices`` (made once per client and
    device; every worker must call it): NCCL where every worker's are a GPU of its own, else
    gloo (:func:`backend_for`).

    Neither gloo nor NCCL authenticates or encrypts, so it is refused where the parameter
    server's own traffic is (``PS_CURVE_KEYS``).

    Example::

        group = worker_group(p.device for p in model.parameters())
    """
    c = client()
    mine = gpu_key(devices)
    groups = _groups.setdefault(c, {})
    if mine in groups:
        return groups[mine]
    if c.encrypted:
        raise ValueError("dense_transport='allreduce' would send gradients over gloo or NCCL, neither "
                         "of which authenticates or encrypts; with PS_CURVE_KEYS set use "
                         "dense_transport='ps'")
    timeout = datetime.timedelta(seconds=c.timeout)
    host = c.config.node_host
    store = dist.TCPStore(host, 0, c.size, True, timeout, wait_for_workers=False) \
        if c.rank == 0 else None
    found = allgather_object((mine, (host, store.port) if store else None), "allreduce.rendezvous")
    if store is None:
        store = dist.TCPStore(*found[0][1], c.size, False, timeout)
    gpus = [gpu for gpu, _ in found]
    if backend_for(gpus, dist.is_nccl_available()) == "nccl":
        options = dist.ProcessGroupNCCL.Options()  # as torch.distributed itself builds it
        options._timeout = timeout
        group = dist.ProcessGroupNCCL(store, c.rank, c.size, options)
    else:
        if any(gpus) and c.rank == 0:
            why = ("this torch has no NCCL" if not dist.is_nccl_available() else
                   "some workers' tensors are not on a GPU of their own" if not all(gpus) else
                   "some workers share a GPU, which NCCL refuses")
            warnings.warn(f"dense tensors are all-reduced over gloo, not NCCL: {why}", stacklevel=2)
        options = dist.ProcessGroupGloo._Options()  # what torch.distributed itself builds for gloo
        options._timeout = timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]  # the announced address
        group = dist.ProcessGroupGloo(store, c.rank, c.size, options)
    groups[mine] = group
    return group


def allreduce_s(group: Group, tensor: torch.Tensor, repeats: int) -> float:
    """The fastest of ``repeats`` all-reduces of ``tensor`` on ``group`` (every worker calls
    it alike), in seconds."""
    def once() -> None:
        group.allreduce([tensor]).wait()
        wait_for_device(tensor.device)  # (NCCL's wait returns once its kernels are queued)
    return fastest(once, repeats)


class Reduction:
    """A dense tensor's all-reduce: a :class:`~.pending.Pending` that answers the average."""

    def __init__(self, name: str, tensor: torch.Tensor, lane: "DenseLane"):
        self.name, self.lane = name, lane
        # gloo and NCCL reduce contiguous memory only; a strided gradient goes through a copy
        self.tensor = tensor if tensor.is_contiguous() else tensor.contiguous()
        self.work: dist.Work | None = None
        self._done = threading.Event()
        self._averaged = False  # a second wait must not divide again
        self.local_nonfinite = not all_finite(self.tensor)  # this worker's own part
        self.nonfinite = False  # the average: alike on every worker (set by wait)

    def launch(self, group: Group) -> None:
        """Start the all-reduce on ``group`` (in the order every worker starts them)."""
        self.work = group.allreduce([self.tensor])
        if group.name() != "nccl":  # (NCCL's future completes once its kernels are queued)
            self.work.get_future().add_done_callback(lambda _: self._done.set())

    def _finished(self, within: float) -> bool:
        """Whether the all-reduce has finished, waiting up to ``within`` seconds: gloo's
        future says so, NCCL's kernels are asked (a wait on the GPU would hang with a lost peer,
        unseen by the heartbeats)."""
        if self.lane.group.name() != "nccl":
            return self._done.wait(within)
        until = time.monotonic() + within
        while not self.work.is_completed():
            if time.monotonic() > until:
                return False
            time.sleep(NCCL_POLL_S)
        return True

    def wait(self, timeout: float | None = None) -> torch.Tensor:
        """The averaged tensor; raises, naming the worker, if a peer died or hung meanwhile."""
        if self.work is None:
            raise RuntimeError(f"the all-reduce of {self.name!r} has not started: a tensor before "
                               f"it in the order every worker starts them in is not ready yet")
        timeout = self.lane.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while not self._finished(HEALTH_CHECK_S):
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

    def flagging_ranks(self) -> list[int]:
        """The ranks whose own tensor held a NaN or an infinity (one more all-reduce)."""
        return self.lane.find_flagging([self.local_nonfinite])[0]


class DenseLane:
    """Starts all-reduces in ``order`` (names) on every worker, one round after another."""

    def __init__(self, group: Group, order: list[str], timeout: float,
                 check: Callable[[], None] = lambda: None, device: torch.device | str = "cpu"):
        """``check`` raises once the job cannot go on (the PS client's :meth:`check`);
        ``device``: where the group reduces (a GPU for NCCL), for the lane's own tensors."""
        self.group, self.timeout, self.check, self.size = group, timeout, check, group.size()
        self.device = torch.device(device)
        self._index = {name: i for i, name in enumerate(order)}
        self._waiting: dict[int, Reduction] = {}
        self._next = 0
        # what a ring all-reduce sends and receives per worker: 2 (W - 1) / W of the tensor
        # each way (gloo does not count its bytes; this is its algorithm's figure)
        self.bytes_moved = 0

    def find_flagging(self, local: list[bool]) -> list[list[int]]:
        """For tensors whose average came out non-finite (every worker lists the same ones, in
        one order, and calls this at the same point), the ranks whose own tensor held a NaN or
        an infinity, from ``local``: this worker's flags for them. None flagged: the sum itself
        overflowed."""
        table = torch.zeros(len(local), self.size)
        table[:, self.group.rank()] = torch.tensor(local, dtype=table.dtype)
        table = table.to(self.device)
        self.group.allreduce([table]).wait()
        return [[r for r in range(self.size) if row[r]] for row in table.tolist()]

    def start(self, name: str, tensor: torch.Tensor) -> Reduction:
        """Queue ``name``'s all-reduce; it starts once every tensor before it in the order has started."""
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
