"""Python objects across workers: one root's to every worker, or every worker's to all.

Both travel through the parameter servers as push_pulls. Bytes go as
float32 holding 16-bit integers, which sums with zeros leave exact (raw
float bit patterns would not survive: -0.0 + 0.0 is 0.0). Objects are
pickled, so, as in byteps and horovod, every worker trusts what the others
send: they are parts of one job.
"""
from __future__ import annotations

import pickle

import torch

from .runtime import client


def _words(blob: bytes, length: int) -> torch.Tensor:
    """``blob`` as float32 words of 16 bits, zero-padded to ``length`` bytes (rounded up to even)."""
    padded = blob + b"\0" * ((length + 1) // 2 * 2 - len(blob))
    if not padded:
        return torch.zeros(0, dtype=torch.float32)
    return (torch.frombuffer(bytearray(padded), dtype=torch.int16).to(torch.int32) & 0xFFFF).to(
        torch.float32)


def _bytes(words: torch.Tensor, length: int) -> bytes:
    return words.to(torch.int32).to(torch.int16).numpy().tobytes()[:length]


def _sum(tensor: torch.Tensor, name: str) -> torch.Tensor:
    return client().push_pull(tensor, name, average=False).wait()


def broadcast_object(obj: object, root_rank: int = 0, name: str | None = None) -> object:
    """The root's ``obj`` on every worker (any picklable object). As in byteps and horovod,
    the root is trusted: the others unpickle what it sends.

    Example::

        args = bps.broadcast_object(args, root_rank=0)   # an argparse.Namespace, say
    """
    c = client()
    if not 0 <= root_rank < c.size:
        raise ValueError(f"root_rank {root_rank} is not a worker rank (0..{c.size - 1})")
    name = "broadcast.object" + (f".{name}" if name else "")
    blob = pickle.dumps(obj) if c.rank == root_rank else b""
    length = int(_sum(torch.tensor([float(len(blob))], dtype=torch.float64), f"{name}.length").item())
    # a fresh name per size: a name's shape is fixed once declared
    got = _sum(_words(blob, length), f"{name}.{length}")
    return pickle.loads(_bytes(got, length))


def allgather_object(obj: object, name: str | None = None) -> list:
    """Every worker's ``obj``, in rank order, on every worker (any picklable object).

    Example::

        found = bps.allgather_object(os.path.exists(path))   # [True, False] on each worker
    """
    c = client()
    name = "allgather.object" + (f".{name}" if name else "")
    blob = pickle.dumps(obj)
    lengths = torch.zeros(c.size, dtype=torch.float64)
    lengths[c.rank] = len(blob)
    lengths = [int(n) for n in _sum(lengths, f"{name}.lengths").tolist()]
    width = (max(lengths) + 1) // 2
    table = torch.zeros(c.size, width, dtype=torch.float32)
    table[c.rank, :(len(blob) + 1) // 2] = _words(blob, len(blob))
    got = _sum(table, f"{name}.{width}")
    return [pickle.loads(_bytes(got[r], lengths[r])) for r in range(c.size)]
