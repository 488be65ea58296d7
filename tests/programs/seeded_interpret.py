"""Runs the random-k Triton kernel under Triton's interpreter on CPU tensors and checks it
against the torch path: positions and gathered values, on sizes that take both the direct
and the split offset arithmetic. Prints one line per case; exits non-zero on a mismatch."""
import os
import sys

import torch

from adtopk_ps.core import seeded

os.environ["TRITON_INTERPRET"] = "1"  # read when the kernel is built, on first use

CASES = [(0, 1, 1), (5, 1000, 10), (2**63 + 7, 12345, 777), (3, 5, 5), (2**64 - 1, 3000, 1),
         (11, 2**40 + 3, 3), (12, 70_001, 2_500), (13, 4097, 4096)]

if seeded._kernel() is None:
    sys.exit("triton is not importable")
for seed, numel, k in CASES:
    keys = seeded.seed_keys(seed)
    want = seeded._torch_positions(numel, k, keys, torch.device("cpu"))
    got = torch.empty(k, dtype=torch.int64)
    seeded._launch(got, got, numel, k, keys, gather=False)
    same = torch.equal(got, want)
    if numel <= 1 << 20:
        flat = torch.randn(numel, generator=torch.Generator().manual_seed(seed % 1000))
        vals = torch.empty(k, dtype=flat.dtype)
        seeded._launch(flat, vals, numel, k, keys, gather=True)
        same = same and torch.equal(vals, flat[want])
    print(f"seed={seed} numel={numel} k={k} {'same' if same else 'DIFFERENT'}", flush=True)
    if not same:
        sys.exit(1)
