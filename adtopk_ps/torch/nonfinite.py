"""What a step does when some worker's gradient held a NaN or an infinity.

Each worker's compressor finds them where it reads the gradient anyway
(a top-k selection puts them first); its push says so, and the server's
answer lists the flagging ranks, the same list to every worker. Dense
tensors all-reduced among the workers show it in their average, which is
the same on every worker too. So every worker decides alike:
``nonfinite="stop"`` (the default) ends the job on every worker, naming the
workers, tensors and step; ``"skip"`` drops the step on every worker (no
parameter moves, as mixed-precision training's GradScaler does), warns, and
forgets the error-feedback residuals of those tensors, which would otherwise
send the NaN again.
"""
from __future__ import annotations

import logging
from typing import Callable

from adtopk_ps.compression import Compressor
from adtopk_ps.torch.pending import Pending

POLICIES = ("stop", "skip")
MAX_SKIPS_IN_A_ROW = 10  # then the parameters themselves are the likely source: no skip helps
log = logging.getLogger("adtopk_ps.torch")


class NonFiniteGradient(RuntimeError):
    """Some worker's gradient held a NaN or an infinity, under ``nonfinite="stop"``."""


def check_policy(policy: object) -> str:
    """``policy`` if it is ``"stop"`` or ``"skip"``; anything else raises ``ValueError``."""
    if policy not in POLICIES:
        raise ValueError(f"nonfinite must be one of {list(POLICIES)}, got {policy!r}")
    return policy


class NonFiniteGuard:
    """One optimizer's policy, and what the step it last synchronized found."""

    def __init__(self, policy: str = "stop"):
        self.policy = check_policy(policy)
        self.found: dict[str, list[int]] = {}  # tensor (or bucket) -> flagging ranks
        self.step = 0
        self.skipped = 0  # steps skipped so far
        self.in_a_row = 0  # steps skipped since the last finite one

    def inspect(self, waited: list[tuple[str, Pending]], step: int, rank: int,
                members: Callable[[str], list[str]]) -> None:
        """Look at one step's answered averages (every worker lists the same names in one
        order); under "stop" raise if any was non-finite. ``members``: the tensors a
        bucket's name stands for (none for a tensor)."""
        found = {name: pending.flagging_ranks() for name, pending in waited if pending.nonfinite}
        self.found, self.step = found, step
        if not found:
            self.in_a_row = 0
        if found and self.policy == "stop":
            raise NonFiniteGradient(
                f"worker {rank}: {self.describe(members)}; stopping (nonfinite='stop'; "
                f"nonfinite='skip' would skip such steps)")

    def describe(self, members: Callable[[str], list[str]]) -> str:
        """One line naming each tensor with a NaN or infinity and the workers it came from."""
        parts = []
        for name, ranks in self.found.items():
            inside = members(name)
            label = f"{name!r}" + (f" (holding {', '.join(inside)})" if inside else "")
            source = f"from worker(s) {ranks}" if ranks else \
                "from no single worker (the sum overflowed)"
            parts.append(f"{label} {source}")
        return f"non-finite gradient (NaN or infinity) at step {self.step}: " + "; ".join(parts)

    def skip(self, rank: int, compressor: Compressor | None,
             members: Callable[[str], list[str]]) -> None:
        """The found step is dropped: warn, and forget the residuals that took it."""
        log.warning("worker %d: %s; step skipped (nonfinite='skip')", rank, self.describe(members))
        if compressor is not None:
            compressor.forget(self.found)
        self.skipped += 1
        self.in_a_row += 1
        if self.in_a_row >= MAX_SKIPS_IN_A_ROW:
            raise NonFiniteGradient(
                f"worker {rank}: {self.in_a_row} steps in a row skipped, the last for a "
                f"{self.describe(members)}; the parameters or the learning rate are the likely "
                f"source, which skipping cannot mend; stopping")
        self.found = {}
