"""``DistributedDataParallel`` over the parameter servers, as ``byteps.torch.parallel`` has it.

The user keeps a plain optimizer: when ``loss.backward()`` returns, every
gradient is already the average over the workers, so ``optimizer.step()``
applies the same update everywhere. Gradients leave from autograd hooks as
backward produces them, through a :class:`~.gradient_sync.GradientSync` as
:func:`.DistributedOptimizer`'s (partial sparsification, fusion buckets, the cost
model, the overlap trial, the start-up agreement); the pass ends by waiting for the
answers, from a callback the autograd engine runs once the whole backward is
done, so parameters that got no gradient still push (zeros) as every worker
must.
"""
from __future__ import annotations

import contextlib

import torch

from adtopk_ps.torch.compressors import Compression
from adtopk_ps.torch.gradient_sync import for_wrapper
from adtopk_ps.torch.runtime import client
from adtopk_ps.torch.state_broadcast import broadcast_parameters


class DistributedDataParallel(torch.nn.Module):
    """Wraps ``module`` so that its gradients are averaged over every worker during backward.

    At construction the root's (rank 0's) parameters and buffers are
    copied to every worker. With ``broadcast_buffers`` the root's buffers
    (batch-norm statistics) are copied again at the start of every forward
    pass run with gradients enabled outside :meth:`no_sync` (as torch's DDP;
    byteps' also copies them under ``torch.no_grad()``, which would hang a
    worker that evaluates alone). ``compression`` takes every value
    :func:`.DistributedOptimizer` does (``Compression.adtopk(ratio=0.01)``).
    ``device_ids`` is byteps' and torch's: at most one device, the one the
    module is on (one process per device).

    Every worker must construct it, and run backward passes, in the same
    order. Parameters are taken as they are at construction.

    Example::

        model = DistributedDataParallel(model, compression=bps.Compression.adtopk(ratio=0.01))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for data, target in loader:
            optimizer.zero_grad()
            F.cross_entropy(model(data), target).backward()   # averaged when it returns
            optimizer.step()
    """

    def __init__(self, module: torch.nn.Module, device_ids: list | None = None,
                 broadcast_buffers: bool = True, compression: object = Compression.none):
        super().__init__()
        if device_ids is not None and len(device_ids) > 1:
            raise ValueError(f"DistributedDataParallel takes at most one device (one process per "
                             f"device), got device_ids={device_ids}")
        self.module = module
        self.device_ids = list(device_ids) if device_ids is not None else None
        self.broadcast_buffers = broadcast_buffers
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.gradient_sync = for_wrapper("ddp", named, compression)
        self._prefix = self.gradient_sync.key_prefix
        if not client().joined_epoch:  # a joiner's first elastic sync hands it the state
            broadcast_parameters(module.state_dict(), root_rank=0, prefix=f"{self._prefix}state")
        self._sync = True  # False inside no_sync()
        self._queued = False  # the end-of-backward callback is queued
        self._unsynced = False  # a backward pass has accumulated gradients not averaged yet
        # an elastic re-form aborts a backward pass before its queued callback runs
        self.gradient_sync.abandoned(self._forget_backward)
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_gradient) for _, p in named]

    def forward(self, *inputs, **kwargs):
        """The wrapped module's forward, after copying the root's buffers when ``broadcast_buffers`` asks for it."""
        if self.broadcast_buffers and self._sync and torch.is_grad_enabled():
            buffers = list(self.module.named_buffers())
            if buffers:
                broadcast_parameters(buffers, root_rank=0, prefix=f"{self._prefix}buffers")
        return self.module(*inputs, **kwargs)

    def _on_gradient(self, _p: torch.Tensor) -> None:
        self._unsynced = True
        if self._sync and not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _forget_backward(self) -> None:
        self._queued = self._unsynced = False

    def _end_of_backward(self) -> None:
        self._queued = False
        self.synchronize()

    def synchronize(self) -> None:
        """Average the gradients accumulated since the last averaging, now (every worker must
        call it alike). A backward pass outside :meth:`no_sync` does so before it returns, so
        byteps' ``loss.backward(); model.synchronize(); optimizer.step()`` finds nothing left
        to do."""
        if not self._sync:
            raise RuntimeError("synchronize() inside no_sync(); leave no_sync() first")
        if self._unsynced:
            self._unsynced = False
            self.gradient_sync.wait_all()  # pushing what the hooks have not
            self.gradient_sync.finish_step(lambda: None)  # the user's optimizer steps

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside only accumulate gradients locally; the first backward pass
        outside pushes the sum (as torch's and byteps' DDP).

        Example::

            with model.no_sync():
                for chunk in chunks[:-1]:
                    model(chunk).sum().backward()
            model(chunks[-1]).sum().backward()   # averages the sum of every chunk's gradients
        """
        if not self._sync:  # nested: the outer one restores
            yield
            return
        with self.gradient_sync.hooks_paused():  # they would push every pass
            self._sync = False
            try:
                yield
            finally:
                self._sync = True
