"""A node as the scheduler knows it: role, rank, address and when it was last heard from."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Node:
    """A registered server or worker, and when the scheduler last heard from it."""

    identity: bytes
    role: str
    rank: int
    address: str
    last_seen: float
    fd: int  # the connection its last message came on
    finished: bool = False
    closed_at: float | None = None  # when that connection closed, until another carries it
    started_as: int = -1  # its rank when the job formed (an elastic job renumbers workers)
    joined: int = -1  # the epoch it joined the running job in (an elastic job's)

    @property
    def label(self) -> str:
        """How messages name the node: role, rank (and the one it started as, where an elastic
        re-form changed it, or the epoch it joined in) and address."""
        was = f", started as {self.role} {self.started_as}" if self.started_as != self.rank else ""
        if self.joined >= 0:
            was = f", joined in epoch {self.joined}"
        elif self.rank < 0:
            was = ", joining"
        return f"{self.role} {self.rank}{was} ({self.address})" if self.rank >= 0 else \
            f"{self.role}{was} ({self.address})"
