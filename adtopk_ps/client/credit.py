"""Pushes ordered by need behind a credit window (ByteScheduler's idea; ``PS_CREDIT_BYTES``):
an urgent push overtakes a queue of large ones.

Without a window, every push goes to its server's connection as soon as its payload is
ready, and once there it cannot be overtaken: the first layer's gradient, which the
backward pass produces last and the next forward pass needs first, waits behind every
other layer's. With a window, the engine hands a server's connection at most ``window``
bytes that the server has not yet acknowledged receiving, and keeps the rest here in
priority order: the lowest ``priority`` (the first layer, when pushes are ordered by
need) leaves first once there is room.

Credit comes back when the server says it has *received* a push (``received``), not when
the round is answered: a round completes only when every worker has pushed it, so credit
held until the answers would let two workers each wait, window full, for a push the other
holds back. A receipt depends on nothing but the link.

Example::

    outbox = Outbox(window=4 << 20)
    outbox.post(server=0, priority=3, frames=frames, tag=(key, rnd), size=n, send=send)
    ...
    outbox.received(server=0, tag=(key, rnd), send=send)   # the server's ``received``
"""
from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Callable

#: ``send(server, frames)``: hand ``frames`` to that server's connection
Send = Callable[[int, list], None]


@dataclass(order=True)
class _Entry:
    priority: int
    seq: int
    frames: list = field(compare=False)
    tag: tuple[int, int] = field(compare=False)  # (key, round): what the receipt names
    size: int = field(compare=False)


class Outbox:
    """The pushes held back for credit, per server, and the bytes each server has not yet
    acknowledged. ``window`` 0: no window, every push leaves at once (and asks no receipt).
    The engine thread's own."""

    def __init__(self, window: int) -> None:
        self.window = window
        self._queues: dict[int, list[_Entry]] = {}
        self._unacked: dict[int, int] = {}  # server -> bytes sent and not yet received
        self._sent: dict[tuple[int, tuple[int, int]], int] = {}  # (server, tag) -> bytes
        self._seq = itertools.count()

    @property
    def held(self) -> int:
        """How many pushes wait for credit."""
        return sum(map(len, self._queues.values()))

    def post(self, server: int, priority: int, frames: list, tag: tuple[int, int], size: int,
             send: Send) -> None:
        """Send ``frames`` (``size`` bytes) to ``server`` now, or once there is credit and no
        push of a lower ``priority`` waits for that server."""
        if not self.window:
            send(server, frames)
            return
        heapq.heappush(self._queues.setdefault(server, []), _Entry(priority, next(self._seq),
                                                                  frames, tag, size))
        self._flush(server, send)

    def received(self, server: int, tag: tuple[int, int], send: Send) -> None:
        """``server`` has received the push ``tag`` (or answered or refused it): its bytes
        are credit again. A second call for the same push changes nothing."""
        size = self._sent.pop((server, tag), None)
        if size is not None:
            self._unacked[server] -= size
            self._flush(server, send)

    def resize(self, window: int, send: Send) -> None:
        """A new window of ``window`` bytes: what now fits leaves (everything held, for none)."""
        self.window = window
        for server in list(self._queues):
            self._flush(server, send, everything=not window)

    def send_all(self, send: Send) -> None:
        """Send everything held, in order, whatever the credit: something must follow every
        push queued before it (a finish, a request to the scheduler)."""
        for server in list(self._queues):
            self._flush(server, send, everything=True)

    def clear(self) -> None:
        """Forget every held push and every receipt awaited (the job re-formed, or ended)."""
        self._queues.clear()
        self._unacked.clear()
        self._sent.clear()

    def _flush(self, server: int, send: Send, everything: bool = False) -> None:
        queue = self._queues.get(server)
        while queue:
            unacked = self._unacked.get(server, 0)
            # one push always fits an empty window, however large
            if not everything and unacked and unacked + queue[0].size > self.window:
                return
            entry = heapq.heappop(queue)
            self._unacked[server] = unacked + entry.size
            self._sent[server, entry.tag] = entry.size
            send(server, entry.frames)
