"""Which device a worker trains on, decided before it joins the cluster.

``device`` in the job config: ``auto`` takes this host's GPU for the worker's local rank
(``BYTEPS_LOCAL_RANK``, set by ``bpslaunch`` for every local process; ``PS_DEVICE_INDEX``
where it is set, as ``bpslaunch --local`` does with each worker's id, since all its workers
share one host) where a GPU is visible,
the CPU otherwise; ``cuda`` insists on a GPU and refuses to start without one (a GPU job that
fell back to the CPU would run for hours at a fraction of the speed and report nothing wrong);
``cpu`` never touches a GPU. More local workers than GPUs share them round-robin.
"""
from __future__ import annotations

import os
from typing import Mapping

import torch

from adtopk_ps.core.env import env_int

from .validate import DEVICES, ConfigError


def _no_gpu(environ: Mapping[str, str]) -> str:
    """Why torch sees no GPU here, as far as this process can tell."""
    if torch.version.cuda is None:
        return f"this torch ({torch.__version__}) is built without CUDA"
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return f"torch sees no GPU (CUDA_VISIBLE_DEVICES={visible!r})"
    return "torch sees no GPU (no driver, or none installed)"


def resolve(spec: str, environ: Mapping[str, str] | None = None) -> torch.device:
    """The device for config value ``spec``; :class:`ConfigError` where it names one this
    machine does not have.

    Example::

        device = resolve(cfg["device"])   # cuda:1 for local rank 1 on a host with 2 GPUs
    """
    environ = os.environ if environ is None else environ
    if spec == "cpu":
        return torch.device("cpu")
    if spec not in DEVICES:
        raise ConfigError(f"config key device={spec!r}: must be one of {list(DEVICES)}")
    if not torch.cuda.is_available():
        if spec == "auto":
            return torch.device("cpu")
        raise ConfigError(f"config key device='cuda': no GPU to train on: {_no_gpu(environ)}; "
                          f"set device: cpu, or auto to take a GPU only where there is one")
    given = "PS_DEVICE_INDEX" if environ.get("PS_DEVICE_INDEX", "").strip() else "BYTEPS_LOCAL_RANK"
    index = env_int(given, 0, minimum=0, environ=environ)
    return torch.device("cuda", index % torch.cuda.device_count())


def describe(device: torch.device) -> str:
    """``cuda:0 (NVIDIA H200)``, or ``cpu (8 threads)``: what a worker prints at start-up."""
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return f"{device} ({torch.get_num_threads()} threads)"
