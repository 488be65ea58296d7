"""What the test programs print, the same way in each: a line per worker, and parameter digests
to compare across workers and runs."""
import hashlib

import adtopk_ps.torch as bps


def say(text: str) -> None:
    print(f"worker {bps.rank()}: {text}", flush=True)


def digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]
