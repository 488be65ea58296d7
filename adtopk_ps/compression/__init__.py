"""Gradient compression: ADTopk and the baselines it is measured against.

The three pieces GRACE names, and where each lives:

- compressor (what to send): :class:`Compressor` in ``base.py`` states the
  interface; ``adtopk.py``, ``topk.py``, ``threshold.py``, ``randomk.py``,
  ``dgc.py``, ``gaussiank.py`` and ``dense.py`` implement it, ``registry.py``
  builds them by name, and ``adtopk_ps/core/payload.py`` is what they return;
- memory (what was not sent): :class:`ResidualMemory` and the
  :class:`ErrorFeedback` wrapper in ``memory.py``;
- communicator (who sums the payloads), outside this package: through the
  servers, :class:`~adtopk_ps.client.ps_client.PSClient` in ``adtopk_ps/client/ps_client.py``;
  among the workers, ``adtopk_ps/torch/dense_lane.py`` (the dense tensors'
  all-reduce) and ``adtopk_ps/torch/ddp_hook.py`` (DDP's hook).
  ``adtopk_ps/torch/gradient_sync.py`` puts the three together for training.

The partial-sparsification policy (``policy.py``: whether to sparsify a
tensor at all) and its cost model (``cost.py``) compose with all three.
"""
from adtopk_ps.compression.adtopk import ADTopk, ADTopkInterleaved, fibre_k
from adtopk_ps.compression.base import Compressor, Request, start_each
from adtopk_ps.compression.cost import CostModel, compression_speed
from adtopk_ps.compression.dense import Dense
from adtopk_ps.compression.dgc import DGC
from adtopk_ps.compression.gaussiank import GaussianK
from adtopk_ps.compression.memory import ErrorFeedback, ResidualMemory
from adtopk_ps.compression.policy import Route, SparsificationPolicy
from adtopk_ps.compression.randomk import RandomK
from adtopk_ps.compression.registry import COMPRESSORS, create, parameters
from adtopk_ps.compression.threshold import Threshold
from adtopk_ps.compression.topk import TopK

__all__ = [
    "ADTopk", "ADTopkInterleaved", "COMPRESSORS", "Compressor", "CostModel", "compression_speed", "DGC", "Dense", "ErrorFeedback",
    "GaussianK", "RandomK", "Request", "ResidualMemory", "Route",
    "SparsificationPolicy", "Threshold", "TopK", "create", "fibre_k", "parameters", "start_each",
]
