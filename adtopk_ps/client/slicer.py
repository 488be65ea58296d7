"""The client's slicer (ps-lite's ``KVWorker::set_slicer``): it cuts tensors into keys and
places the keys on servers.

Tensors a worker agreed to push with the others (``PSClient.plan``) are cut and placed by
``cluster/placement.py``: laid end to end and cut into equal shares of the bytes they move,
one a server. Each plan is placed beside the ones before it (each shares its bytes evenly),
so that a key never moves while its rounds run; for another number of live servers (an
elastic job that lost one, whose rounds start again at 0) the whole sequence is packed
again, in the same order. Tensors
pushed without a plan keep byteps' partitions, their parts round the servers from the
one byteps' hash gives the first. With ``PS_PLACEMENT=hash`` nothing is planned and every
key goes where byteps' hash puts it.
"""
from __future__ import annotations

import threading

from adtopk_ps.cluster.membership import PARTITION_BITS, make_key, partition_rows, server_of
from adtopk_ps.cluster.placement import ELASTIC_PIECES, Item, Plan, pack, plan, spread

_PART_MASK = (1 << PARTITION_BITS) - 1


class Slicer:
    """Cuts tensors into (start, length) row blocks and gives each key its server.

    Example::

        slicer = Slicer(num_servers=4, partition_bytes=4096000)
        slicer.plan([Item(7, (4000, 1024), 4, push_bytes((4000, 1024), 4, 0.01), True)])
        blocks = slicer.blocks(7, (4000, 1024), 4)      # 4 ranges of 1000 rows
        slicer.server_of(make_key(7, 0), 4)             # one a server: 0
    """

    def __init__(self, num_servers: int, partition_bytes: int, placement: str = "balanced",
                 elastic: bool = False):
        self.num_servers, self.partition_bytes = num_servers, partition_bytes
        self.hashed = placement == "hash"  # byteps' placement: nothing planned
        # an elastic job may lose a server: its shares are cut finer, to pack onto fewer evenly
        self.pieces = ELASTIC_PIECES if elastic else 1
        self._blocks: dict[int, list[tuple[int, int]]] = {}  # planned tensors' row ranges
        self._groups: list[Plan] = []  # each plan, in order
        # by the number of live servers: each key's server, the servers' bytes, and how
        # many groups are packed
        self._tables: dict[int, tuple[dict[int, int], list[int], int]] = {}
        self._lock = threading.Lock()  # plan runs on the caller's thread, server_of on the engine's

    def plan(self, items: list[Item]) -> None:
        """Cut and weigh the tensors of ``items`` not planned yet, as one group packed after
        the earlier ones (every worker plans the same groups in the same order)."""
        new = [i for i in items if i.tensor_id not in self._blocks]
        if not new or self.hashed:
            return
        placed = plan(new, self.num_servers, self.partition_bytes, self.pieces)
        with self._lock:
            self._blocks.update(placed.blocks)
            self._groups.append(placed)

    def planned(self, tensor_id: int) -> bool:
        """Whether a plan cut this tensor."""
        return tensor_id in self._blocks

    def blocks(self, tensor_id: int, shape: tuple[int, ...], element_size: int) -> list[tuple[int, int]]:
        """The tensor's row blocks: its plan's, or byteps' partitions."""
        got = self._blocks.get(tensor_id)
        return got if got is not None else partition_rows(shape, element_size, self.partition_bytes)

    def server_of(self, key: int, num_servers: int) -> int:
        """The server of ``key`` among ``num_servers`` live servers."""
        with self._lock:
            table, held, done = self._tables.get(num_servers) or ({}, [0] * num_servers, 0)
            if done < len(self._groups):
                for group in self._groups[done:]:
                    if num_servers == self.num_servers:  # the plan's own shares
                        table.update(group.servers)
                    else:
                        table.update(pack(group.weights, held))
                self._tables[num_servers] = (table, held, len(self._groups))
            server = table.get(key)
        if server is None:
            if self.hashed:
                return server_of(key, num_servers)
            return spread(make_key(key >> PARTITION_BITS, 0), key & _PART_MASK, num_servers)
        return server
