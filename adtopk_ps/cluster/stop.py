"""A role told to stop (SIGTERM from bpslaunch or Kubernetes, SIGINT from a terminal) ends
at once with one line and status 128+N, as a shell reports a death by signal N.

Being stopped is not an error, so it gets no traceback; and a role blocked in a socket
or a tensor operation must still end within its launcher's short grace.
"""
from __future__ import annotations

import os
import signal
import sys
from typing import Callable


def stop_quietly_on_signals(who: str, before: Callable[[], None] | None = None) -> None:
    """From now on SIGINT and SIGTERM end this process with one line naming ``who``;
    ``before`` runs first (to end a progress bar's line). Call it from the main thread.

    Example::

        stop_quietly_on_signals("scheduler")
    """
    def stop(signum: int, _frame) -> None:
        try:
            if before is not None:
                before()
            sys.stdout.flush()
            sys.stderr.flush()
        except Exception:  # noqa: BLE001 - interrupted mid-write; the line below still goes out
            pass
        os.write(2, f"{who}: stopped by {signal.Signals(signum).name}\n".encode())
        os._exit(128 + signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop)
