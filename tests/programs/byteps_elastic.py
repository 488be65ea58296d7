"""byteps' elastic suspend/resume in an elastic job (only the import changed): worker 2 of 3
ends at step 5; the others see the change in their next push_pull, suspend, resume in the
new shape (2 workers, 2 servers) and go on, their averages over the two of them. A resume to
a shape the job never takes times out, naming both."""
import os
import signal
import sys

import torch

import adtopk_ps.torch as bps


def main() -> int:
    bps.init()
    me = int(os.environ["DMLC_WORKER_ID"])
    step = 0
    while step < 12:
        if me == 2 and step == 5:
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            got = bps.push_pull(torch.full((64,), float(me + 1)), name="grad").mean().item()
        except bps.elastic.HorovodInternalError as exc:
            print(f"worker {me}: {type(exc).__name__} at step {step}", flush=True)
            bps.suspend()
            bps.resume(2, 2)
            continue  # the step again, in the new shape
        print(f"worker {me}: step {step} of {bps.size()} average {got}", flush=True)
        step += 1
    bps.suspend()
    try:
        bps.resume(3, 2, timeout=1.0)
    except TimeoutError as exc:
        print(f"worker {me}: {exc}", flush=True)
    bps.resume(2, 2)
    print(f"worker {me}: done at rank {bps.rank()} of {bps.size()}", flush=True)
    bps.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
