"""Random-k positions from a shared seed, drawn on any device with the same result.

Workers draw positions on the device their gradients live on, the servers draw
them on the CPU, and all must agree bit for bit, so the draw cannot use
``torch.Generator`` (its streams differ between CPU and CUDA). Instead the
``k`` positions come from a keyed counter hash computed with exact integer
arithmetic:

* ``[0, numel)`` is cut into ``k`` strata, stratum ``i`` being
  ``[floor(i*numel/k), floor((i+1)*numel/k))``;
* stratum ``i`` contributes one position, at offset
  ``floor(h_i * size_i / 2**32)`` where ``h_i = lowbias32(lowbias32(i ^ key0) ^ key1)``
  and ``key0``/``key1`` are the two halves of ``splitmix64(seed)``.

That gives exactly ``k`` distinct positions, in increasing order, from O(k)
work with no sort, and each entry is picked with probability ``k/numel``
(within one part in ``numel // k`` where ``k`` does not divide ``numel``).
On CUDA one Triton launch draws them (and, for a compressor, gathers the
values); elsewhere the same arithmetic runs as int64 torch operations, every
intermediate below 2**63, so no result depends on overflow behaviour.
"""
from __future__ import annotations

import contextlib
import functools
import zlib

import torch

_M32 = 0xFFFFFFFF
_M64 = 0xFFFFFFFFFFFFFFFF
#: bounds under which every intermediate of the torch and Triton paths is exact
MAX_K = 1 << 31
MAX_NUMEL = 1 << 47
_BLOCK = 1024


def seed_for(name: str, step: int, base: int = 0) -> int:
    """A seed that every process derives identically from a tensor name and step."""
    return (zlib.crc32(f"{name}:{step}".encode()) ^ (base * 0x9E3779B1)) & 0x7FFFFFFF


def seed_keys(seed: int) -> tuple[int, int]:
    """The two 32-bit keys of ``seed``: the low and high halves of splitmix64(seed)."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= _M64:
        raise ValueError(f"seed must be an integer in [0, 2**64), got {seed!r}")
    z = (seed + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    z ^= z >> 31
    return z & _M32, z >> 32


def seeded_indices(seed: int, numel: int, k: int, device: torch.device | str) -> torch.Tensor:
    """``k`` distinct positions in ``[0, numel)``, increasing, drawn from ``seed`` on ``device``.

    Every worker and server draws the same positions for the same seed on any
    device, which is why random-k sends no indices.

    Example::

        positions = seeded_indices(seed_for("fc.weight", step), grad.numel(), k, grad.device)
        values = grad.reshape(-1)[positions]  # all a random-k payload carries
    """
    keys = _check(seed, numel, k)
    device = torch.device(device)
    if k == 0:
        return torch.empty(0, dtype=torch.int64, device=device)
    if device.type == "cuda" and _kernel() is not None:
        out = torch.empty(k, dtype=torch.int64, device=device)
        return _launch(out, out, numel, k, keys, gather=False)
    return _torch_positions(numel, k, keys, device)


def seeded_values(seed: int, flat: torch.Tensor, k: int) -> torch.Tensor:
    """``flat[seeded_indices(seed, flat.numel(), k, flat.device)]``, in one launch on CUDA."""
    keys = _check(seed, flat.numel(), k)
    if k > 0 and flat.device.type == "cuda" and _kernel() is not None:
        out = torch.empty(k, dtype=flat.dtype, device=flat.device)
        return _launch(flat.contiguous(), out, flat.numel(), k, keys, gather=True)
    return flat[seeded_indices(seed, flat.numel(), k, flat.device)]


def _check(seed: int, numel: int, k: int) -> tuple[int, int]:
    if not 0 <= numel < MAX_NUMEL:
        raise ValueError(f"numel {numel} outside [0, 2**47)")
    if not 0 <= k <= min(numel, MAX_K):
        raise ValueError(f"k {k} outside [0, {min(numel, MAX_K)}] for {numel} elements")
    return seed_keys(seed)


def _lowbias32(x: torch.Tensor) -> torch.Tensor:
    """Chris Wellons' lowbias32 on int64 holding 32-bit values, in place, exactly."""
    x ^= x >> 16
    x *= 0x7FEB352D
    x &= _M32
    x ^= x >> 15
    # 0x846CA68B = 2**31 + 0x046CA68B; modulo 2**32 the 2**31 part keeps only x's low bit
    odd = (x & 1) << 31
    x *= 0x046CA68B
    x += odd
    x &= _M32
    x ^= x >> 16
    return x


def _torch_positions(numel: int, k: int, keys: tuple[int, int], device: torch.device) -> torch.Tensor:
    stride, extra = divmod(numel, k)
    i = torch.arange(k + 1, dtype=torch.int64, device=device)
    bounds = i * stride
    if extra:
        bounds += i * extra // k
    size = bounds[1:] - bounds[:-1] if extra else stride
    h = i[:k] ^ keys[0]
    _lowbias32(h)
    h ^= keys[1]
    _lowbias32(h)
    if stride + 1 < 1 << 31:
        h *= size
        h >>= 32
    else:  # h * size could pass 2**63: floor(h*size / 2**32) from h's 16-bit halves
        h = ((h >> 16) * size + ((h & 0xFFFF) * size >> 16)) >> 16
    return h.add_(bounds[:-1])


def _launch(src: torch.Tensor, out: torch.Tensor, numel: int, k: int, keys: tuple[int, int],
            gather: bool) -> torch.Tensor:
    stride, extra = divmod(numel, k)
    grid = ((k + _BLOCK - 1) // _BLOCK,)
    with torch.cuda.device(out.device) if out.is_cuda else contextlib.nullcontext():
        _kernel()[grid](src, out, k, stride, extra, keys[0], keys[1], GATHER=gather, BLOCK=_BLOCK,
                        enable_fp_fusion=True)  # Triton's default, stated: left unstated, Triton 3.9 warns
    return out


@functools.cache
def _kernel():
    """The Triton kernel, built on first use (servers on CPU never import Triton); None without it."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit(do_not_specialize=["k", "stride", "extra", "key0", "key1"])
    def seeded_kernel(src, out, k, stride, extra, key0, key1,
                      GATHER: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        live = i < k
        start = i * stride + i * extra // k
        size = (i + 1) * stride + (i + 1) * extra // k - start
        zero = tl.zeros([BLOCK], dtype=tl.int64)
        x = i.to(tl.uint32) ^ (zero + key0).to(tl.uint32)
        for r in tl.static_range(2):  # lowbias32, key1, lowbias32; uint32 arithmetic wraps
            x ^= x >> 16
            x *= 0x7FEB352D
            x ^= x >> 15
            x *= 0x846CA68B
            x ^= x >> 16
            if r == 0:
                x ^= (zero + key1).to(tl.uint32)
        h = x.to(tl.int64)
        pos = start + (((h >> 16) * size + ((h & 0xFFFF) * size >> 16)) >> 16)
        if GATHER:
            tl.store(out + i, tl.load(src + pos, mask=live), mask=live)
        else:
            tl.store(out + i, pos, mask=live)

    return seeded_kernel
