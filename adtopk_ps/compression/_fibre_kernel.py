"""The Triton kernel behind :mod:`adtopk_ps.compression.fibre_triton` (imports triton).

A program reads its tensor's row of the table and takes ``FB`` whole fibres of it. A fibre
is ``SEG`` segments of ``BS`` positions (the fewest that cover it with little padding: 768
is 3 x 256), each segment a tile [RUNS // VEC, FB, BS // RUNS, VEC] in which a thread holds
``RUNS`` adjacent positions of one fibre, one key a position, in registers. It

1. loads the fibres once (with error feedback: ``x = residual + grad``, stored back at
   once, so that ``x`` need not stay in registers);
2. finds each fibre's k-th largest key by bisection on its bits, one loop of ``BITS``
   steps, each a subtract and a shifted add an entry, summed in the thread and then across
   the fibre's threads once (RTop-K's threshold search);
3. takes every entry above that key and the first of those equal to it by position, and
   gives each its slot by a packed count of the entries before it in position order (above
   in the low half, equal in the high half): within the thread, then one count a thread
   across threads, segment by segment, so that positions come out ascending;
4. reads back the few selected entries, writes their values and positions, zeroes them
   in the residual, sets the program's flag byte where one is a NaN or an infinity, and
   a byte a fibre where it selected a nonzero entry (the host leaves out dead rows).
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _key(x, valid, BITS: tl.constexpr, INF_KEY: tl.constexpr):
    """|x|'s bits, an integer that orders like |x|, with a NaN as an infinity; -1 where not
    ``valid``. Read from the bits, since the interpreter compares 16-bit floats by them."""
    if BITS == 31:
        bits = x.to(tl.int32, bitcast=True)
    else:
        bits = x.to(tl.uint16, bitcast=True).to(tl.int32)
    return tl.where(valid, tl.minimum(bits & ((1 << BITS) - 1), INF_KEY), -1)


@triton.jit
def _add(x, grad, DT: tl.constexpr):
    """``x + grad`` rounded to ``DT`` as torch rounds it: in float32, then to nearest even
    (done on the bits for bfloat16, whose cast the interpreter truncates). A NaN stays a NaN;
    its bits, like those of NaNs torch makes, are not part of the contract."""
    total = x.to(tl.float32) + grad.to(tl.float32)
    if DT == tl.bfloat16:
        bits = total.to(tl.int32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(total != total, 0x7FC0, rounded)
        return rounded.to(tl.int16).to(tl.bfloat16, bitcast=True)
    return total.to(DT)


@triton.jit
def _kth_key(keys, largest, k, FB: tl.constexpr, SEG: tl.constexpr, BS: tl.constexpr,
             BITS: tl.constexpr, ASM: tl.constexpr):
    """Each fibre's k-th largest key, bit by bit from the top: the largest T with
    count(key >= T) >= k (``SEG * BS`` positions, padding's key -1 among them), or a T
    that selects the same entries. A loop (not unrolled): its body is what a step costs.
    ``largest``: each fibre's largest key (float32 only).

    For float32 keys the loop ends early once every fibre of the program is settled: exactly
    k keys are at least its bound (the lower bits cannot change which entries are taken), or
    the bound is the fibre's ``largest`` key (no key lies above it; a fibre of zeros settles
    at once), or the fibre holds no key (past the tensor's end). Tied fibres take every step,
    as 16-bit keys, whose 15 steps their ties mostly take anyway, always do."""
    kth = tl.zeros([FB], dtype=tl.int32)
    if BITS == 31:
        settled = largest <= 0
        i = 0
        while (i < BITS) & (tl.min(settled.to(tl.int32), 0) == 0):
            at_least, cand = _step(keys, kth, i, SEG, BS, BITS, ASM)
            kth = tl.where(at_least >= k, cand, kth)
            settled = settled | (at_least == k) | (kth == largest)
            i += 1
    else:
        for i in tl.range(0, BITS, loop_unroll_factor=1):  # one body: the budget counts it BITS times
            at_least, cand = _step(keys, kth, i, SEG, BS, BITS, ASM)
            kth = tl.where(at_least >= k, cand, kth)
    return kth


@triton.jit
def _step(keys, kth, i, SEG: tl.constexpr, BS: tl.constexpr, BITS: tl.constexpr, ASM: tl.constexpr):
    """(how many keys are at least the candidate, the candidate): ``kth`` with bit i from
    the top set."""
    cand = kth | (1 << (BITS - 1 - i))
    at = _across(cand)
    below = _below(keys[0], at, ASM)
    for s in tl.static_range(1, SEG):
        below += _below(keys[s], at, ASM)
    return SEG * BS - _along(below), cand


@triton.jit
def _below(key, cand, ASM: tl.constexpr):
    """1 where ``key < cand``, else 0: the sign bit of their difference (keys and cand are
    below 2**31); in PTX where compiled, so that ptxas folds the shift into the sum's add
    (LLVM would turn it into a compare and a select)."""
    if ASM:
        below = tl.inline_asm_elementwise("{ .reg .b32 d; sub.s32 d, $1, $2; shr.u32 $0, d, 31; }",
                                          "=r,r,r", [key, cand + tl.zeros_like(key)], dtype=tl.int32,
                                          is_pure=True, pack=1)
    else:
        below = ((key - cand) >> 31) & 1
    return below


@triton.jit
def _along(x):
    """The sum of ``x`` (a segment's [R, FB, T, VEC] tile) along each fibre: one entry a
    fibre; a thread's own entries first, then across the fibre's T threads."""
    return tl.sum(tl.sum(tl.sum(x, 3), 0), 1)


@triton.jit
def _along_max(x):
    """The largest of ``x`` along each fibre (see :func:`_along`)."""
    return tl.max(tl.max(tl.max(x, 3), 0), 1)


@triton.jit
def _largest(keys, SEG: tl.constexpr):
    """Each fibre's largest key over its segments."""
    largest = _along_max(keys[0])
    for s in tl.static_range(1, SEG):
        largest = tl.maximum(largest, _along_max(keys[s]))
    return largest


@triton.jit
def _across(v):
    """``v`` (one entry a fibre) spread over the tile's positions."""
    return v[None, :, None, None]


@triton.jit
def _in_thread(x):
    """The sum of ``x`` over the entries before each among its thread's own (a [R, FB, T, VEC]
    tile: runs of VEC, then R of them)."""
    run = tl.sum(x, 3)
    return (tl.cumsum(x, 3) - x) + (tl.cumsum(run, 0) - run)[:, :, :, None]


@triton.jit
def _packed(key, kth):
    """1 for an entry above ``kth``, 1 << 16 for one equal to it, 0 below: one scan of it
    counts both, the entries above in the low half and the equal ones in the high half."""
    d = key - kth
    return tl.where(d > 0, 1, tl.where(d == 0, 1 << 16, 0))


@triton.jit
def _take(packed, before, need):
    """(selected, slot) from the packed counts before each entry: the entries above the k-th
    key and, of those equal to it, the first ``need`` by position; a selected entry's slot is
    how many selected entries come before it, so slots follow positions."""
    equal_before = before >> 16
    selected = (packed == 1) | ((packed != 0) & (equal_before < need))
    return selected, (before & 0xFFFF) + tl.minimum(equal_before, need)


@triton.jit
def _emit(x_ptrs, pos, selected, slot, v_row, i_row, R, IDT: tl.constexpr, BITS: tl.constexpr,
          FEEDBACK: tl.constexpr, ASM: tl.constexpr):
    """Write the selected entries' values and positions at their slots (a fibre's t-th at
    ``R * t`` from its row's start) and zero them in the residual."""
    chosen = tl.load(x_ptrs, mask=selected, other=0.0)  # this thread's own store, if any
    at = slot * R
    v_out, i_out = _across(v_row) + at, _across(i_row) + at
    if ASM:
        if BITS == 31:
            _scatter(v_out, chosen.to(tl.int32, bitcast=True), selected, 32)
        else:
            _scatter(v_out, chosen.to(tl.int16, bitcast=True).to(tl.int32), selected, 16)
        _scatter(i_out, pos + tl.zeros_like(slot), selected, IDT.primitive_bitwidth)
    else:
        tl.store(v_out, chosen, mask=selected)
        tl.store(i_out, (pos + tl.zeros_like(slot)).to(IDT), mask=selected)
    if FEEDBACK:  # what was sent leaves the residual exactly
        tl.store(x_ptrs, tl.zeros_like(chosen), mask=selected)


@triton.jit
def _fibre_ptrs(fibre, pos, stride, VEC: tl.constexpr):
    """Pointers to the tile's entries: each fibre's start plus ``pos`` times its stride; with
    ``VEC`` 4 (the host checked: adjacent, a 16-byte aligned tensor, n and the fibres' starts
    multiples of 4 entries) four at a time. The hints are in bytes: four entries."""
    if VEC == 4:
        ALIGN: tl.constexpr = 4 * (fibre.dtype.element_ty.primitive_bitwidth // 8)
        ptrs = _across(tl.multiple_of(fibre, ALIGN)) + pos
        ptrs = tl.max_contiguous(tl.multiple_of(ptrs, [1, 1, 1, ALIGN]), [1, 1, 1, 4])
    else:
        ptrs = _across(fibre) + pos * stride.to(tl.int32)
    return ptrs


@triton.jit
def _positions(s, BS: tl.constexpr, RUNS: tl.constexpr, VEC: tl.constexpr):
    """The positions of segment ``s``'s tile, [RUNS // VEC, 1, BS // RUNS, VEC]: thread t's
    entries ``s * BS + t * RUNS + r * VEC + (0..VEC-1)``."""
    return s * BS + tl.arange(0, RUNS // VEC)[:, None, None, None] * VEC + \
        tl.arange(0, BS // RUNS)[None, None, :, None] * RUNS + tl.arange(0, VEC)[None, None, None, :]


@triton.jit
def _scatter(ptrs, bits, mask, WIDTH: tl.constexpr):
    """A predicated store of the low ``WIDTH`` bits of each of ``bits`` (int32) to ``ptrs``,
    in the tile's own layout. ``tl.store`` would first move pointers, values and mask to a
    layout of one entry a thread, through shared memory, which costs more than the few
    stores themselves. The interpreter runs no PTX: the kernel uses ``tl.store`` there."""
    if WIDTH == 32:
        asm: tl.constexpr = "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p st.global.b32 [$1], $2; mov.b32 $0, 0; }"
    elif WIDTH == 16:
        asm: tl.constexpr = "{ .reg .pred p; .reg .b16 h; setp.ne.b32 p, $3, 0; cvt.u16.u32 h, $2; @p st.global.b16 [$1], h; mov.b32 $0, 0; }"
    else:
        asm: tl.constexpr = "{ .reg .pred p; .reg .b16 h; setp.ne.b32 p, $3, 0; cvt.u16.u32 h, $2; @p st.global.b8 [$1], h; mov.b32 $0, 0; }"
    tl.inline_asm_elementwise(asm, "=r,l,r,r", [ptrs.to(tl.int64, bitcast=True), bits, mask.to(tl.int32)],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def kernel(table, owners, owners_at, flags, DT: tl.constexpr, IDT: tl.constexpr, BITS: tl.constexpr,
           INF_KEY: tl.constexpr, FB: tl.constexpr, SEG: tl.constexpr, BS: tl.constexpr,
           RUNS: tl.constexpr, VEC: tl.constexpr, FEEDBACK: tl.constexpr, KEEP: tl.constexpr,
           ASM: tl.constexpr, W: tl.constexpr):
    """One program's fibres: compensate, select each fibre's top k, write values and
    positions, update the residual (see the module docstring and fibre_triton.py).

    ``VEC`` 4: fibres adjacent in memory, read four entries at a time; 1: strided fibres,
    whose neighbours in memory are other fibres (a warp's lanes take several side by side)."""
    pid = tl.program_id(0)
    row = table + tl.load(owners + owners_at + pid) * W
    x_ptr = tl.load(row + 0).to(tl.pointer_type(DT))
    g_ptr = tl.load(row + 1).to(tl.pointer_type(DT))
    v_ptr = tl.load(row + 2).to(tl.pointer_type(DT))
    i_ptr = tl.load(row + 3).to(tl.pointer_type(IDT))
    n, k, R, fibres = tl.load(row + 4), tl.load(row + 5), tl.load(row + 6), tl.load(row + 7)
    sxa, sxn, sxr = tl.load(row + 8), tl.load(row + 9), tl.load(row + 10)
    first = tl.load(row + 14)

    k, R = k.to(tl.int32), R.to(tl.int32)
    f = (pid - first).to(tl.int32) * FB + tl.arange(0, FB)
    a, j = (f // R).to(tl.int64), (f % R).to(tl.int64)
    if VEC == 4:
        n = tl.multiple_of(n, 4)
    live = _across(f < fibres)
    # each fibre's pointer in 64 bits, a position's offset from it in 32 (the host checks it fits)
    x_row = x_ptr + a * sxa + j * sxr
    if FEEDBACK:
        sga, sgn, sgr = tl.load(row + 11), tl.load(row + 12), tl.load(row + 13)
        g_row = g_ptr + a * sga + j * sgr
    if FEEDBACK and not KEEP:  # the sums first, read back below: their keys alone are held
        for s in tl.static_range(SEG):
            pos = _positions(s, BS, RUNS, VEC)
            valid = live & (pos < n)
            x_ptrs = _fibre_ptrs(x_row, pos, sxn, VEC)
            g_ptrs = _fibre_ptrs(g_row, pos, sgn, VEC)
            tl.store(x_ptrs, _add(tl.load(x_ptrs, mask=valid, other=0.0),
                                  tl.load(g_ptrs, mask=valid, other=0.0), DT), mask=valid)
        tl.debug_barrier()  # the reads below take these sums back
    keys = ()
    for s in tl.static_range(SEG):
        pos = _positions(s, BS, RUNS, VEC)
        valid = live & (pos < n)
        x_ptrs = _fibre_ptrs(x_row, pos, sxn, VEC)
        x = tl.load(x_ptrs, mask=valid, other=0.0)
        if FEEDBACK and KEEP:
            g_ptrs = _fibre_ptrs(g_row, pos, sgn, VEC)
            x = _add(x, tl.load(g_ptrs, mask=valid, other=0.0), DT)
            tl.store(x_ptrs, x, mask=valid)
        keys = keys + (_key(x, valid, BITS, INF_KEY),)
    if BITS == 31:  # float32's early exit reads each fibre's largest key
        largest = _largest(keys, SEG)
        kth_f = _kth_key(keys, largest, k, FB, SEG, BS, BITS, ASM)
    else:  # found after the loop, so that it holds no register through it
        kth_f = _kth_key(keys, tl.zeros([FB], dtype=tl.int32), k, FB, SEG, BS, BITS, ASM)
        largest = _largest(keys, SEG)
    bad = tl.max(largest, 0) >= INF_KEY  # the largest key is always selected (k >= 1)
    kth = _across(kth_f)
    # the entries above the k-th key, as SEG * BS less those below kth + 1 (the loop's count)
    at_most = _below(keys[0], kth + 1, ASM)
    for s in tl.static_range(1, SEG):
        at_most += _below(keys[s], kth + 1, ASM)
    above = SEG * BS - _along(at_most)
    need = _across(k - above)
    # a fibre selects a nonzero entry where its k-th key is one, or any entry is above it (all
    # of those are taken): a byte a fibre, from which the host leaves out the dead rows
    live_ptr = tl.load(row + 15).to(tl.pointer_type(tl.uint8))
    tl.store(live_ptr + f, ((kth_f > 0) | (above > 0)).to(tl.uint8), mask=f < fibres)
    v_row, i_row = v_ptr + (a * k * R + j), i_ptr + (a * k * R + j)
    seen = tl.zeros([FB], dtype=tl.int32)  # the packed counts of the segments before
    for s in tl.static_range(SEG):  # a segment at a time: positions ascend segment by segment
        pos = _positions(s, BS, RUNS, VEC)
        packed = _packed(keys[s], kth)
        thread = tl.sum(tl.sum(packed, 3), 0)
        before = _in_thread(packed) + (tl.cumsum(thread, 1) - thread + seen[:, None])[None, :, :, None]
        selected, slot = _take(packed, before, need)
        _emit(_fibre_ptrs(x_row, pos, sxn, VEC), pos, selected, slot, v_row, i_row, R, IDT, BITS,
              FEEDBACK, ASM)
        seen += tl.sum(thread, 1)
    tl.store(flags + pid, bad.to(tl.uint8))

