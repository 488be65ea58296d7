"""Gradient compression: ADTopk and the baselines it is measured against.

Compressors (what to send), error feedback (what was not sent) and the
partial-sparsification policy (whether to sparsify at all) are separate
pieces that compose.
"""
from ..dtypes import index_dtype
from .adtopk import ADTopk, ADTopkInterleaved, fibre_k
from .base import Compressor
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
    "GaussianK", "Payload", "PayloadError", "RandomK", "ResidualMemory", "Route",
    "SparsificationPolicy", "Threshold", "TopK", "create", "fibre_k", "index_dtype", "parameters",
]
