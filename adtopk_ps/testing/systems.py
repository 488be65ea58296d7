"""The systems the end-to-end benchmarks compare, and the models they train.

``benchmarks/e2e.py`` times them step by step and ``benchmarks/time_to_accuracy.py``
trains them to a target accuracy; both build each system's compression and DDP wrapper
here, so that both measure the same thing.
"""
from __future__ import annotations

# name -> how the system synchronises gradients: through our PS ("ps") with a compressor
# (and the cost model, hybrid communication or crossing the barrier), or torch DDP on gloo
# with a communication hook ("ddp")
SYSTEMS = {
    "ps-dense": {"kind": "ps", "compressor": "none"},
    "ps-topk": {"kind": "ps", "compressor": "topk"},
    "ps-adtopk": {"kind": "ps", "compressor": "adtopk", "measure_overlap": True},
    "ps-adtopk+cost": {"kind": "ps", "compressor": "adtopk", "cost": True},
    # the cost model, and dense tensors all-reduced among the workers where that measures faster
    "ps-adtopk+hybrid": {"kind": "ps", "compressor": "adtopk", "cost": True, "dense": "auto"},
    "ps-adtopk-i": {"kind": "ps", "compressor": "adtopk-i"},
    # the entries dead rows leave unused go to the live ones: about the density's bytes
    "ps-adtopk+refill": {"kind": "ps", "compressor": "adtopk", "refill": True},
    # each layer's update applied in the next forward pass (adtopk_ps.torch.cross_barrier)
    "ps-adtopk+crossbarrier": {"kind": "ps", "compressor": "adtopk", "crossbarrier": True},
    "ddp-dense": {"kind": "ddp", "hook": "none"},
    "ddp-powersgd": {"kind": "ddp", "hook": "powersgd"},
    "ddp-adtopk": {"kind": "ddp", "hook": "adtopk"},
}
# name: (architecture, its parameters, input kind). "vgg" has VGG's own 4096-wide classifier;
# the smaller two are the scaling study's model sizes
MODELS = {"vgg": ("vgg", {"hidden": 4096}, "images"),
          "vgg-2048": ("vgg", {"hidden": 2048}, "images"),
          "vgg-1024": ("vgg", {"hidden": 1024}, "images"),
          "resnet18": ("resnet18", {"width": 32}, "images"),
          "transformer": ("transformer", {"dim": 256, "layers": 4}, "tokens")}


def ddp_model(model, hook: str, ratio: float):
    """``model`` under torch DDP on gloo, with ``hook`` ("none", "powersgd" or "adtopk" at
    density ``ratio``) on its buckets."""
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

    import adtopk_ps.torch as bps

    # PowerSGD issues its later collectives from future callbacks; with two buckets in
    # flight gloo can see them in different orders on different ranks ("collective
    # mismatch"), so it gets one bucket
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1024 if hook == "powersgd" else 25)
    if hook == "powersgd":
        ddp.register_comm_hook(powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=2,
                                                      start_powerSGD_iter=2), powersgd.powerSGD_hook)
    elif hook == "adtopk":
        ddp.register_comm_hook(bps.ADTopkHookState(model, {"compressor": "adtopk", "k": ratio, "ef": "vanilla"}),
                               bps.adtopk_hook)
    return ddp


def ps_compression(system: dict, ratio: float):
    """The PS system's gradient compression: its compressor at density ``ratio`` with error
    feedback, under partial sparsification (dense: every tensor)."""
    import adtopk_ps.torch as bps
    from adtopk_ps.compression import SparsificationPolicy
    name = system["compressor"]
    return bps.GradientCompression(
        None if name == "none" else {"compressor": name, "k": ratio, "ef": "vanilla",
                                     **({"refill": True} if system.get("refill") else {})},
        SparsificationPolicy(ratio if name != "none" else 1.0),
        measure_costs=system.get("cost", False), dense_transport=system.get("dense", "ps"))
