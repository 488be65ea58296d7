"""The process-wide connection to the parameter server, and this worker's membership of the job.

:class:`Membership` is the one owner of who is in the job: it joins
(``init``), leaves (``shutdown``), and pauses and continues for byteps'
elastic entry points (``suspend``/``resume``). Today the job's shape is
fixed: ``resume`` continues with the same workers and servers and refuses
any other shape; a real membership change replaces :meth:`Membership.resume`'s
refusal (new address book, re-declared keys, re-ranked workers) without
touching the callers.
"""
from __future__ import annotations

import atexit
import dataclasses
import os
import sys
import threading
import warnings
from typing import Mapping

from adtopk_ps.client.ps_client import PSClient
from adtopk_ps.cluster.membership import ClusterConfig, describe_job
from adtopk_ps.core.env import env_int


class Membership:
    """This worker's place in the job: the client, and whether it is paused.

    ``shutdown()`` then ``init()`` in one process (horovod's re-initialisation) gives back
    the same connection, rank and size: leaving parks the connection (still heartbeating),
    and only the process's exit finishes it, so the job ends when the worker processes do.
    """

    def __init__(self) -> None:
        self._client: PSClient | None = None
        self._parked: PSClient | None = None  # left, kept until the process exits
        self._suspended = False
        self._lock = threading.Lock()

    @property
    def joined(self) -> bool:
        """Whether this process has joined the cluster."""
        return self._client is not None

    def join(self, config: ClusterConfig | None, job: Mapping[str, object] | None = None) -> None:
        """Connect to the cluster (once; later calls do nothing), described by ``job``."""
        with self._lock:
            if self._client is not None:
                return
            parked, self._parked = self._parked, None
            if parked is not None and (config is None or config == parked.config):
                parked.check()
                self._client = parked
                return
            if parked is not None:  # another cluster: the old connection is done
                parked.shutdown()
            config = config or ClusterConfig.from_env(role="worker")
            if job is not None:
                config = dataclasses.replace(config, job=describe_job(job))
            config.apply_verbosity()
            self._client = PSClient(config)
            self._suspended = False
            atexit.register(self.close)
            _note_uncaught_exceptions()

    def leave(self) -> None:
        """Stop using the connection: what is in flight finishes, later calls are refused
        until :meth:`join`, and the connection is finished when the process exits."""
        with self._lock:
            client, self._client, self._suspended = self._client, None, False
            if client is not None:
                self._parked = client
        if client is not None and client.engine.error is None:
            try:
                client.quiesce()
            except TimeoutError:
                pass

    def close(self) -> None:
        """Finish and close the connection (at the process's exit), saying so if the process
        ends on an uncaught exception: the job then fails on every role."""
        with self._lock:
            clients = [c for c in (self._client, self._parked) if c is not None]
            self._client = self._parked = None
            self._suspended = False
        failed, status = _uncaught[0] if _uncaught else (None, 1)
        for client in clients:
            client.shutdown(failed=failed, status=status)

    def client(self, paused_ok: bool = False) -> PSClient:
        """The connection; refused before ``init()`` and, unless ``paused_ok``, while suspended."""
        client = self._client
        if client is None:
            raise RuntimeError("adtopk_ps.torch.init() has not been called")
        if self._suspended and not paused_ok:
            raise RuntimeError("adtopk_ps.torch is suspended; call resume() first")
        return client

    def suspend(self) -> None:
        """Let every push_pull in flight finish (or fail: an elastic job may have re-formed,
        which :func:`adtopk_ps.torch.elastic.resume` takes in), then refuse new ones; the
        connection (and its heartbeats) stays up."""
        client = self.client()
        client.quiesce()
        if client.engine.error is not None:
            raise client.engine.error
        self._suspended = True

    def resume(self, num_workers: int, num_servers: int, global_rank: int | None = None) -> None:
        """Continue after :meth:`suspend` in the cluster shape given, which must be the job's
        now (:func:`adtopk_ps.torch.elastic.resume` waits for it in an elastic job).

        Ranks stay as the scheduler gave them: byteps' elastic benchmark passes
        the same ``global_rank`` on every worker, so a different one is named
        in a warning, not refused."""
        client = self.client(paused_ok=True)
        if not self._suspended:
            raise RuntimeError("resume() without suspend()")
        have = (client.size, len(client.servers))
        if (num_workers, num_servers) != have:
            raise ValueError(
                f"resume({num_workers}, {num_servers}): this job has {have[0]} workers and "
                f"{have[1]} servers, and it is not elastic: only an elastic job's membership "
                f"changes (PS_MIN_WORKERS, PS_MAX_WORKERS; bpslaunch --min-workers)")
        if global_rank not in (None, -1, client.rank):
            warnings.warn(f"resume(global_rank={global_rank}) on worker {client.rank}: ranks stay "
                          f"as the scheduler gave them", stacklevel=4)
        if client.engine.error is not None:
            raise client.engine.error
        self._suspended = False


_membership = Membership()
_uncaught: list[tuple[str, int]] = []  # the error the process ends on, and its exit status


def mark_failed(reason: str, status: int = 1) -> None:
    """Say that this process is ending on a failure it handled itself (it prints its error and
    exits non-zero), so that its finish fails the job on every role as an uncaught exception
    does: the scheduler and the servers then exit non-zero too, naming this worker, with
    ``status``, the worker's own exit status (2: a usage or configuration error).

    Example::

        except CheckpointError as exc:
            mark_failed(f"CheckpointError: {exc}")
            return 1
    """
    _uncaught.append((reason, status))


def _note_uncaught_exceptions() -> None:
    """Remember an exception that ends the process (``sys.excepthook`` runs before atexit), so
    that this worker's finish tells the job it failed."""
    previous = sys.excepthook
    if getattr(previous, "adtopk_notes", False):
        return

    def hook(kind, value, tb):
        _uncaught.append((f"{kind.__name__}: {value}", 1))
        previous(kind, value, tb)
    hook.adtopk_notes = True
    sys.excepthook = hook


def init(lazy: bool = True, config: ClusterConfig | None = None,
         job: Mapping[str, object] | None = None) -> None:
    """Join the cluster described by the DMLC environment (once per process).

    ``lazy`` is byteps' and changes nothing here: the connection is made now. ``job``: what
    every worker of the job must share (a config's values by name). A worker that joins a
    running elastic job with another is refused as it registers (``RegistrationRefused``,
    naming each difference), and the running workers never see it.

    Example::

        import adtopk_ps.torch as bps
        bps.init()                     # under bpslaunch, which sets the DMLC variables
        print(bps.rank(), bps.size())
    """
    _membership.join(config, job)


def shutdown() -> None:
    """Leave the cluster: later calls are refused until :func:`init`, which gives back the
    same rank and size. The job ends once every worker process has exited."""
    _membership.leave()


def close() -> None:
    """Finish this worker's part in the job now, as the process's exit would: the job ends
    once every worker has finished. (:func:`shutdown` keeps the connection for a later
    :func:`init`.)"""
    _membership.close()


def suspend() -> None:
    """byteps' elastic pause: waits for what is in flight; push_pulls are refused until
    :func:`adtopk_ps.torch.elastic.resume` (``bps.resume``)."""
    _membership.suspend()


def resume_as_is(num_workers: int, num_servers: int, global_rank: int | None = None) -> None:
    """End :func:`suspend` in the shape the job has now (see :meth:`Membership.resume`)."""
    _membership.resume(num_workers, num_servers, global_rank)


def is_initialized() -> bool:
    """Whether :func:`init` has run (and :func:`shutdown` has not)."""
    return _membership.joined


def client(paused_ok: bool = False) -> PSClient:
    """The connection to the parameter servers; while suspended only with ``paused_ok``."""
    return _membership.client(paused_ok)


def rank() -> int:
    """This worker's rank among all workers, as the scheduler assigned it."""
    return _membership.client(paused_ok=True).rank


def size() -> int:
    """The number of workers."""
    return _membership.client(paused_ok=True).size


def local_rank() -> int:
    """This worker's index on its host (``BYTEPS_LOCAL_RANK``, default 0)."""
    return env_int("BYTEPS_LOCAL_RANK", 0, minimum=0, environ=os.environ)


def local_size() -> int:
    """Worker processes on this host (``BYTEPS_LOCAL_SIZE``, default 1)."""
    return env_int("BYTEPS_LOCAL_SIZE", 1, minimum=1, environ=os.environ)
