"""A worker command that flaps under ``bpslaunch --restarts``: the restarts it is told to fail
exit at once, before they register; every other start runs the command.

    python flapping_worker.py STARTS FAIL -- CMD [ARGS...]

STARTS: a file every start appends its ``DMLC_WORKER_ID`` to, which numbers the starts of each
worker (0: its first, 1: its first restart, ...; restarts of one worker never overlap). FAIL:
the comma-separated restart numbers that exit with status 1 without running CMD. CMD runs as a
child of this process (it dies with it), not in its place, so the worker that registers is not
the process bpslaunch started: bpslaunch must know its restarts by more than their pid.
"""
import os
import subprocess
import sys

from adtopk_ps.deathsig import guarded


def main() -> int:
    starts, fail, dashes, *command = sys.argv[1:]
    if dashes != "--" or not command:
        sys.exit("usage: flapping_worker.py STARTS FAIL -- CMD [ARGS...]")
    worker = os.environ["DMLC_WORKER_ID"]
    with open(starts, "a") as out:
        out.write(f"{worker}\n")
    with open(starts) as record:
        restart = record.read().split().count(worker) - 1
    if str(restart) in fail.split(","):
        print(f"worker {worker}: restart {restart} fails before it registers", flush=True)
        return 1
    code = subprocess.run(guarded(command)).returncode
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(main())
