"""byteps.torch- and horovod.torch-style API: ``import adtopk_ps.torch as bps`` (or ``as hvd``).

    bps.init()
    opt = bps.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression=bps.Compression.adtopk(ratio=0.01))
    bps.broadcast_parameters(model.state_dict(), root_rank=0)
    bps.broadcast_optimizer_state(opt, root_rank=0)

docs/compatibility.md lists every byteps.torch and horovod.torch name and what differs.
"""
from adtopk_ps.torch import elastic
from adtopk_ps.torch.agreement import Disagreement
from adtopk_ps.torch.compressors import Compression
from adtopk_ps.torch.ddp_hook import ADTopkHookState, adtopk_hook
from adtopk_ps.torch.gradient_compression import GradientCompression
from adtopk_ps.torch.nonfinite import NonFiniteGradient
from adtopk_ps.torch.objects import allgather_object, broadcast_object
from adtopk_ps.torch.ops import (Adasum, Average, Max, Min, Product, ReduceOp, Sum, allgather,
                                 allgather_async, allreduce, allreduce_, allreduce_async,
                                 allreduce_async_, barrier, broadcast, broadcast_, broadcast_async,
                                 broadcast_async_, byteps_push_pull, declare, join, poll, push_pull,
                                 push_pull_async, push_pull_async_inplace, push_pull_inplace,
                                 synchronize)
from adtopk_ps.torch.optimizer import DistributedOptimizer
from adtopk_ps.torch.replicas import ReplicasDiverged, verify_replicas
from adtopk_ps.torch.elastic import resume
from adtopk_ps.torch.runtime import (client, init, is_initialized, local_rank, local_size, rank,
                                     shutdown, size, suspend)
from adtopk_ps.torch.state_broadcast import broadcast_optimizer_state, broadcast_parameters

__all__ = [
    "ADTopkHookState", "Adasum", "Average", "Compression", "Disagreement", "DistributedOptimizer",
    "GradientCompression", "Max", "NonFiniteGradient", "Min", "Product", "ReduceOp", "Sum", "adtopk_hook",
    "allgather", "allgather_async", "allgather_object", "allreduce", "allreduce_",
    "allreduce_async", "allreduce_async_", "barrier", "broadcast", "broadcast_", "broadcast_async",
    "broadcast_async_", "broadcast_object", "broadcast_optimizer_state", "broadcast_parameters",
    "byteps_push_pull", "client", "declare", "elastic", "init", "is_initialized", "join", "local_rank",
    "local_size", "poll", "push_pull", "push_pull_async", "push_pull_async_inplace",
    "push_pull_inplace", "rank", "resume", "shutdown", "size", "suspend", "synchronize",
    "ReplicasDiverged", "verify_replicas",
]
