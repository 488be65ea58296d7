"""Gradient compression: ADTopk and the baselines it is measured against.

The three pieces GRACE names, and where each lives:

- compressor (what to send): :class:`Compressor` in ``base.py`` states the
  interface; ``adtopk.py``, ``topk.py``, ``threshold.py``, ``randomk.py``,
  ``dgc.py``, ``gaussiank.py`` and ``dense.py`` implement it, ``registry.py``
  builds them by name, and ``payload.py`` is what they return;
- memory (what was not sent): :class:`ResidualMemory` and the
  :class:`ErrorFeedback` wrapper in ``memory.py``;
- communicator (who sums the payloads), outside this package: through the
  servers, :class:`~adtopk_ps.client.PSClient` in ``adtopk_ps/client.py``;
  among the workers, ``adtopk_ps/torch/dense_lane.py`` (the dense tensors'
  all-reduce) and ``adtopk_ps/torch/ddp_hook.py`` (DDP's hook).
  ``adtopk_ps/torch/optimizer.py`` puts the three together for training.

The partial-sparsification policy (``policy.py``: whether to sparsify a
tensor at all) and its cost model (``cost.py``) compose with all three.
"""
from .adtopk import ADTopk, ADTopkInterleaved, fibre_k
from .base import Compressor, Request, start_each
from .cost import CostModel, compression_speed
from .dense import Dense
from .dgc import DGC
from .gaussiank import GaussianK
from .memory import ErrorFeedback, ResidualMemory
from .payload import Payload, PayloadError
from .policy import Route, SparsificationPolicy
from .randomk import RandomK
from .registry import COMPRESSORS, create, parameters
from .threshold import Threshold
from .topk import TopK

__all__ = [
    "ADTopk", "ADTopkInterleaved", "COMPRESSORS", "Compressor", "CostModel", "compression_speed", "DGC", "Dense", "ErrorFeedback",
    "GaussianK", "Payload", "PayloadError", "RandomK", "Request", "ResidualMemory", "Route",
    "SparsificationPolicy", "Threshold", "TopK", "create", "fibre_k", "parameters", "start_each",
]
