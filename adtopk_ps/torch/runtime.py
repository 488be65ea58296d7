"""The process-wide connection to the parameter server."""
from __future__ import annotations

import atexit
import os

import torch

from ..client import Handle, PSClient
from ..cluster import ClusterConfig
from ..compression import Compressor
from ..env import env_int

_client: PSClient | None = None


def init(config: ClusterConfig | None = None) -> None:
    """Join the cluster described by the DMLC environment (once per process)."""
    global _client
    if _client is None:
        _client = PSClient(config)
        atexit.register(shutdown)


def shutdown() -> None:
    """Leave the cluster; the job ends once every worker has."""
    global _client
    if _client is not None:
        _client.shutdown()
        _client = None


def client() -> PSClient:
    if _client is None:
        raise RuntimeError("adtopk_ps.torch.init() has not been called")
    return _client


def rank() -> int:
    return client().rank


def size() -> int:
    return client().size


def local_rank() -> int:
    return env_int("BYTEPS_LOCAL_RANK", 0, minimum=0, environ=os.environ)


def local_size() -> int:
    return env_int("BYTEPS_LOCAL_SIZE", 1, minimum=1, environ=os.environ)


def push_pull_async(tensor: torch.Tensor, name: str, average: bool = True,
                    compressor: Compressor | None = None) -> Handle:
    return client().push_pull(tensor, name, compressor, average)


def push_pull(tensor: torch.Tensor, name: str, average: bool = True,
              compressor: Compressor | None = None) -> torch.Tensor:
    """Sum (or average) ``tensor`` over every worker and return the result."""
    return push_pull_async(tensor, name, average, compressor).wait()
