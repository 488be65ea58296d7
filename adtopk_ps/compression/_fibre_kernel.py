"""The Triton kernel behind :mod:`adtopk_ps.compression.fibre_triton` (imports triton).

A program reads its tensor's row of the table, takes ``FB`` fibres of it as
a tile ``[FB, G, MB]`` (position ``r*m + c`` at row r, column c) plus a tail
``[FB, TB]`` (positions ``g*m + t``), and writes values, positions, the
updated residual and one flag byte (a selected NaN or infinity).
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _sum2(x):
    return tl.sum(tl.sum(x, 2), 1)


@triton.jit
def _order_rank(sel, tail_sel, by_group):
    """How many selected entries come before each entry in the scan order: column-major over
    the tile where ``by_group`` (the group scan), row-major (position order) elsewhere, the
    tail after either."""
    s = sel.to(tl.int32)
    col = tl.sum(s, 1)
    rank_g = (tl.cumsum(col, 1) - col)[:, None, :] + tl.cumsum(s, 1) - s
    row = tl.sum(s, 2)
    rank_p = (tl.cumsum(row, 1) - row)[:, :, None] + tl.cumsum(s, 2) - s
    rank = tl.where(by_group[:, None, None], rank_g, rank_p)
    t = tail_sel.to(tl.int32)
    tail_rank = tl.sum(row, 1)[:, None] + tl.cumsum(t, 1) - t
    return rank, tail_rank


@triton.jit
def _magnitude(x, BITS: tl.constexpr):
    """The bits of |x|, an integer that orders like |x| (a NaN's is above an infinity's);
    read from the bits, since the interpreter compares 16-bit floats by their bits."""
    if BITS == 31:
        bits = x.to(tl.int32, bitcast=True)
    else:
        bits = x.to(tl.int16, bitcast=True).to(tl.int32)
    return bits & ((1 << BITS) - 1)


@triton.jit
def _key(magnitude, valid, INF_KEY: tl.constexpr):
    """The selection key: |x| with a NaN as an infinity; -1 where not valid."""
    return tl.where(valid, tl.minimum(magnitude, INF_KEY), -1)


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
def _load(x_ptr, g_ptr, x_at, g_at, valid, DT: tl.constexpr, FEEDBACK: tl.constexpr):
    """The entries at ``x_at`` (0 where not ``valid``); with feedback, plus the gradient's at
    ``g_at``."""
    x = tl.load(x_ptr + x_at, mask=valid, other=0.0)
    if FEEDBACK:
        grad = tl.load(g_ptr + g_at, mask=valid, other=0.0)
        x = _add(x, grad, DT)
    return x


@triton.jit
def _select_small(key, pos, valid, tvalid, t2, k, n):
    """k <= 2 and k < n (no tail): the largest, then the next, lower positions first.
    (selected, slot) of the tile, then of the (empty) tail."""
    best = tl.max(tl.max(key, 2), 1)
    p0 = tl.min(tl.min(tl.where(key == best[:, None, None], pos, n), 2), 1)
    first_sel = pos == p0[:, None, None]
    key2 = tl.where(first_sel, -1, key)
    best2 = tl.max(tl.max(key2, 2), 1)
    p1 = tl.min(tl.min(tl.where(key2 == best2[:, None, None], pos, n), 2), 1)
    p1 = tl.where(k >= 2, p1, -1)  # k = 1: no second
    second_sel = pos == p1[:, None, None]
    sel = (first_sel | second_sel) & valid
    slot = tl.where(first_sel, 0, 1)
    return sel, slot, tvalid, t2 * 0


@triton.jit
def _kth_key(key, tkey, k, BITS: tl.constexpr, FB: tl.constexpr):
    """The k-th largest key, bit by bit from the top: the largest T with count(key >= T) >= k."""
    kth = tl.zeros([FB], dtype=tl.int32)
    for i in tl.static_range(BITS):
        cand = kth | (1 << (BITS - 1 - i))
        count = _sum2((key >= cand[:, None, None]).to(tl.int32)) + \
            tl.sum((tkey >= cand[:, None]).to(tl.int32), 1)
        kth = tl.where(count >= k, cand, kth)
    return kth


@triton.jit
def _select_top(key, tkey, magnitude, valid, tvalid, k, g, BITS: tl.constexpr,
                INF_KEY: tl.constexpr, FB: tl.constexpr):
    """The k largest keys of each fibre, in the group scan's order where the tile has groups
    and no NaN, else in position order. (selected, slot) of the tile, then of the tail."""
    kth = _kth_key(key, tkey, k, BITS, FB)
    kth3, kth2 = kth[:, None, None], kth[:, None]
    above, tabove = key > kth3, tkey > kth2
    need = k - (_sum2(above.to(tl.int32)) + tl.sum(tabove.to(tl.int32), 1))
    nans = _sum2(((magnitude > INF_KEY) & valid).to(tl.int32))
    by_group = (g > 1) & (nans == 0)
    # where the k-th largest group maximum is the k-th largest entry (fewer than k entries
    # above it), the entries equal to it fill in by position, after those above
    fill = by_group & (tl.sum((tl.max(key, 1) >= kth[:, None]).to(tl.int32), 1) >= k)
    tie, ttie = key == kth3, tkey == kth2
    tie_rank, ttie_rank = _order_rank(tie, ttie, by_group & ~fill)
    sel = above | (tie & (tie_rank < need[:, None, None]))
    tsel = tabove | (ttie & (ttie_rank < need[:, None]))
    sel = sel & valid
    tsel = tsel & tvalid
    slot, tslot = _order_rank(sel, tsel, by_group)
    above_slot, tabove_slot = _order_rank(above & valid, tabove & tvalid, by_group)
    fill_at = k - need
    slot = tl.where(fill[:, None, None], tl.where(above, above_slot, fill_at[:, None, None] + tie_rank), slot)
    tslot = tl.where(fill[:, None], tl.where(tabove, tabove_slot, fill_at[:, None] + ttie_rank), tslot)
    return sel, slot, tsel, tslot


@triton.jit
def _store(v_ptr, i_ptr, x, pos, sel, out_at, IDT: tl.constexpr):
    """The selected entries' values and positions, to ``out_at``."""
    tl.store(v_ptr + out_at, x, mask=sel)
    tl.store(i_ptr + out_at, pos.to(IDT), mask=sel)


@triton.jit
def kernel(table, owners_at, flags, DT: tl.constexpr, IDT: tl.constexpr, BITS: tl.constexpr,
           INF_KEY: tl.constexpr, FB: tl.constexpr, G: tl.constexpr, MB: tl.constexpr,
           TB: tl.constexpr, SMALL: tl.constexpr, FEEDBACK: tl.constexpr, W: tl.constexpr):
    """The Triton program for one tile of fibres: compensate, select each fibre's top k by bisection, write values and positions, update the residual (see fibre_triton.py)."""
    pid = tl.program_id(0)
    row = table + tl.load(table + owners_at + pid) * W
    x_ptr = tl.load(row + 0).to(tl.pointer_type(DT))
    g_ptr = tl.load(row + 1).to(tl.pointer_type(DT))
    v_ptr = tl.load(row + 2).to(tl.pointer_type(DT))
    i_ptr = tl.load(row + 3).to(tl.pointer_type(IDT))
    n, k = tl.load(row + 4), tl.load(row + 5)
    R = tl.load(row + 6)
    fibres = tl.load(row + 7)
    g = tl.load(row + 8)
    m = tl.load(row + 9)
    sxa = tl.load(row + 10)
    sxn = tl.load(row + 11)
    sxr = tl.load(row + 12)
    sga = tl.load(row + 13)
    sgn = tl.load(row + 14)
    sgr = tl.load(row + 15)
    first = tl.load(row + 16)

    f = (pid - first) * FB + tl.arange(0, FB).to(tl.int64)
    live = f < fibres
    a, j = f // R, f % R

    # the grouped tile
    r3 = tl.arange(0, G).to(tl.int64)[None, :, None]
    c3 = tl.arange(0, MB).to(tl.int64)[None, None, :]
    a3, j3, live3 = a[:, None, None], j[:, None, None], live[:, None, None]
    pos = r3 * m + c3
    valid = live3 & (r3 < g) & (c3 < m)
    x_at = a3 * sxa + pos * sxn + j3 * sxr
    x = _load(x_ptr, g_ptr, x_at, a3 * sga + pos * sgn + j3 * sgr, valid, DT, FEEDBACK)
    magnitude = _magnitude(x, BITS)
    key = _key(magnitude, valid, INF_KEY)

    # the tail: positions g*m .. n-1
    t2 = tl.arange(0, TB).to(tl.int64)[None, :]
    a2, j2 = a[:, None], j[:, None]
    tpos = g * m + t2
    tvalid = live[:, None] & (tpos < n)
    tx_at = a2 * sxa + tpos * sxn + j2 * sxr
    tx = _load(x_ptr, g_ptr, tx_at, a2 * sga + tpos * sgn + j2 * sgr, tvalid, DT, FEEDBACK)
    tkey = _key(_magnitude(tx, BITS), tvalid, INF_KEY)

    if SMALL:
        sel, slot, tsel, tslot = _select_small(key, pos, valid, tvalid, t2, k, n)
    else:
        sel, slot, tsel, tslot = _select_top(key, tkey, magnitude, valid, tvalid, k, g, BITS, INF_KEY, FB)

    _store(v_ptr, i_ptr, x, pos, sel, a3 * k * R + slot * R + j3, IDT)
    _store(v_ptr, i_ptr, tx, tpos, tsel, a2 * k * R + tslot * R + j2, IDT)
    if FEEDBACK:  # the residual: zero where selected
        tl.store(x_ptr + x_at, tl.where(sel, 0.0, x), mask=valid)
        tl.store(x_ptr + tx_at, tl.where(tsel, 0.0, tx), mask=tvalid)
    bad = _sum2((sel & (key >= INF_KEY)).to(tl.int32)) + \
        tl.sum((tsel & (tkey >= INF_KEY)).to(tl.int32), 1)
    tl.store(flags + pid, (tl.sum(bad, 0) > 0).to(tl.uint8))
