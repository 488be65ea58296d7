"""Crossing the step barrier (byteps' ``cross_barrier``): each layer waits only for its own update.

With :func:`.DistributedOptimizer`, ``step()`` waits for every averaged
gradient before updating any parameter, and the next forward pass starts
after that. Here ``step()`` waits for nothing: gradients leave during
backward (always with overlap), ``step()`` pushes what is left and returns,
and a forward pre-hook on every module that owns parameters waits for those
parameters' answers and applies their updates just before the module runs.
So communication overlaps the backward pass and also the next forward pass
up to the layer that needs it. Updates run one parameter at a time through
the user's own optimizer (its per-parameter state kept), with the
hyper-parameters its groups had at ``step()`` (a scheduler stepped after
``step()`` changes the next update, as without crossing the barrier).

Gradients travel through a :class:`~.gradient_sync.GradientSync`, as the optimizer's do.
This module also offers the rest of :mod:`adtopk_ps.torch` under the same
names, as byteps' does: ``import adtopk_ps.torch.cross_barrier as bps``.
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch

from adtopk_ps.torch import *  # noqa: F401,F403 - byteps' cross_barrier offers the whole API too
from adtopk_ps.torch import __all__ as _api
from adtopk_ps.torch.compressors import Compression
from adtopk_ps.torch.gradient_sync import for_wrapper

# updated one parameter at a time: optimizers whose step treats each parameter on its own
SUPPORTED = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.RMSprop)

__all__ = [*_api, "CrossBarrier", "SUPPORTED"]


_SHARED = ("param_groups", "state", "defaults")


def _through(attribute: str) -> property:
    """The wrapped optimizer's own attribute (load_state_dict rebinds them there)."""
    return property(lambda self: getattr(self._opt, attribute),
                    lambda self, value: setattr(self._opt, attribute, value))


class _CrossBarrier(torch.optim.Optimizer):
    """The wrapped optimizer, its groups and state read through (see :func:`CrossBarrier`)."""

    param_groups, state, defaults = (_through(a) for a in _SHARED)

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 named_parameters, compression, backward_passes_per_step: int, num_steps: int):
        if type(optimizer) not in SUPPORTED:
            raise TypeError(f"CrossBarrier updates one parameter at a time and supports "
                            f"{', '.join(c.__name__ for c in SUPPORTED)}; got "
                            f"{type(optimizer).__name__}")
        if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
            raise ValueError(f"num_steps must be an integer >= 1, got {num_steps!r}")
        # the optimizer's hooks; its groups, state and defaults are read through (see below)
        self.__dict__.update({k: v for k, v in optimizer.__dict__.items() if k not in _SHARED})
        self._opt, self._model, self._final = optimizer, model, num_steps
        named = self._named(model, optimizer, named_parameters)
        owned = {id(p) for m in model.modules() for p in m.parameters(recurse=False)}
        for name, p in named:
            if id(p) not in owned:
                raise ValueError(f"parameter {name!r} is not in the model: CrossBarrier applies "
                                 f"each update before the forward of the module that owns it")
        self._names = {id(p): name for name, p in named}
        self._pending: dict[int, tuple[torch.Tensor, Callable[[], torch.Tensor], dict]] = {}
        self._steps = 0
        # before the gradient sync's hooks, so that they run first (see _stale)
        self._hooks = [p.register_post_accumulate_grad_hook(self._stale) for _, p in named]
        # crossing the barrier is overlapping; the step trial times pushes ordered by need
        # against none, unless PS_CREDIT_BYTES says which
        self.gradient_sync = for_wrapper("crossbarrier", named, compression,
                                         backward_passes_per_step, overlap=True, credit="auto",
                                         crossing=True)
        self.gradient_sync.abandoned(self._pending.clear)  # (elastic) their answers will not come
        for module in model.modules():
            params = list(module.parameters(recurse=False))
            if any(id(p) in self._names for p in params):
                self._hooks.append(module.register_forward_pre_hook(self._before(params)))
        # a checkpoint of the model holds the last step's updates
        self._hooks.append(model.register_state_dict_pre_hook(lambda *_: self.synchronize()))

    @staticmethod
    def _named(model, optimizer, named_parameters) -> list[tuple[str, torch.Tensor]]:
        grouped = [p for group in optimizer.param_groups for p in group["params"]]
        given = list(model.named_parameters() if named_parameters is None else named_parameters)
        names = {id(p): name for name, p in given}
        missing = [p for p in grouped if p.requires_grad and id(p) not in names]
        if missing:
            raise ValueError(f"{len(missing)} of the optimizer's parameters (shapes "
                             f"{[tuple(p.shape) for p in missing[:3]]}) are not in "
                             f"named_parameters")
        return [(names[id(p)], p) for p in grouped if p.requires_grad]

    def _before(self, params: list[torch.Tensor]):
        def hook(_module, _inputs) -> None:
            for p in params:
                if id(p) in self._pending:
                    self._apply(p)
        return hook

    def _stale(self, p: torch.Tensor) -> None:
        if id(p) in self._pending:
            raise RuntimeError(
                f"parameter {self._names[id(p)]!r} was used before its update from the last step "
                f"was applied: CrossBarrier applies it in the forward pre-hook of the module that "
                f"owns the parameter, and this forward read it elsewhere; call synchronize() "
                f"before such a forward pass")

    def _apply(self, p: torch.Tensor) -> None:
        """Wait for ``p``'s averaged gradient and update ``p`` with it alone."""
        _, answer, hyper = self._pending.pop(id(p))
        grad = answer()
        opt = self._opt
        groups, grad_before = opt.param_groups, p.grad
        p.grad = grad if grad.dtype == p.dtype else grad.to(p.dtype)
        opt.param_groups = [dict(hyper, params=[p])]
        try:
            opt.step()
        finally:
            opt.param_groups, p.grad = groups, grad_before

    def synchronize(self) -> None:
        """Apply every update of the last step now (waiting for its answers): before reading
        parameters outside a forward pass of the model (``model.state_dict()`` and the next
        forward pass do it themselves)."""
        for key in list(self._pending):
            if key in self._pending:
                self._apply(self._pending[key][0])

    def step(self, closure=None):
        """Push what backward has not and return; the updates are applied as their layers run
        (or by :meth:`synchronize`; on the ``num_steps``-th call, before returning)."""
        loss = closure() if closure is not None else None
        self.synchronize()  # parameters the last forward pass did not use
        hyper = {}
        for group in self.param_groups:
            settings = {k: v for k, v in group.items() if k != "params"}
            for p in group["params"]:
                hyper[id(p)] = settings
        if set(self._names) - set(hyper):
            raise RuntimeError("a parameter left the optimizer's groups after CrossBarrier was built")
        params = {id(p): p for _, p in self.gradient_sync.named}
        answers = self.gradient_sync.hand_over()
        for key, answer in answers.items():
            p = params[key]
            self._pending[key] = (p, answer, hyper[key])
            p.grad = None  # the answer lands in the old tensor; the next backward starts afresh
        self._steps += 1
        if self._steps == self._final:
            self.synchronize()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Safe while answers are pending (they no longer live in ``p.grad``); refused, as the
        optimizer's, between the backward passes of one step."""
        self.gradient_sync.check_zero_grad()
        self._opt.zero_grad(set_to_none)

    def state_dict(self) -> dict:
        self.synchronize()
        state = self._opt.state_dict()
        state["adtopk_ps"] = self.gradient_sync.state_dict()
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        self.synchronize()
        state_dict = dict(state_dict)
        ours = state_dict.pop("adtopk_ps", None)
        self._opt.load_state_dict(state_dict)
        if ours is not None:
            self.gradient_sync.load_state_dict(ours)


def CrossBarrier(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
                 compression: object = Compression.none, backward_passes_per_step: int = 1,
                 num_steps: int = 10**6) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` (``SGD``, ``Adam``, ``AdamW`` or ``RMSprop``; others are refused) so
    that each layer of ``model`` waits only for its own update, in the next forward pass.

    ``named_parameters`` names the optimizer's parameters (default: the
    model's names); every one must belong to ``model``. ``compression`` takes
    every value :func:`.DistributedOptimizer` does. ``step()`` returns
    without waiting; the last step's updates are applied by the next forward
    pass, by ``synchronize()`` (call it before reading parameters outside a
    forward pass, e.g. to evaluate them by hand), by ``model.state_dict()``
    and by this optimizer's ``state_dict()``, and at once on the
    ``num_steps``-th ``step()``. A parameter must be read only in the
    forward of the module that owns it (a forward that reads one elsewhere,
    before its update, is refused in its backward pass). Every worker calls
    it, in the same order as its other wrappers.

    Example::

        import adtopk_ps.torch.cross_barrier as bps
        optimizer = bps.CrossBarrier(model, torch.optim.SGD(model.parameters(), lr=0.1,
                                                            momentum=0.9),
                                     named_parameters=model.named_parameters(),
                                     compression=bps.Compression.adtopk(ratio=0.01))
    """
    return _CrossBarrier(model, optimizer, named_parameters, compression,
                         backward_passes_per_step, num_steps)
