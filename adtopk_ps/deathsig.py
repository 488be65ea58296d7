"""Runs a command that dies with the launcher that started it, however the launcher ends.

A launcher killed with SIGKILL runs no cleanup, and its role processes would
live on (a server still waiting for an address book keeps waiting for its
registration timeout). On Linux, ``PR_SET_PDEATHSIG`` makes the kernel send
SIGTERM to the command when its parent dies; it survives ``exec``, so this
module sets it and then becomes the command.

    python -m adtopk_ps.deathsig PARENT_PID CMD [ARGS...]
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
from typing import Sequence

_PR_SET_PDEATHSIG = 1


def guarded(argv: Sequence[str]) -> list[str]:
    """``argv`` wrapped so that it ends when this process does (unchanged off Linux)."""
    if not sys.platform.startswith("linux"):
        return list(argv)
    return [sys.executable, "-m", __name__, str(os.getpid()), *argv]


def main(args: Sequence[str]) -> None:
    """Run a command that dies with its parent (``python -m adtopk_ps.deathsig PID CMD ...``)."""
    if len(args) < 2 or not args[0].isdigit():
        sys.exit("usage: python -m adtopk_ps.deathsig PARENT_PID CMD [ARGS...]")
    parent, argv = int(args[0]), list(args[1:])
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM) != 0:
        sys.exit(f"deathsig: prctl failed: {os.strerror(ctypes.get_errno())}")
    if os.getppid() != parent:  # the parent died before the signal was armed
        sys.exit(f"deathsig: parent {parent} is gone; not starting {argv[0]}")
    try:
        os.execvp(argv[0], argv)
    except OSError as exc:
        sys.exit(f"deathsig: cannot run {argv[0]!r}: {exc}")


if __name__ == "__main__":
    main(sys.argv[1:])
