"""byteps.torch-style API: ``import adtopk_ps.torch as bps``.

    bps.init()
    opt = bps.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression={"compressor": "adtopk", "k": 0.01, "ef": "vanilla"})
    bps.broadcast_parameters(model.state_dict(), root_rank=0)
    bps.broadcast_optimizer_state(opt, root_rank=0)
"""
from .broadcast import broadcast_optimizer_state, broadcast_parameters
from .ddp_hook import ADTopkHookState, adtopk_hook
from .nonfinite import NonFiniteGradient
from .objects import allgather_object, broadcast_object
from .optimizer import DistributedOptimizer, GradientCompression
from .runtime import (client, init, local_rank, local_size, push_pull, push_pull_async, rank,
                      shutdown, size)

__all__ = [
    "ADTopkHookState", "DistributedOptimizer", "GradientCompression", "NonFiniteGradient",
    "adtopk_hook", "allgather_object",
    "broadcast_object", "broadcast_optimizer_state", "broadcast_parameters", "client", "init",
    "local_rank", "local_size", "push_pull", "push_pull_async", "rank", "shutdown", "size",
]
