"""What a worker sent each server and has no answer for yet, sent again when the
connection comes back (ps-lite's Resender, ``PS_RESEND``).

zmq reconnects a closed connection by itself: a NAT or load-balancer entry that
expired, a conntrack flush, a link that dropped everything for longer than the
heartbeat timeout. Whatever was in the kernel's buffers then is gone, and a
round would wait for a push that never comes. So every push is kept until its
answer (or an error naming it) comes back, and after a reconnect every one still
unanswered is sent again; the server drops a push it already holds, and answers
again one whose round it has already answered (``server/service.py``).

A message sent again asks the server for a receipt. A link that drops large
packets but passes small ones (an MTU black hole) closes again and again, the
heartbeats getting through while the same large message never does: one sent
again after a reconnect, with neither its receipt nor its answer by the next,
names the link, not a hung worker.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import msgpack


class LinkDropsLargeMessages(RuntimeError):
    """A worker-server link that closes whenever a message of some size is on it."""


@dataclass
class _Link:
    unanswered: dict[tuple[int, int], tuple[list, int]] = field(default_factory=dict)
    resent: set[tuple[int, int]] = field(default_factory=set)  # at the last reconnect, no receipt yet
    again: set[tuple[int, int]] = field(default_factory=set)  # sent again, not answered yet
    # key -> the round of its last push that was sent again and answered: a second answer of
    # it may still come (the original and the copy both reached the server)
    answered_once: dict[int, int] = field(default_factory=dict)
    reconnected_at: float | None = None  # the last reconnect


class Resender:
    """The unanswered messages to each server of one membership.

    Example::

        resend = Resender()
        resend.sent(0, key=7, round=3, frames=frames, size=4096)
        resend.answered(0, key=7, round=3)           # its result or error came
        for frames in resend.reconnected(1, "worker 0", "server 1"):
            send(sockets[1], frames)
    """

    def __init__(self, heartbeat_timeout: float = 0.0) -> None:
        self.links: dict[int, _Link] = {}  # by server, from its first message
        self.resent_total = 0
        # a black hole closes the connection a heartbeat timeout after the lost message was
        # sent: the far side hears nothing more of it (its pings wait behind that message)
        self.heartbeat_timeout = heartbeat_timeout

    def sent(self, server: int, key: int, round: int, frames: list, size: int) -> None:
        """Keep a push until its answer comes."""
        self.links.setdefault(server, _Link()).unanswered[(key, round)] = (frames, size)

    def answered(self, server: int, key: int, round: int) -> bool:
        """Its answer (or an error naming it) came: nothing to send again. False for the
        second answer of a push sent again (the first was still on its way): one to drop."""
        link, tag = self.links.setdefault(server, _Link()), (key, round)
        if link.unanswered.pop(tag, None) is None:
            if link.answered_once.get(key) == round:
                del link.answered_once[key]
                return False
            return True
        link.resent.discard(tag)
        if tag in link.again:
            link.again.discard(tag)
            link.answered_once[key] = round
        return True

    def received(self, server: int, key: int, round: int) -> None:
        """The server says it holds the push: it crossed the link (its answer may wait for
        the other workers' pushes)."""
        self.links.setdefault(server, _Link()).resent.discard((key, round))

    def reconnected(self, server: int, worker: str, peer: str) -> list[list]:
        """The connection to ``server`` came back: the messages to send again, oldest first.
        Raises :class:`LinkDropsLargeMessages` when one sent again at the last reconnect is
        still unanswered: the link passed the heartbeats and lost it again."""
        link = self.links.setdefault(server, _Link())
        now = time.monotonic()
        lost_again = [link.unanswered[k][1] for k in link.resent if k in link.unanswered]
        took = 0.0 if link.reconnected_at is None else now - link.reconnected_at
        link.reconnected_at = now
        if lost_again and took >= self.heartbeat_timeout / 2:
            raise LinkDropsLargeMessages(
                f"{worker} -> {peer}: messages are not delivered: what was sent again when the "
                f"connection came back ({len(lost_again)} message(s), the largest "
                f"{max(lost_again)} bytes) was lost again, the connection closing {took:.1f} s "
                f"later while the heartbeats got through (a link that drops large packets: an "
                f"MTU black hole?)")
        link.resent = set(link.unanswered)
        link.again |= set(link.unanswered)
        self.resent_total += len(link.unanswered)
        return [with_receipt(frames) for frames, _ in link.unanswered.values()]


def with_receipt(frames: list) -> list:
    """A message's frames, its header asking the server for a receipt."""
    header = msgpack.unpackb(bytes(frames[0]))
    return [msgpack.packb({**header, "ack": True}), *frames[1:]]
