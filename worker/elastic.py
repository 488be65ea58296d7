"""The training job as an elastic job (config key ``elastic``): workers may be lost and join
while it trains, and every step's data follows the workers there are now.

The job's cluster must be elastic too (``bpslaunch --min-workers``, or PS_MIN_WORKERS /
PS_MAX_WORKERS on every role); the config's ``min_workers`` and ``max_workers``, where given,
must be the cluster's. Training runs in ``adtopk_ps.torch.elastic.run`` with a
``TorchState`` committed in memory every ``commit_every`` steps; a joiner takes the newest
commit; with ``--checkpoint-dir`` every ``checkpoint_every`` steps go to disk too
(elastic_checkpoint.py). Each epoch's samples are drawn in one order (the seed and the epoch), and each step
deals the next ``workers x batch_size`` of them out by rank: after a re-form the rest of the
epoch goes to the new ranks, so within an epoch no sample is lost or seen twice.
"""
from __future__ import annotations

import torch

import adtopk_ps.torch as bps
from adtopk_ps.core.env import EnvError

from .data import Dataset


def check_cluster(cfg: dict) -> None:
    """Refuse an elastic job config on a cluster that is not elastic, or whose bounds differ
    from the config's, naming both sides."""
    spec, cluster = cfg["elastic"], bps.client().config
    if not cluster.elastic:
        raise EnvError("the job config has elastic set, but the cluster is not elastic: start it "
                       "with bpslaunch --min-workers N (PS_MIN_WORKERS or PS_MAX_WORKERS on every "
                       "role)")
    for key, variable, have in zip(("min_workers", "max_workers"), ("PS_MIN_WORKERS", "PS_MAX_WORKERS"),
                                   cluster.bounds):
        if spec.get(key) is not None and spec[key] != have:
            raise EnvError(f"the job config has elastic.{key}={spec[key]}, the cluster {variable}"
                           f"={have} (or its default, DMLC_NUM_WORKER): give both the same value")


def round_batch(data: Dataset, epoch: int, processed: int, rank: int, size: int,
                batch_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """This worker's share of the next step of an epoch all workers deal from: the epoch's
    order (``seed`` and ``epoch``), ``processed`` samples in, ``batch_size`` each or an even
    share of what is left; a rank left without any takes from the epoch's start (as
    ``DistributedSampler`` pads). Returns (x, y, the samples the step takes in all).

    Example::

        x, y, taken = round_batch(data, epoch=0, processed=0, rank=1, size=2, batch_size=32, seed=0)
    """
    total = len(data.x_train)
    order = torch.randperm(total, generator=torch.Generator().manual_seed(seed + epoch))
    left = total - processed
    each = min(batch_size, -(-left // size))
    begin = processed + rank * each
    picked = order[begin:min(begin + each, total)] if begin < total else order[:1]
    picked = picked.to(data.x_train.device)
    return data.x_train[picked], data.y_train[picked], min(left, each * size)


def new_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> bps.elastic.TorchState:
    """What a commit saves: the model, the optimizer (with its residuals and step count), the
    step and how far the epoch got; whether the job's start looked for checkpoints on disk
    (``surveyed``), the steps committed there with their digests (``saved``) and this run's
    number in the commit records (``run``), and the step it ends at (``end``)."""
    return bps.elastic.TorchState(model, opt, step=0, epoch=0, processed=0, surveyed=False,
                                  saved={}, run=0, end=0)
