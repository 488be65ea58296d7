"""How a role's process ends: told to stop (SIGTERM from bpslaunch or Kubernetes, SIGINT
from a terminal), at once with one line and status 128+N, as a shell reports a death by
signal N; done, as soon as its work is flushed.

Being stopped is not an error, so it gets no traceback; and a role blocked in a socket
or a tensor operation must still end within its launcher's short grace.
"""
from __future__ import annotations

import atexit
import logging
import os
import signal
import sys
import threading
from typing import Callable, NoReturn


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


def exit_when_done(status: int | None) -> NoReturn:
    """End a role's process that has finished its work, with ``status`` (None: 0).

    Python's own exit tears down every module and collects every object; after torch
    (and torch._dynamo, which torch's first optimizer imports) that takes seconds of CPU,
    during which the job's launcher still waits on the process. Everything that exit
    would do for the job's output is done here first, in its order: the threads that are
    not daemons are waited for, then the ``atexit`` functions run, the logging handlers
    and the standard streams are flushed; then the process ends without the teardown.
    Only for the roles' own entry points, never inside a user's script.

    Example::

        exit_when_done(main())   # instead of sys.exit(main())
    """
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can reach it
            pass
    os._exit(0 if status is None else status)


#: how long a worker's main thread has, once the job ended for it, to end the process
EXIT_GRACE_S = 5.0


def exit_unless_ended(why: str, status: int, grace: float) -> None:
    """The job ended for this process (``why``): end it with ``status`` unless its main thread
    does so within ``grace`` seconds. A training loop that hangs in its own code never calls
    into the cluster again to hear of it, and on a pod nobody would stop it. Armed only
    where the launcher says so (``PS_EXIT_GRACE_S``, which ``bpslaunch`` sets for the
    training command), never in a process that embeds a client (a test's).

    Example::

        exit_unless_ended("worker 1 lost", 1, 5.0)   # a daemon thread; returns at once
    """
    def watch() -> None:
        threading.Event().wait(grace)
        os.write(2, f"{why}; this process's main thread did not end it within {grace:.0f} s "
                    f"(PS_EXIT_GRACE_S): exiting\n".encode(errors="replace"))
        os._exit(status)

    threading.Thread(target=watch, name="adtopk-exit-grace", daemon=True).start()
