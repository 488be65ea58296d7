"""The rounds a worker has in flight and what answers them (ps-lite's Customer).

The engine (engine.py) moves frames; this keeps the book: each key's next round, the
partitions waiting for their answers (oldest round first), the fetches and put-backs of
server residuals waiting for the servers' word, and the ledger of bytes. It matches each
answer to what waits for it, writes the sum into the caller's output and names a server
that answers what nobody asked. Everything here runs on the engine thread.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from adtopk_ps import wire
from adtopk_ps.client.errors import PushPullError
from adtopk_ps.client.handle import Handle
from adtopk_ps.client.ledger import Ledger
from adtopk_ps.client.server_residuals import Replies
from adtopk_ps.cluster.transport import ClusterError
from adtopk_ps.compression import Compressor
from adtopk_ps.wire import Op


@dataclass
class Part:
    """One partition's push, waiting for its round's answer."""

    handle: Handle
    view: torch.Tensor  # where the answer goes
    round: int
    compressor: Compressor  # its ``restore`` runs on the answer
    name: str  # the partition's name, as the compressor knew it
    sparse: bool  # its push was (the answer's width is the union's)


class Customer:
    """What this worker waits for from the servers, by key.

    Example::

        customer = Customer(Ledger())
        rnd = customer.next_round(key)
        customer.sent(key, server, nbytes, Part(handle, out, rnd, compressor, "w#0", True))
        customer.on_result(server, wire.decode(frames), nbytes, workers=2)
    """

    def __init__(self, ledger: Ledger):
        self.ledger = ledger
        self.rounds: dict[int, int] = {}  # the next round of each key
        # by key, oldest round first. A key has two rounds in flight when a join() stand-in's
        # answer is still on its way as this worker pushes the next
        self.inflight: dict[int, deque[Part]] = {}
        self.fetching: dict[int, tuple[int, Replies]] = {}  # key -> (round asked, the fetch)
        self.restoring: dict[int, tuple[int, Replies]] = {}  # key -> (round, the put-back)

    def next_round(self, key: int) -> int:
        """The round this push of ``key`` is, counted from 0 since the last re-form."""
        rnd = self.rounds.get(key, 0)
        self.rounds[key] = rnd + 1
        return rnd

    def sent(self, key: int, server: int, size: int, part: Part) -> None:
        """``part``'s push of ``size`` bytes went to ``server``: its answer is awaited."""
        self.ledger.add_push(server, size)
        self.inflight.setdefault(key, deque()).append(part)

    def fetch(self, call: Replies) -> list[tuple[int, int]]:
        """The (key, round) of each residual ``call`` asks for, as of the key's next round."""
        asked = [(key, self.rounds.get(key, 0)) for key in list(call.waiting)]
        for key, rnd in asked:
            self.fetching[key] = (rnd, call)
        return asked

    def restore(self, residuals: dict[int, torch.Tensor],
                call: Replies) -> list[tuple[int, int, torch.Tensor]]:
        """The (key, round, residual) of each residual ``call`` puts back, before the key's
        next round."""
        put = [(key, self.rounds.get(key, 0), residual) for key, residual in residuals.items()]
        for key, rnd, _ in put:
            self.restoring[key] = (rnd, call)
        return put

    def names(self, keys: list[int]) -> list[str]:
        """The tensors whose partitions ``keys`` wait for answers, sorted."""
        return sorted({part.handle.name for key in keys for part in self.inflight.get(key, ())})

    def abandon(self) -> tuple[list[Handle], list[Replies]]:
        """Forget everything awaited (the engine ends, or the job re-formed): the handles and
        the residual calls to fail."""
        calls = [call for _, call in [*self.fetching.values(), *self.restoring.values()]]
        handles = [p.handle for waiting in self.inflight.values() for p in waiting]
        self.fetching.clear()
        self.restoring.clear()
        self.inflight.clear()
        return handles, calls

    def on_restored(self, server: int, msg: wire.Message) -> bool:
        """The server's word on a residual put back (``received``, or its refusal): True
        where ``msg`` is it. It comes before any word on this worker's pushes of the key
        (one connection keeps its order)."""
        asked = self.restoring.get(msg.key)
        if asked is None or asked[0] != msg.round or msg.op not in (Op.RECEIVED, Op.ERROR):
            return False
        del self.restoring[msg.key]
        if msg.op == Op.ERROR:
            asked[1].fail(PushPullError(f"server {server} refused the residual put back for key "
                                        f"{msg.key}: {msg.extra.get('message')}"))
        else:
            asked[1].answered(msg.key, None)
        return True

    def on_fetched(self, server: int, msg: wire.Message) -> bool:
        """A server's answer to a fetch (its residual, or its refusal): True where ``msg`` is one."""
        asked = self.fetching.get(msg.key)
        if asked is None or asked[0] != msg.round or msg.op not in (Op.RESIDUAL, Op.ERROR):
            return False
        if msg.op == Op.ERROR and any(p.round == msg.round for p in self.inflight.get(msg.key, ())):
            return False  # a refused push of the same round
        del self.fetching[msg.key]
        if msg.op == Op.ERROR:
            asked[1].fail(PushPullError(f"server {server} refused the residual of key {msg.key}: "
                                        f"{msg.extra.get('message')}"))
        else:
            held = msg.payload
            asked[1].answered(msg.key, None if held is None else
                              held.write_into(torch.empty(held.shape, dtype=held.dtype)))
        return True

    def on_result(self, server: int, msg: wire.Message, size: int, workers: int) -> None:
        """A push's answer of ``size`` bytes (its round's sum, or the server's refusal): into
        the waiting handle's output. Raises ``ClusterError`` for an answer nobody waits for,
        of the wrong shape, or flagging workers beyond the ``workers`` there are."""
        self.ledger.add_answer_bytes(server, size)
        waiting = self.inflight.get(msg.key)
        part = waiting.popleft() if waiting else None
        if waiting is not None and not waiting:
            del self.inflight[msg.key]
        if part is None or msg.round != part.round:
            raise ClusterError(f"server {server} answered key {msg.key} round {msg.round}, "
                               f"which this worker is not waiting for")
        if msg.op == Op.ERROR:
            part.handle.fail(PushPullError(f"server {server} refused key {msg.key} of "
                                            f"{part.handle.name!r}: {msg.extra.get('message')}"))
            return
        if msg.op != Op.RESULT or msg.payload.shape != tuple(part.view.shape):
            raise ClusterError(f"server {server} answered key {msg.key} with {msg.op} "
                               f"of the wrong shape")
        handle, payload = part.handle, msg.payload
        if part.sparse:
            self.ledger.add_width(payload.count, payload.numel)
        flagged = msg.extra.get("nonfinite", [])
        if flagged and flagged[-1] >= workers:
            raise ClusterError(f"server {server} flagged worker(s) {flagged} of key {msg.key}, "
                               f"beyond the {workers} workers")
        handle.flagged.update(flagged)
        if handle.parts == 1 and not handle.out_given and payload.codec == "dense" \
                and payload.values.dtype == handle.out.dtype and handle.out.device.type == "cpu":
            handle.out = payload.values.view(handle.out.shape)  # the received frame, no copy
            if handle.divisor != 1:
                handle.out.div_(handle.divisor)
            part.compressor.restore(handle.out, part.name)
        else:
            payload.write_into(part.view, handle.divisor)
            part.compressor.restore(part.view, part.name)
        handle.part_done()
