"""Python objects across workers: one root's to every worker, or every worker's to all.

Both are agreed by name across the workers first (the root and every
worker's byte count travel with the agreement), then travel through the
parameter servers as one push_pull. Bytes go as
float32 holding 16-bit integers, which sums with zeros leave exact (raw
float bit patterns would not survive: -0.0 + 0.0 is 0.0). Objects are
pickled, so, as in byteps and horovod, every worker trusts what the others
send: they are parts of one job.
"""
from __future__ import annotations

import pickle

import torch

from adtopk_ps.client.handle import Agreement, Handle
from adtopk_ps.torch.ops import claim, collective_name, key_name, occupy, refuse_everywhere
from adtopk_ps.torch.runtime import client


def _words(blob: bytes, length: int) -> torch.Tensor:
    """``blob`` as float32 words of 16 bits, zero-padded to ``length`` bytes (rounded up to even)."""
    padded = blob + b"\0" * ((length + 1) // 2 * 2 - len(blob))
    if not padded:
        return torch.zeros(0, dtype=torch.float32)
    return (torch.frombuffer(bytearray(padded), dtype=torch.int16).to(torch.int32) & 0xFFFF).to(
        torch.float32)


def _bytes(words: torch.Tensor, length: int) -> bytes:
    return words.to(torch.int32).to(torch.int16).numpy().tobytes()[:length]


def broadcast_object(obj: object, root_rank: int = 0, name: str | None = None) -> object:
    """The root's ``obj`` on every worker (any picklable object). As in byteps and horovod,
    the root is trusted: the others unpickle what it sends. An object that does not pickle,
    or a root out of range, is refused on every worker alike.

    Example::

        args = bps.broadcast_object(args, root_rank=0)   # an argparse.Namespace, say
    """
    c = client()
    name = collective_name("broadcast_object", name)
    claim(name)
    try:
        if not isinstance(root_rank, int) or not 0 <= root_rank < c.size:
            raise ValueError(f"broadcast_object: root_rank {root_rank!r} is not a worker rank "
                             f"(0..{c.size - 1})")
        blob = pickle.dumps(obj) if c.rank == root_rank else b""
    except Exception as exc:  # noqa: BLE001 - pickling raises many types; all are refusals
        refuse_everywhere(name, exc if isinstance(exc, (TypeError, ValueError))
                          else TypeError(f"broadcast_object: cannot pickle the object: {exc}"))

    def start(agreement: Agreement, handle: Handle) -> None:
        length = int(agreement.own[root_rank])
        words = _words(blob, length)
        c.push_agreed(handle, key_name(name, words.dtype, tuple(words.shape)), words)

    got = c.collective(name, {"kind": "broadcast_object", "root": root_rank}, start,
                       own=len(blob) if c.rank == root_rank else None)
    occupy(name, got)
    words = got.wait()
    return pickle.loads(_bytes(words, int(got.agreement.own[root_rank])))


def allgather_object(obj: object, name: str | None = None) -> list:
    """Every worker's ``obj``, in rank order, on every worker (any picklable object).

    Example::

        found = bps.allgather_object(os.path.exists(path))   # [True, False] on each worker
    """
    c = client()
    name = collective_name("allgather_object", name)
    claim(name)
    try:
        blob = pickle.dumps(obj)
    except Exception as exc:  # noqa: BLE001 - pickling raises many types; all are refusals
        refuse_everywhere(name, TypeError(f"allgather_object: cannot pickle the object: {exc}"))

    def start(agreement: Agreement, handle: Handle) -> None:
        width = (max(int(agreement.own[r]) for r in range(c.size)) + 1) // 2
        table = torch.zeros(c.size, width, dtype=torch.float32)
        table[c.rank, :(len(blob) + 1) // 2] = _words(blob, len(blob))
        c.push_agreed(handle, key_name(name, table.dtype, tuple(table.shape)), table)

    got = c.collective(name, {"kind": "allgather_object"}, start, own=len(blob))
    occupy(name, got)
    table = got.wait()
    lengths = [int(got.agreement.own[r]) for r in range(c.size)]
    return [pickle.loads(_bytes(table[r], lengths[r])) for r in range(c.size)]
