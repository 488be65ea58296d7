"""horovod's elastic training over the parameter server: lose a worker and keep training,
take in a worker that joins.

In an elastic job (``PS_MIN_WORKERS``, ``PS_MAX_WORKERS``; ``bpslaunch --min-workers``) the
scheduler re-forms the job without a worker it lost, within a second or two, and with a
worker that registers into the running job (it goes last): the workers are renumbered,
the servers drop every round in progress, and every call a worker has in flight, or makes
next, raises :class:`HorovodInternalError` (the client's
:class:`~adtopk_ps.client.errors.MembershipChanged`; :class:`HostsUpdatedInterrupt` where
workers only joined). :func:`run` catches it, puts the
training state back to its last :meth:`~State.commit`, re-forms what synchronises gradients
(:meth:`~adtopk_ps.torch.gradient_sync.GradientSync.reset`: the workers agree their set-up
again), calls the state's reset callbacks, and has every worker take the newest commit any
of them holds (:meth:`~State.sync`), before it calls the training function again.

horovod's elastic PyTorch scripts run with the import changed::

    import adtopk_ps.torch as hvd

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            for state.batch, (x, y) in enumerate(loader):   # loader over an ElasticSampler
                ...
                optimizer.step()
                state.commit()

    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, epoch=0, batch=0)
    train(state)

A joiner runs the same script from the top: its optimizer's agreement meets the others'
re-form, and its first :meth:`~State.sync` hands it the newest commit (parameters, optimizer
state, step counter, samplers); its error-feedback residuals start at zero.

A commit is a copy in memory (model, optimizer with its error-feedback residuals and step
count, samplers, any other attributes). Below ``PS_MIN_WORKERS`` the workers wait for
others to join, up to ``PS_ELASTIC_TIMEOUT_S``; a lost server still ends the job, naming it.
"""
from __future__ import annotations

import abc
import contextlib
import copy
import functools
import math
import random
import time
from typing import Callable, Iterator, TypeVar

import torch

from adtopk_ps.client.errors import HostsUpdatedInterrupt, MembershipChanged
from adtopk_ps.torch.gradient_sync import abandon_all, reform_all
from adtopk_ps.torch.objects import allgather_object, broadcast_object
from adtopk_ps.torch.runtime import client, rank, resume_as_is, size
from adtopk_ps.torch.state_broadcast import broadcast_optimizer_state, broadcast_parameters

#: horovod's name for the error a re-form raises in every worker's next call
HorovodInternalError = MembershipChanged
__all__ = ["ElasticSampler", "HorovodInternalError", "HostsUpdatedInterrupt", "ObjectState", "State",
           "TorchState", "own_residuals", "resume", "run"]

T = TypeVar("T")


class State(abc.ABC):
    """What :func:`run` puts back after a re-form: subclasses save, restore and sync their parts.

    Example::

        state = hvd.elastic.TorchState(model=model, optimizer=optimizer, epoch=0)
        state.register_reset_callbacks([lambda: print("now", hvd.size(), "workers")])
    """

    def __init__(self) -> None:
        self._reset_callbacks: list[Callable[[], None]] = []
        self._commits = 0  # how many commits this worker has made: the newest wins a sync

    def register_reset_callbacks(self, callbacks: list[Callable[[], None]]) -> None:
        """Call each of ``callbacks`` after a re-form, before the state is synced (to rebuild
        what depends on the ranks: data loaders, learning-rate scales)."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """Run the reset callbacks (:func:`run` calls this)."""
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Save the state in memory, so that a re-form comes back to here; raises
        :class:`HorovodInternalError` if the job has re-formed since the last call (the
        save stands: nothing committed is lost)."""
        self.save()
        self._commits += 1
        client().check()

    def sync(self) -> None:
        """Every worker takes the newest commit any of them holds (ties: the lowest rank):
        after a re-form a worker that missed the last commit catches up, and none goes back."""
        commits = allgather_object(self._commits, "elastic.commits")
        root = commits.index(max(commits))
        self.sync_from(root)
        self.save()  # the synced state is the one to come back to (a sync cut short is not)
        self._commits = commits[root]

    @abc.abstractmethod
    def save(self) -> None:
        """Copy the state in memory (what :meth:`restore` goes back to)."""

    @abc.abstractmethod
    def restore(self) -> None:
        """Go back to the last :meth:`save`."""

    @abc.abstractmethod
    def sync_from(self, root: int) -> None:
        """Take worker ``root``'s saved state into the live one (every worker calls it alike);
        what was saved here stays until :meth:`sync` saves the result."""


class ObjectState(State):
    """Plain attributes (``epoch=0, batch=0``), saved, restored and synced as they are.

    Example::

        state = hvd.elastic.ObjectState(epoch=0, batch=0)
    """

    def __init__(self, **attributes: object) -> None:
        super().__init__()
        self._attributes = list(attributes)
        self.__dict__.update(attributes)
        self._saved = copy.deepcopy(attributes)

    def save(self) -> None:
        self._saved = self._copies()

    def _copies(self) -> dict:
        return {name: copy.deepcopy(getattr(self, name)) for name in self._attributes}

    def restore(self) -> None:
        self.__dict__.update(copy.deepcopy(self._saved))

    def sync_from(self, root: int) -> None:
        if self._attributes:
            self.__dict__.update(broadcast_object(self._saved, root, "elastic.attributes"))


class TorchState(ObjectState):
    """A model, its optimizer, any :class:`ElasticSampler` and other attributes (horovod's).

    The optimizer's error-feedback residuals stay each worker's own in a sync (they hold
    what that worker has not yet sent), while its step count follows the root's.

    Example::

        state = hvd.elastic.TorchState(model=model, optimizer=optimizer, sampler=sampler,
                                       epoch=0, batch=0)
    """

    def __init__(self, model: torch.nn.Module | None = None,
                 optimizer: torch.optim.Optimizer | None = None, **attributes: object) -> None:
        self.model, self.optimizer = model, optimizer
        self._samplers = {k: v for k, v in attributes.items() if isinstance(v, ElasticSampler)}
        super().__init__(**{k: v for k, v in attributes.items() if k not in self._samplers})
        self.__dict__.update(self._samplers)
        self._saved_model = self._saved_optimizer = None
        self._saved_samplers: dict[str, dict] = {}
        self.save()

    def save(self) -> None:
        # every part copied before any is kept: a part that raises (a model whose state_dict
        # waits for answers a re-form abandoned) leaves the last commit whole
        attributes = self._copies()
        model = copy.deepcopy(self.model.state_dict()) if self.model is not None else None
        optimizer = copy.deepcopy(self.optimizer.state_dict()) if self.optimizer is not None else None
        samplers = {k: s.state_dict() for k, s in self._samplers.items()}
        self._saved, self._saved_model, self._saved_optimizer = attributes, model, optimizer
        self._saved_samplers = samplers

    def restore(self) -> None:
        super().restore()
        if self.model is not None:
            self.model.load_state_dict(self._saved_model)
        if self.optimizer is not None:
            self.optimizer.load_state_dict(self._saved_optimizer)
        for name, sampler in self._samplers.items():
            sampler.load_state_dict(self._saved_samplers[name])

    def sync_from(self, root: int) -> None:
        super().sync_from(root)
        if self.model is not None:
            broadcast_parameters(self.model.state_dict(), root_rank=root, prefix="elastic.model")
        if self.optimizer is not None:
            with own_residuals(self.optimizer):
                broadcast_optimizer_state(self.optimizer, root_rank=root, prefix="elastic")
        if self._samplers:
            states = broadcast_object({k: s.state_dict() for k, s in self._samplers.items()},
                                      root, "elastic.samplers")
            for name, sampler in self._samplers.items():
                sampler.load_state_dict(states[name])


@contextlib.contextmanager
def own_residuals(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Whatever is loaded into ``optimizer`` inside (another worker's state, a checkpoint's),
    its error-feedback residuals stay this worker's own: they hold what this worker has not
    yet sent, and another's, added here too, would be sent twice. The step count is the
    loaded one.

    Example::

        with own_residuals(optimizer):
            optimizer.load_state_dict(saved)
    """
    sync = getattr(optimizer, "gradient_sync", None)
    own = sync.state_dict()["compression"] if sync is not None else None
    yield
    if sync is not None:
        sync.load_state_dict({"compression": own, "steps": sync.state_dict()["steps"]})


def run(func: Callable[..., T]) -> Callable[..., T]:
    """Make ``func(state, ...)`` elastic (horovod's ``hvd.elastic.run``): it is called after
    the workers take the newest commit, and called again after each re-form, from the state
    its last commit saved.

    Example::

        @hvd.elastic.run
        def train(state):
            ...
    """
    @functools.wraps(func)
    def wrapper(state: State, *args, **kwargs) -> T:
        while True:
            try:
                state.sync()
                return func(state, *args, **kwargs)
            except HorovodInternalError:
                abandon_all()  # before the restore, which must not read abandoned answers
                state.restore()
                reform_all()
                state.on_reset()
    return wrapper


def resume(num_workers: int, num_servers: int, global_rank: int | None = None,
           context: object = None, timeout: float | None = None) -> None:
    """byteps' ``resume`` after ``suspend()``, in the shape given: where the job is elastic and
    has another shape now, wait (up to ``timeout``, by default ``PS_ELASTIC_TIMEOUT_S``) until
    the scheduler has re-formed it to that many workers and servers, then take the new
    membership in (what synchronises gradients agrees again). Ranks are the scheduler's;
    ``context`` is byteps' and unused. Raises ``TimeoutError`` naming both shapes, and
    ``ValueError`` for a job that is not elastic.

    Example::

        bps.suspend()
        bps.resume(2, 2)   # after a worker of 3 was lost
    """
    c = client(paused_ok=True)
    limit = c.config.elastic_timeout if timeout is None else timeout
    deadline = time.monotonic() + limit
    while c.config.elastic and ((c.size, len(c.servers)) != (num_workers, num_servers) or
                                c.reforming):
        if c.engine.error is not None:
            raise c.engine.error
        if time.monotonic() > deadline:
            raise TimeoutError(f"resume({num_workers}, {num_servers}): the job still has "
                               f"{c.size} workers and {len(c.servers)} servers after {limit:.0f} s")
        time.sleep(0.02)
    resume_as_is(num_workers, num_servers, global_rank)
    if c.membership_change is not None:  # the membership changed while suspended: take it in
        abandon_all()
        reform_all()


class ElasticSampler(torch.utils.data.Sampler):
    """A sampler that splits what is left of an epoch among the workers there are now
    (horovod's): after a re-form, the samples of this epoch not yet processed are dealt out
    again to the new ranks, so none is lost or seen twice (a short last round is padded
    from the start, as ``DistributedSampler`` pads).

    Call :meth:`record_batch` after each batch and :meth:`set_epoch` at each epoch's start;
    keep it in the :class:`TorchState` so that a commit saves how far the epoch got.

    Example::

        sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=0)
        loader = torch.utils.data.DataLoader(dataset, batch_size=32, sampler=sampler)
        state = hvd.elastic.TorchState(model=model, optimizer=opt, sampler=sampler, epoch=0)
    """

    def __init__(self, dataset, shuffle: bool = True, seed: int = 0):
        self.dataset, self.shuffle, self.seed = dataset, shuffle, seed
        self.epoch = 0
        self.processed = 0  # samples of this epoch processed by all workers together
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch``: its own order, nothing processed yet."""
        self.epoch, self.processed = epoch, 0
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """A batch of ``batch_size`` went through on every worker."""
        self.processed += batch_size * self.num_replicas

    def state_dict(self) -> dict:
        """The epoch and how far it got."""
        return {"epoch": self.epoch, "processed": self.processed}

    def load_state_dict(self, state: dict) -> None:
        """Go back to ``state`` and deal out what is left among the workers there are now."""
        self.epoch, self.processed = state["epoch"], state["processed"]
        self.reset()

    def reset(self) -> None:
        """Deal out the epoch's unprocessed samples among the current ranks."""
        self.num_replicas, self.rank = size(), rank()
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        self.remaining = order[self.processed:]
        self.num_samples = math.ceil(len(self.remaining) / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self) -> Iterator[int]:
        indices = self.remaining + self.remaining[:self.total_size - len(self.remaining)]
        return iter(indices[self.rank:self.total_size:self.num_replicas])

    def __len__(self) -> int:
        return self.num_samples
