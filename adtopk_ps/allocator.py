"""Role processes keep the memory they free, instead of faulting it in again every step.

glibc serves large allocations with fresh pages from mmap and hands them back
on free (and trims the heap top the same way), so every training step
page-faults its activations, gradients and received frames anew. Raising
both thresholds (``GLIBC_TUNABLES``; the older ``MALLOC_*_`` variables did not
take effect for torch's allocations here) makes freed blocks reusable, so a
step does not fault its memory in again (``tests/test_allocator.py``
counts the faults). The price is that a process's resident memory stays at its
peak, as with torch's CUDA allocator. See docs/deployment.md.
"""
from __future__ import annotations

from typing import Mapping

from adtopk_ps.core.env import env_int

# above any single allocation a training process makes, so none goes to mmap
_THRESHOLD = str(1 << 32)
# glibc tunable -> the older variable that sets it too (the user's setting of either wins)
TUNABLES = {"glibc.malloc.mmap_threshold": "MALLOC_MMAP_THRESHOLD_",
            "glibc.malloc.trim_threshold": "MALLOC_TRIM_THRESHOLD_"}


def keep_freed_memory(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` with the allocator thresholds added to ``GLIBC_TUNABLES``, unless
    ``PS_KEEP_FREED_MEMORY=0``; thresholds the user set already are left as they are."""
    env = dict(environ)
    if env_int("PS_KEEP_FREED_MEMORY", 1, minimum=0, environ=env) == 0:
        return env
    given = [t for t in env.get("GLIBC_TUNABLES", "").split(":") if t]
    named = {t.split("=", 1)[0] for t in given}
    ours = [f"{name}={_THRESHOLD}" for name, legacy in TUNABLES.items()
            if name not in named and legacy not in env]
    if ours:
        env["GLIBC_TUNABLES"] = ":".join(given + ours)
    return env
