"""Making every worker start from the root's parameters and optimizer state.

A broadcast is a push_pull in which only the root contributes: the others
push zeros, so the sum is the root's value (see :mod:`.ops`; integer and
boolean tensors travel as float64, exact for every value below 2**53).
"""
from __future__ import annotations

import hashlib
from typing import Iterable, Mapping

import torch

from adtopk_ps.cluster.coordinator import check_name
from adtopk_ps.torch.objects import broadcast_object
from adtopk_ps.torch.ops import refuse_everywhere, submit_agreed, synchronize
from adtopk_ps.torch.runtime import client, rank


def broadcast_parameters(params: Mapping[str, torch.Tensor] | Iterable, root_rank: int = 0,
                         prefix: str = "broadcast") -> None:
    """Overwrite ``params`` in place with the root's: a state_dict, named pairs
    (``named_parameters()``) or a bare list of tensors (``parameters()``, named by position).
    None values are skipped, as horovod does.

    The workers first agree the list itself (names, shapes, dtypes): a model that differs on
    some worker, or a value that is not a tensor, is refused on every worker at once, before
    any tensor moves. Each tensor's call is named ``<prefix>.<name>``; a name that
    :func:`~adtopk_ps.cluster.coordinator.check_name` refuses raises ``ValueError`` before
    anything is sent.

    Example::

        bps.broadcast_parameters(model.state_dict(), root_rank=0)
    """
    if isinstance(params, Mapping):
        items = sorted(params.items(), key=lambda kv: kv[0])
    else:
        items = [p if isinstance(p, tuple) else (str(i), p) for i, p in enumerate(params)]
    items = [(name, value) for name, value in items if value is not None]
    listed = f"{prefix}.parameters"
    for full in (listed, *(f"{prefix}.{name}" for name, _ in items)):  # before anything is sent
        check_name(full)
    wrong = [name for name, value in items if not isinstance(value, torch.Tensor)]
    if wrong:
        kind = type(dict(items)[wrong[0]]).__name__
        refuse_everywhere(listed, TypeError(f"broadcast_parameters: {wrong[0]!r} is a {kind}, "
                                            f"not a tensor"))
    described = repr([(name, tuple(v.shape), str(v.dtype)) for name, v in items]).encode()
    client().collective(listed, {
        "kind": "broadcast_parameters", "root": root_rank, "tensors": len(items),
        "names, shapes and dtypes (digest)": hashlib.blake2b(described, digest_size=6).hexdigest(),
    }).wait()
    handles = [submit_agreed(value, what=f"broadcast_parameters ({name!r})", kind="broadcast",
                       average=False, root=root_rank, inplace=True, full_name=f"{prefix}.{name}")
               for name, value in items]
    for handle in handles:
        synchronize(handle)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0,
                              prefix: str = "broadcast") -> None:
    """Load the root's optimizer state (buffers, step counts, hyper-parameters) everywhere.

    In an optimizer with no state yet, every parameter that needs a gradient and has none
    gets a zero one, as horovod leaves them. horovod also takes a local step there, to
    create the buffers it broadcasts one by one; here the state travels whole, so no step
    is taken and no buffer or step count changes.

    Example::

        bps.broadcast_optimizer_state(optimizer, root_rank=0)
    """
    if not optimizer.state:
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad and p.grad is None:
                    p.grad = torch.zeros_like(p)
    state = broadcast_object(optimizer.state_dict(), root_rank, f"{prefix}.optimizer")
    if rank() != root_rank:
        optimizer.load_state_dict(state)
