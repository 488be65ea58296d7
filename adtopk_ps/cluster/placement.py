"""Where keys go: tensors cut into row ranges and spread over the servers by the bytes they move.

byteps places each key by a hash of its number (``membership.server_of``). With a few
large keys and many servers that piles most of the bytes onto a few servers while others
get none, and the busiest server's link sets the step. Here the workers cut the tensors
they agreed to push into row ranges (whole axis-1 fibres, so ADTopk of a range is ADTopk
of those rows of the whole) and pack the ranges onto the servers by the bytes each moves,
the largest first, each to the server that holds least so far (LPT). Every worker computes
the same placement from the same list, with no round trip: the list is agreed, sorted by
tensor id, and the arithmetic is in integers.

A tensor is cut no finer than it must be: the cut starts at one range per server's share
and halves until the busiest server holds at most ``balance`` times the mean, or no range
can be cut further. The ranges (the keys) depend on the configured number of servers
(``DMLC_NUM_SERVER``), never on how many are alive: after a server is lost the same
ranges are packed again onto those left (:func:`assign`).

Tensors pushed outside an agreed list (a lone ``push_pull``, a collective) keep byteps'
partitions; their parts go round the servers from the one byteps' hash gives the first
(:func:`spread`), so a large one still reaches every server.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

from adtopk_ps.cluster.membership import PARTITION_BITS, make_key, server_of

#: the busiest server's bytes over the mean that a plan is cut finer to stay within
DEFAULT_BALANCE = 1.05
#: how many times a plan may halve its cut before it settles for the best it found
MAX_HALVINGS = 16


@dataclass(frozen=True)
class Item:
    """One tensor to place: its id, shape, element size and the bytes one push of the
    whole tensor moves (``weight``: dense bytes for a dense key, the compressed push's for
    a sparse one; see :func:`push_bytes`)."""

    tensor_id: int
    shape: tuple[int, ...]
    element_size: int
    weight: int

    @property
    def rows(self) -> tuple[int, int]:
        """(elements per row, rows): the units a cut keeps whole (axis-0 slices for 2+
        dimensions, single elements otherwise)."""
        numel = math.prod(self.shape)
        if len(self.shape) >= 2 and numel:
            return numel // self.shape[0], self.shape[0]
        return 1, numel


@dataclass(frozen=True)
class Plan:
    """A placement: each tensor's row ranges, as (start, length) blocks, and each key's
    weight in bytes, so that :func:`assign` can pack the keys onto any number of servers."""

    blocks: dict[int, list[tuple[int, int]]]
    weights: dict[int, int]  # key -> bytes it moves per push

    def assign(self, num_servers: int) -> dict[int, int]:
        """Each key's server among ``num_servers`` (see :func:`assign`)."""
        return assign(self.weights, num_servers)


def push_bytes(shape: tuple[int, ...], element_size: int, ratio: float | None) -> int:
    """The bytes one push of a tensor moves: dense (``ratio`` None), or ADTopk's at
    ``ratio``: every axis-1 fibre keeps ``max(1, floor(shape[1] * ratio))`` values, each
    with a position in the smallest unsigned type that holds ``shape[1] - 1``.

    Example::

        push_bytes((4096, 4096), 4, 0.01)    # 4096 rows x 40 values x (4 + 2 bytes)
    """
    numel = math.prod(shape)
    if ratio is None or len(shape) < 2 or numel == 0:
        return numel * element_size
    width = shape[1]
    kept = max(1, math.floor(width * ratio))
    index = 1 if width <= 1 << 8 else 2 if width <= 1 << 16 else 4
    return numel // width * kept * (element_size + index)


def _cut(item: Item, partition_bytes: int, cap: float) -> list[tuple[int, int]]:
    """``item``'s rows in equal ranges, each of at most ``partition_bytes`` dense bytes and
    (where rows allow) at most ``cap`` bytes of weight."""
    unit, count = item.rows
    if count == 0:
        return [(0, 0)]
    per = max(1, partition_bytes // (unit * item.element_size))  # rows a partition holds
    if cap > 0 and item.weight > cap:
        per = min(per, max(1, -(-count // math.ceil(item.weight / cap))))
    per = -(-count // -(-count // per))  # ranges of equal rows, none larger
    if -(-count // per) > 1 << PARTITION_BITS:
        raise ValueError(f"a tensor of shape {item.shape} needs more than "
                         f"{1 << PARTITION_BITS} partitions; raise BYTEPS_PARTITION_BYTES")
    return [(start, min(per, count - start)) for start in range(0, count, per)]


def _weights(items: list[Item], blocks: dict[int, list[tuple[int, int]]]) -> dict[int, int]:
    out = {}
    for item in items:
        count = item.rows[1]
        for index, (_, length) in enumerate(blocks[item.tensor_id]):
            out[make_key(item.tensor_id, index)] = item.weight * length // count if count else 0
    return out


def assign(weights: dict[int, int], num_servers: int) -> dict[int, int]:
    """Pack keys onto ``num_servers`` empty servers (see :func:`pack`).

    Example::

        assign({1: 300, 2: 200, 3: 100}, 2)   # {1: 0, 2: 1, 3: 1}
    """
    if num_servers < 1:
        raise ValueError(f"cannot place keys on {num_servers} servers")
    return pack(weights, [0] * num_servers)


def pack(weights: dict[int, int], held: list[int]) -> dict[int, int]:
    """Pack keys onto servers already holding ``held`` bytes (updated here), the heaviest
    first (ties by key), each onto the server that holds least so far (ties to the lowest
    number): the same on every worker.

    Example::

        held = [0, 0]
        pack({1: 300, 2: 200}, held)          # {1: 0, 2: 1}; held is now [300, 200]
    """
    heap = [(load, server) for server, load in enumerate(held)]
    heapq.heapify(heap)
    out = {}
    for key in sorted(weights, key=lambda k: (-weights[k], k)):
        load, server = heapq.heappop(heap)
        out[key] = server
        held[server] = load + weights[key]
        heapq.heappush(heap, (held[server], server))
    return out


def loads(weights: dict[int, int], placement: dict[int, int], num_servers: int) -> list[int]:
    """The bytes each server gets under ``placement``."""
    out = [0] * num_servers
    for key, server in placement.items():
        out[server] += weights[key]
    return out


def imbalance(per_server: list[int]) -> float:
    """The busiest server's bytes over the mean (1.0: even; 1.0 for nothing at all)."""
    total = sum(per_server)
    return max(per_server) * len(per_server) / total if total else 1.0


def plan(items: list[Item], num_servers: int, partition_bytes: int,
         balance: float = DEFAULT_BALANCE) -> Plan:
    """Cut ``items`` into row ranges and weigh them so that packing them onto
    ``num_servers`` leaves the busiest at most ``balance`` times the mean (or as near as
    whole rows allow), with no more keys than that needs.

    Example::

        p = plan([Item(0, (4000, 1024), 4, push_bytes((4000, 1024), 4, 0.01))], 8, 4096000)
        imbalance(loads(p.weights, p.assign(8), 8))   # 1.0: 8 ranges of 500 rows
    """
    if num_servers < 1 or partition_bytes < 1:
        raise ValueError(f"plan needs at least one server and one byte a partition, "
                         f"got {num_servers} and {partition_bytes}")
    items = sorted(items, key=lambda i: i.tensor_id)
    if len({i.tensor_id for i in items}) != len(items):
        raise ValueError("a tensor id appears twice in one plan")
    total = sum(i.weight for i in items)
    cap = total / num_servers if num_servers > 1 else 0.0
    best: Plan | None = None
    best_ratio = math.inf
    for _ in range(MAX_HALVINGS + 1):
        blocks = {i.tensor_id: _cut(i, partition_bytes, cap) for i in items}
        weights = _weights(items, blocks)
        ratio = imbalance(loads(weights, assign(weights, num_servers), num_servers))
        if ratio < best_ratio - 1e-12:
            best, best_ratio = Plan(blocks, weights), ratio
        finer = any(len(blocks[i.tensor_id]) < i.rows[1] and i.weight > cap / 2 for i in items)
        if ratio <= balance or cap == 0 or not finer:
            break
        cap /= 2
    assert best is not None
    return best


def spread(first_key: int, part: int, num_servers: int) -> int:
    """The server of part ``part`` of a tensor placed without a plan: byteps' hash places
    its first part, and the others follow round the servers."""
    return (server_of(first_key, num_servers) + part) % num_servers
