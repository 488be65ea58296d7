"""Where keys go: the agreed tensors laid end to end and cut into equal shares of bytes.

byteps places each key by a hash of its number (``membership.server_of``). With a few
large keys and many servers that piles most of the bytes onto a few servers while others
get none, and the busiest server's link sets the step. Here the workers lay the tensors
they agreed to push end to end (sorted by tensor id; the sparse apart from the dense, whose
answers grow otherwise), weigh each row by the bytes it moves each step, push and answer,
and cut each lot into ``S x pieces`` runs of equal weight: run ``j`` goes to server
``j % S`` (``pieces`` is 1 but in elastic jobs, below). A tensor is cut only where a run ends or a partition would pass
``BYTEPS_PARTITION_BYTES``, always between rows (whole axis-1 fibres, so ADTopk of a range
is ADTopk of those rows of the whole): a step's keys number about the tensors plus the
runs, and every server's share is the mean to within a row. Every worker computes the same
placement from the same list, with no round trip: the arithmetic is in integers.

The ranges (the keys) depend on the configured number of servers (``DMLC_NUM_SERVER``),
never on how many are alive. After an elastic job loses a server the same ranges are packed
onto those left, heaviest first (LPT, :func:`assign`); an elastic job cuts each server's
share into ``ELASTIC_PIECES`` runs so that the packing stays even.

Tensors pushed outside an agreed list (a lone ``push_pull``, a collective) keep byteps'
partitions; their parts go round the servers from the one byteps' hash gives the first
(:func:`spread`), so a large one still reaches every server.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

from adtopk_ps.cluster.membership import PARTITION_BITS, make_key, server_of
from adtopk_ps.core.dtypes import index_dtype

#: runs per server an elastic job's plan cuts, so that packing them onto fewer servers after
#: a loss leaves the busiest within about 1 + 1/ELASTIC_PIECES of the mean
ELASTIC_PIECES = 10


@dataclass(frozen=True)
class Item:
    """One tensor to place: its id, shape, element size, the bytes it moves each step
    (``weight``: :func:`exchange_bytes` or :func:`push_bytes`) and whether it travels sparse
    (the sparse and the dense are shared out apart: their answers grow differently)."""

    tensor_id: int
    shape: tuple[int, ...]
    element_size: int
    weight: int
    sparse: bool = False

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
    """A placement: each tensor's row ranges, as (start, length) blocks, each key's weight in
    bytes and its server among the ``num_servers`` the plan was cut for."""

    blocks: dict[int, list[tuple[int, int]]]
    weights: dict[int, int]  # key -> bytes it moves per push
    servers: dict[int, int]  # key -> its server among num_servers
    num_servers: int

    def assign(self, num_servers: int) -> dict[int, int]:
        """Each key's server among ``num_servers``: the plan's own for the servers it was cut
        for, else its keys packed anew (see :func:`assign`)."""
        if num_servers == self.num_servers:
            return dict(self.servers)
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
    return numel // width * kept * (element_size + index_dtype(width).itemsize)


def exchange_bytes(shape: tuple[int, ...], element_size: int, ratio: float | None,
                   workers: int) -> int:
    """The bytes a server moves for one tensor each step, per worker: its push
    (:func:`push_bytes`) and its answer, the sum of ``workers`` pushes. A sparse answer is
    the union of the workers' selections, estimated as if they were independent (each
    fibre of width ``w`` keeping ``k``: ``w * (1 - (1 - k/w) ** workers)`` entries), or
    dense where that is smaller, as the server sends it. In integers: every worker must
    compute the same.

    Example::

        exchange_bytes((4096, 4096), 4, 0.01, 8)   # the push, and an answer about 7.7x as wide
    """
    numel = math.prod(shape)
    pushed = push_bytes(shape, element_size, ratio)
    if ratio is None or len(shape) < 2 or numel == 0:
        return pushed + numel * element_size
    width = shape[1]
    kept = max(1, math.floor(width * ratio))
    union = (width ** workers - (width - kept) ** workers) // width ** (workers - 1)
    answer = numel // width * union * (element_size + index_dtype(width).itemsize)
    return pushed + min(answer, numel * element_size)


def _cuts(items: list[Item], runs: int) -> dict[int, set[int]]:
    """Where each tensor must be cut (row numbers after which a new range starts) so that no
    range crosses the end of one of ``runs`` equal runs of the tensors laid end to end. A
    cut falls on the nearest row boundary."""
    total = sum(i.weight for i in items)
    out: dict[int, set[int]] = {i.tensor_id: set() for i in items}
    if total == 0:
        return out
    before = 0  # the weight of the tensors laid before this one
    for item in items:
        count = item.rows[1]
        # run boundary b (1..runs-1) lies at weight total*b/runs; inside this tensor when
        # before < total*b/runs < before + weight, at row (total*b/runs - before)*count/weight
        first = before * runs // total + 1
        for b in range(first, runs):
            at = total * b  # in units of 1/runs
            if at >= (before + item.weight) * runs:
                break
            row = ((at - before * runs) * count * 2 + item.weight * runs) // (2 * item.weight * runs)
            if 0 < row < count:
                out[item.tensor_id].add(row)
        before += item.weight
    return out


def _ranges(item: Item, cuts: set[int], partition_bytes: int) -> list[tuple[int, int]]:
    """``item``'s rows cut at ``cuts``, and each piece again into equal ranges of at most
    ``partition_bytes`` dense bytes (one row where a row is larger)."""
    unit, count = item.rows
    if count == 0:
        return [(0, 0)]
    per = max(1, partition_bytes // (unit * item.element_size))  # rows a partition holds
    out = []
    edges = [0, *sorted(cuts), count]
    for start, end in zip(edges, edges[1:]):
        length = end - start
        parts = -(-length // per)
        size = -(-length // parts)
        out += [(at, min(size, end - at)) for at in range(start, end, size)]
    if len(out) > 1 << PARTITION_BITS:
        raise ValueError(f"a tensor of shape {item.shape} needs more than "
                         f"{1 << PARTITION_BITS} partitions; raise BYTEPS_PARTITION_BYTES")
    return out


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


def plan(items: list[Item], num_servers: int, partition_bytes: int, pieces: int = 1) -> Plan:
    """Lay ``items`` end to end by tensor id (the sparse and the dense apart), cut each lot
    into ``num_servers x pieces`` runs of equal weight and each run's tensors into row
    ranges of at most ``partition_bytes``; run ``j`` goes to server ``j % num_servers``.

    Example::

        p = plan([Item(0, (4000, 1024), 4, push_bytes((4000, 1024), 4, 0.01), True)], 8, 4096000)
        p.blocks[0]                                   # 8 ranges of 500 rows, one a server
        imbalance(loads(p.weights, p.assign(8), 8))   # 1.0
    """
    if num_servers < 1 or partition_bytes < 1 or pieces < 1:
        raise ValueError(f"plan needs at least one server, one byte a partition and one piece "
                         f"a server, got {num_servers}, {partition_bytes} and {pieces}")
    items = sorted(items, key=lambda i: i.tensor_id)
    if len({i.tensor_id for i in items}) != len(items):
        raise ValueError("a tensor id appears twice in one plan")
    runs = num_servers * pieces
    blocks, servers = {}, {}
    for kind in (False, True):  # each kind laid end to end on its own, over every server
        laid = [i for i in items if i.sparse == kind]
        cuts = _cuts(laid, runs)
        total, before = sum(i.weight for i in laid), 0
        for item in laid:
            count = item.rows[1]
            blocks[item.tensor_id] = _ranges(item, cuts[item.tensor_id], partition_bytes)
            for index, (start, length) in enumerate(blocks[item.tensor_id]):
                # the run a range lies in, by its middle row (ranges never cross a run's end)
                middle = before * count * 2 + item.weight * (2 * start + length)
                run = min(runs - 1, middle * runs // (2 * count * total)) if count and total else 0
                servers[make_key(item.tensor_id, index)] = run % num_servers
            before += item.weight
    weights = _weights(items, blocks)
    return Plan(blocks, weights, servers, num_servers)


def spread(first_key: int, part: int, num_servers: int) -> int:
    """The server of part ``part`` of a tensor placed without a plan: byteps' hash places
    its first part, and the others follow round the servers."""
    return (server_of(first_key, num_servers) + part) % num_servers
