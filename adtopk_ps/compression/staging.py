"""A device buffer, its pinned host mirror and a side stream, reused call after call.

The fused fibre kernel writes a whole payload (values, positions, flags) into
one device buffer; the bytes for the wire are copied from it into a pinned
host buffer on a side stream, so the copy runs beside the compute stream's
later work (the rest of the backward pass). Both buffers are kept and only
grow: allocating pinned memory per payload costs more than the copy itself.

What a call hands out (device and host views) stays valid until the next
call on the same :class:`Stage`. A :class:`StagePool` hands a batch of tensors
a stage that no payload on the wire still reads: the wire sends the pinned
bytes without copying them, so a stage is reused only once every payload in it
was answered, or its tensor staged again (which the engine does only after the
previous round of that tensor was answered). Consecutive batches so take
different stages: the next batch's kernels and copy queue while the previous
copy still runs.
"""
from __future__ import annotations

import threading

import torch

_ALIGN = 16


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up so that the next region starts aligned for any dtype."""
    return -(-nbytes // _ALIGN) * _ALIGN


class Stage:
    """One device buffer, its pinned host copy, and the table the kernel reads.

    Example::

        stage = Stage(torch.device("cuda"))
        out = stage.device_buffer(1 << 20)      # the kernel writes here
        ...                                     # launch on the current stream
        host = stage.to_host(1 << 20)           # async copy on the side stream
        stage.wait()                            # host bytes ready for the wire
    """

    def __init__(self, device: torch.device, cuda: "CudaCalls | None" = None):
        self.device = device
        self.cuda = device.type == "cuda"
        self._calls = cuda or (CudaCalls(device) if self.cuda else None)
        self._device = self._empty(0, torch.uint8)
        self._host = torch.empty(0, dtype=torch.uint8)
        self._table_host = torch.empty(0, dtype=torch.int64)
        self._table = self._empty(0, torch.int64)
        self._stream = self._calls.stream() if self.cuda else None
        self._copied = self._calls.event() if self.cuda else None
        self._uploaded = self._calls.event() if self.cuda else None
        self._pending = False

    def _empty(self, size: int, dtype: torch.dtype) -> torch.Tensor:
        return self._calls.empty(size, dtype) if self.cuda else torch.empty(size, dtype=dtype)

    def _pinned(self, size: int, dtype: torch.dtype) -> torch.Tensor:
        return self._calls.pinned(size, dtype) if self.cuda else torch.empty(size, dtype=dtype)

    def device_buffer(self, nbytes: int) -> torch.Tensor:
        """The first ``nbytes`` of the device buffer, free to overwrite on the current stream."""
        if self._pending:  # the previous copy still reads the buffer
            self._calls.current_stream().wait_event(self._copied)
        if self._device.numel() < nbytes:
            self._device = self._empty(_grown(nbytes), torch.uint8)
        return self._device[:nbytes]

    def table(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows`` (int64, on the host) on the device, uploaded through a reused pinned buffer.

        The pinned buffer is rewritten only once the previous upload from it has run (an
        event after each upload): rewritten while that copy still waits in the stream, it
        would hand the earlier launch this call's table."""
        if self.cuda:
            self._uploaded.synchronize()
        n = rows.numel()
        if self._table_host.numel() < n:
            size = _grown(n)
            self._table_host = self._pinned(size, torch.int64)
            self._table = self._empty(size, torch.int64)
        self._table_host[:n] = rows
        if not self.cuda:
            return self._table_host[:n]
        table = self._table[:n].copy_(self._table_host[:n], non_blocking=True)
        self._uploaded.record(self._calls.current_stream())
        return table

    def to_host(self, nbytes: int) -> torch.Tensor:
        """Start copying the first ``nbytes`` to the pinned host buffer, after everything the
        current stream has queued; :meth:`wait` before reading what this returns."""
        if self._host.numel() < nbytes:
            self._host = self._pinned(_grown(nbytes), torch.uint8)
        host = self._host[:nbytes]
        if not self.cuda:
            return host.copy_(self._device[:nbytes])
        self._stream.wait_stream(self._calls.current_stream())
        with self._calls.on(self._stream):
            host.copy_(self._device[:nbytes], non_blocking=True)
            self._copied.record(self._stream)
        self._pending = True
        return host

    def wait(self) -> None:
        """Block until the last :meth:`to_host` copy has landed."""
        if self._pending:
            self._copied.synchronize()
            self._pending = False


class StagePool:
    """Stages for batches of named tensors, each reused once nothing staged in it is in use.

    Example::

        pool = StagePool()
        stage = pool.take(torch.device("cuda"), ["fc.weight", "conv.weight"])
        ...                          # stage, send; the answers come back
        pool.release("fc.weight")    # its answer landed
        pool.release("conv.weight")  # now the stage is free for the next batch
    """

    def __init__(self, cuda: "CudaCalls | None" = None):
        self._cuda = cuda
        self._lock = threading.Lock()  # the engine's thread and a calibration may share a pool
        self._free: dict[torch.device, list[Stage]] = {}
        self._holder: dict[str, Stage] = {}  # the stage each staged name's payload lives in
        self._claims: dict[int, set[str]] = {}  # by id(stage): the names it still holds

    def take(self, device: torch.device, names: list[str]) -> Stage:
        """A stage for a batch of ``names`` on ``device``: these names' earlier payloads are
        released first (staging a name again means its previous round was answered)."""
        with self._lock:
            for name in names:
                self._release(name)
            free = self._free.setdefault(device, [])
            stage = free.pop() if free else Stage(device, self._cuda)
            self._claims[id(stage)] = set(names)
            for name in names:
                self._holder[name] = stage
            return stage

    def release(self, name: str) -> None:
        """``name``'s payload is no longer read (its answer landed): its stage is free once
        every name in it is."""
        with self._lock:
            self._release(name)

    def _release(self, name: str) -> None:
        stage = self._holder.pop(name, None)
        if stage is None:
            return
        claims = self._claims[id(stage)]
        claims.discard(name)
        if not claims:
            del self._claims[id(stage)]
            self._free.setdefault(stage.device, []).append(stage)

    def __getstate__(self) -> dict:
        """Nothing: buffers, streams and the lock belong to this process, and a compressor
        saved with its state (byteps' DDP hook) starts a copy with an empty pool."""
        return {}

    def __setstate__(self, state: dict) -> None:
        self.__init__()

    def __len__(self) -> int:
        """Stages made so far, free or held."""
        return len(self._claims) + sum(map(len, self._free.values()))


def _grown(nbytes: int) -> int:
    """A capacity with headroom, so that small changes (a density raised) keep the buffer."""
    return aligned(max(nbytes + nbytes // 4, 4096))


class CudaCalls:
    """The CUDA calls a :class:`Stage` makes, in one place: its tests pass an object with
    these methods that records the order of uploads, copies and waits on a CPU machine."""

    def __init__(self, device: torch.device):
        self.device = device

    def empty(self, size: int, dtype: torch.dtype) -> torch.Tensor:
        """A device tensor."""
        return torch.empty(size, dtype=dtype, device=self.device)

    def pinned(self, size: int, dtype: torch.dtype) -> torch.Tensor:
        """A host tensor in page-locked memory, which non-blocking copies need."""
        return torch.empty(size, dtype=dtype, pin_memory=True)

    def stream(self) -> "torch.cuda.Stream":
        """A side stream of the device."""
        return torch.cuda.Stream(self.device)

    def event(self) -> "torch.cuda.Event":
        """An event to record on a stream and wait for."""
        return torch.cuda.Event()

    def current_stream(self) -> "torch.cuda.Stream":
        """The stream the caller's kernels are queued on."""
        return torch.cuda.current_stream(self.device)

    def on(self, stream: "torch.cuda.Stream"):
        """A context in which work is queued on ``stream``."""
        return torch.cuda.stream(stream)
