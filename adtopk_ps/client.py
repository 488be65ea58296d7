"""The worker's side of the parameter server (ps-lite's KVWorker): the caller's API.

``push_pull`` returns at once with a handle; the engine thread (client_engine.py)
compresses, sends and collects the answers. ``declare`` gives a tensor its key
layout (cluster.py's ``KeyLayout``), which every worker must give in the same order.
"""
from __future__ import annotations

import threading
import time

import torch
import zmq

from .client_engine import Engine, PushPullError
from .cluster import ClusterConfig, KeyLayout
from .compression import Compressor, Dense
from .env import env_int
from .transport import ClusterError, security
from .wire import Op

__all__ = ["Handle", "PSClient", "PushPullError"]


class Handle:
    """The pending result of one ``push_pull``."""

    def __init__(self, client: "PSClient", name: str, out: torch.Tensor, parts: int, average: bool,
                 out_given: bool = False):
        self.name, self.out, self.out_given = name, out, out_given
        self.divisor = client.size if average else 1
        self._client = client
        self.parts = self._left = parts
        self._event = threading.Event()
        self._error: BaseException | None = None
        self.completed_at: float | None = None  # time.monotonic() when the answer was complete
        # ranks whose push of this tensor held a NaN or an infinity (the servers' answers say,
        # alike on every worker): the result is not to be trusted
        self.nonfinite: set[int] = set()

    def done(self) -> bool:
        """Whether the answer is complete (or the push failed); never blocks."""
        return self._event.is_set()

    def wait_done(self, timeout: float | None = None) -> bool:
        """Block until :meth:`done` or ``timeout`` passed: whether it is done. Unlike
        :meth:`wait`, neither a failure nor the timeout raises."""
        return self._event.wait(timeout)

    def wait(self, timeout: float | None = None) -> torch.Tensor:
        """The averaged (or summed) result; raises if the job failed or ``timeout`` passed."""
        timeout = self._client.timeout if timeout is None else timeout
        if not self._event.wait(timeout):
            raise TimeoutError(f"push_pull of {self.name!r} not answered within {timeout:.1f} s")
        if self._error is not None:
            raise self._error
        return self.out

    def part_done(self) -> None:
        """One partition's answer is in ``out`` (the engine calls this): the last completes
        the handle."""
        self._left -= 1
        if self._left == 0:
            self.completed_at = time.monotonic()
            self._event.set()

    def fail(self, error: BaseException) -> None:
        """Complete the handle with ``error``, which :meth:`wait` raises (the engine calls
        this); a handle already complete keeps its outcome."""
        if not self._event.is_set():
            self._error = error
            self._event.set()


class PSClient:
    """One worker's connection to the scheduler and every server."""

    def __init__(self, config: ClusterConfig | None = None, ctx: zmq.Context | None = None):
        self.config = config or ClusterConfig.from_env(role="worker")
        self.timeout = float(env_int("PS_PUSH_PULL_TIMEOUT_S", 600, minimum=1))
        self.ctx = ctx or zmq.Context.instance()
        # a bad PS_CURVE_KEYS fails here, naming the variable
        self.encrypted = security(self.ctx).keys is not None
        self.size = self.config.num_workers
        self._layouts: dict[str, KeyLayout] = {}
        self._ids: dict[str, int] = {}  # tensor ids by name, given at declaration or reservation
        self._steps: dict[str, int] = {}
        self._last: dict[str, Handle] = {}
        self._closed = False
        self._engine = Engine(self.config, self.ctx)
        try:
            self._engine.start()
        except BaseException:
            self._closed = True
            raise

    @property
    def rank(self) -> int:
        """This worker's rank, as the scheduler gave it."""
        return self._engine.rank

    @property
    def servers(self) -> list[str]:
        """The servers' addresses, by server rank."""
        return self._engine.servers

    @property
    def bytes_pushed(self) -> int:
        """Bytes of every push sent so far."""
        return self._engine.bytes_pushed

    @property
    def bytes_pulled(self) -> int:
        """Bytes of every answer received so far."""
        return self._engine.bytes_pulled

    @property
    def compress_seconds(self) -> float:
        """Seconds the engine has spent compressing."""
        return self._engine.compress_seconds

    def push_pull(self, tensor: torch.Tensor, name: str, compressor: Compressor | None = None,
                  average: bool = True, priority: int | None = None,
                  ratio: float | None = None, step: int | None = None,
                  out: torch.Tensor | None = None) -> Handle:
        """Start summing ``tensor`` across workers; do not modify it until the handle is done.

        ``out`` receives the result (default: a new tensor); it may be
        ``tensor`` itself, as a key's answer comes only after the server has
        every push of it, this worker's included. ``ratio`` overrides the
        compressor's density for this tensor (the partial-sparsification
        policy's per-layer choice); ``step`` is what the compressor sees
        (default: how often this name was pushed), which a resumed job sets
        so that seeds and schedules continue.

        Example::

            client = PSClient()                       # from the DMLC environment
            handle = client.push_pull(grad, "fc.weight", create("adtopk", ratio=0.01), out=grad)
            handle.wait()                             # grad now holds the average over workers
        """
        self.check()
        layout = self._declare(name, tensor)
        last = self._last.get(name)
        if last is not None and not last.done():
            raise ValueError(f"push_pull of {name!r} is still in flight; wait for it first")
        if step is None:
            step = self._steps.get(name, 0)
        self._steps[name] = step + 1
        given = out is not None
        if not given:
            out = torch.empty(layout.shape, dtype=layout.dtype, device=tensor.device)
        elif (out.shape, out.dtype, out.device) != (tensor.shape, tensor.dtype, tensor.device):
            raise ValueError(f"out for {name!r} is {out.dtype} {tuple(out.shape)} on {out.device}; "
                             f"the tensor is {tensor.dtype} {tuple(tensor.shape)} on {tensor.device}")
        handle = self._last[name] = Handle(self, name, out, len(layout.keys), average, given)
        self._engine.submit(-layout.id if priority is None else priority, handle, tensor.detach(),
                            layout, compressor or Dense(), step, ratio)
        return handle

    def barrier(self, timeout: float | None = None) -> None:
        """Wait until every worker has reached this barrier."""
        self.check()
        done = threading.Event()
        self._engine.command(Op.BARRIER, done)
        timeout = self.timeout if timeout is None else timeout
        if not done.wait(timeout):
            raise TimeoutError(f"barrier not reached by every worker within {timeout:.1f} s")
        self.check()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Tell the scheduler this worker is done and stop the engine."""
        if self._closed:
            return
        self._closed = True
        self._engine.stop(timeout)

    def check(self) -> None:
        """Raise what ended this worker's part in the job (a lost peer, a refused push), if any."""
        if self._engine.error is not None:
            raise self._engine.error
        if self._closed:
            raise ClusterError("the parameter-server client has been shut down")

    def reserve(self, name: str) -> int:
        """Give ``name`` its tensor id before its shape is known (byteps' ``declare(name)``);
        every worker must reserve and declare in the same order."""
        return self._ids.setdefault(name, len(self._ids))

    def quiesce(self, timeout: float | None = None) -> None:
        """Wait until every push_pull started so far has its answer (or has failed: its own
        handle reports that)."""
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        for name, handle in list(self._last.items()):
            if not handle.wait_done(max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"push_pull of {name!r} still in flight after {timeout:.1f} s")

    def declare(self, name: str, tensor: torch.Tensor) -> int:
        """Give ``name`` its tensor id now; every worker must declare in the same order.

        A tensor first pushed without a declaration is declared then, so
        workers whose first pushes come in different orders must declare
        up front (the torch integration declares every parameter at start).
        """
        return self._declare(name, tensor).id

    def _declare(self, name: str, tensor: torch.Tensor) -> KeyLayout:
        layout = self._layouts.get(name)
        shape = tuple(tensor.shape)
        if layout is None:
            layout = KeyLayout.of(self.reserve(name), tensor, self.config.partition_bytes)
            self._layouts[name] = layout
        elif layout.shape != shape or layout.dtype != tensor.dtype:
            raise ValueError(f"tensor {name!r} was declared as {layout.dtype} {layout.shape}, "
                             f"now pushed as {tensor.dtype} {shape}")
        return layout
