"""ADTopk's per-fibre top-k on CUDA as one Triton kernel, error feedback fused in.

One launch handles every tensor of a batch that shares a kernel variant (the
tile shape, dtype and feedback): a few launches for a whole model. A program
takes whole fibres into registers and, in one pass over memory, adds the
gradient into the residual, finds each fibre's k-th largest |x| by bisection
on the bits of |x| (RTop-K's row-wise threshold search, exact), selects the
entries above it and the first of those equal to it, writes their values and
narrowed positions into one device buffer, and zeroes them in the residual
(``_fibre_kernel.py``). :class:`~adtopk_ps.compression.staging.Stage` then
copies that buffer to reused pinned host memory on a side stream.

What it selects is select.py's rule, the CPU path's, so float32 payloads are
equal bit for bit:

- the k entries of largest |x|, a NaN counting as an infinity;
- among equal magnitudes, the lower positions first;
- positions written in ascending order, values in the same order;
- rows of the view whose selection is all zeros (dead units) left out.

The residual is ``r + g`` rounded to the tensor's dtype, as torch computes it.
Fibres longer than :data:`MAX_N` and views that cannot be read as ``[A, n, R]``
take select.py's torch path on the GPU. Triton is optional: :func:`applies` is
False where it cannot be imported, and the CPU path runs as before.
"""
from __future__ import annotations

import contextlib
import itertools
import math
import os
from dataclasses import dataclass, field
from functools import lru_cache
from typing import NamedTuple

import numpy as np
import torch

from adtopk_ps.compression.staging import Stage, aligned
from adtopk_ps.core.dtypes import index_dtype, wire_name

# bits of |x| below the sign, and the key of an infinity (a NaN's key is clipped to it)
_BITS = {torch.float32: 31, torch.float16: 15, torch.bfloat16: 15}
#: the wire's float dtypes (adtopk_ps/core/dtypes.py) this kernel selects in: all but float64
DTYPES = tuple(_BITS)
_INF_KEY = {torch.float32: 0x7F800000, torch.float16: 0x7C00, torch.bfloat16: 0x7F80}
#: the longest fibre a program holds in registers; longer ones take select.py's path
MAX_N = 32768
# keys a thread holds (fibres adjacent in memory, strided ones), the threads of one fibre at
# most (16 warps, which leave a thread 128 registers) and at least a program's
_KEYS, _STRIDED_KEYS = 32, 16
_MAX_THREADS, _MIN_WARPS = 512, 4
# segments: a fibre longer than _WHOLE is cut into the fewest (up to _MAX_SEG) segments of a
# power of two that pad it by at most 1/_PAD
_WHOLE, _MAX_SEG, _PAD = 128, 16, 8
_RUN_SEGMENT = 16
#: the kernel's runtime arguments, as triton.compile's ASTSource takes them
SIGNATURE = {"table": "*i64", "owners": "*i64", "owners_at": "i32", "flags": "*u8"}
# one row of the table per tensor: pointers, sizes, strides, its first program, its live bytes
_COLUMNS = 16
_TL_INDEX = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}  # int16: uint16's bits


@lru_cache(maxsize=1)
def _triton():
    """The triton modules and the compiled kernel, or None without triton."""
    try:
        import triton  # noqa: F401  (imported lazily: it is optional)
        import triton.language as tl
    except ImportError:
        return None
    from adtopk_ps.compression import _fibre_kernel
    return _fibre_kernel.kernel, tl


def interpreted() -> bool:
    """Whether Triton runs kernels in its interpreter (on CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


# CPU tensors take the kernel too (under Triton's interpreter): for tests of the wiring only,
# the CPU path is select.py's
CPU_TENSORS = False


@dataclass(frozen=True)
class Variant:
    """One compiled form of the kernel: what a launch's tensors share.

    Example::

        v = variant(n=1024, k=10, dtype=torch.float32, feedback=True)
        v.fb, v.bn, v.warps, v.runs   # 4 fibres of 1024 a program, 4 warps, 32 positions a thread
    """

    dtype: torch.dtype
    index_bytes: int
    feedback: bool
    fb: int  # fibres per program
    seg: int  # segments a fibre is cut into
    bs: int  # positions a segment: a power of two
    runs: int  # adjacent positions of a segment each thread holds
    warps: int
    contiguous: bool = True  # fibres adjacent in memory, read four entries at a time (_in_fours)

    @property
    def bn(self) -> int:
        """Positions a fibre takes, padding included."""
        return self.seg * self.bs

    @property
    def keeps_sums(self) -> bool:
        """With error feedback, whether each ``residual + grad`` stays in registers as it is
        made (float32, or up to :data:`_KEYS` keys a thread), or all are written first and
        read back (16-bit fibres of more keys a thread, where unpacking them beside the keys
        would spill)."""
        return self.dtype == torch.float32 or self.seg * self.runs <= _KEYS

    @property
    def loop_trips(self) -> int:
        """How many times the kernel's one loop, the bisection over the key's bits, runs."""
        return _BITS[self.dtype]

    def constants(self) -> dict:
        """The kernel's constexprs."""
        return dict(_constants(self, not interpreted()))


@lru_cache(maxsize=1024)
def _constants(v: Variant, asm: bool) -> dict:
    """:meth:`Variant.constants`, made once a variant (a launch's host work is counted in µs)."""
    tl = _triton()[1]
    return dict(DT=getattr(tl, wire_name(v.dtype)), IDT=getattr(tl, _TL_INDEX[v.index_bytes]),
                BITS=_BITS[v.dtype], INF_KEY=_INF_KEY[v.dtype], FB=v.fb, SEG=v.seg, BS=v.bs,
                RUNS=v.runs, VEC=4 if v.contiguous else 1, FEEDBACK=v.feedback, KEEP=v.keeps_sums,
                ASM=asm, W=_COLUMNS)


@lru_cache(maxsize=4096)
def variant(n: int, k: int, dtype: torch.dtype, feedback: bool, contiguous: bool = True) -> Variant | None:
    """The variant that selects ``k`` of fibres of length ``n`` (``contiguous``: whose
    positions are adjacent in memory); None where the kernel does not take them
    (select.py's path does).

    A fibre longer than :data:`_WHOLE` is cut into segments (:func:`segments`). In each, a
    thread holds ``runs`` adjacent positions, so that it holds about :data:`_KEYS` keys in
    all (:data:`_STRIDED_KEYS` for strided fibres, whose pointers take registers too), or
    more where a fibre would take more than :data:`_MAX_THREADS` threads; a program has at
    least :data:`_MIN_WARPS` warps, short fibres side by side.
    """
    if dtype not in DTYPES or not 1 <= k <= n or n > MAX_N:
        return None
    vec, keys = (4, _KEYS) if contiguous else (1, _STRIDED_KEYS)
    # a segment takes at least vec positions a thread: more segments than keys // vec only
    # where the fibre needs them to fit _MAX_THREADS threads
    seg, bs = segments(n, min(_MAX_SEG, max(keys // vec, -(-n // (_MAX_THREADS * vec)))))
    runs = min(bs, max(vec, _pow2_below(keys // seg), bs // _MAX_THREADS))
    if runs > _RUN_SEGMENT and bs // _MAX_THREADS <= _RUN_SEGMENT:  # the slots a few keys at a time
        seg, bs, runs = seg * runs // _RUN_SEGMENT, bs * _RUN_SEGMENT // runs, _RUN_SEGMENT
    fb = max(1, 32 * _MIN_WARPS * runs // bs)
    return Variant(dtype, index_dtype(n).itemsize, feedback, fb, seg, bs, runs, fb * bs // runs // 32,
                   contiguous)


def segments(n: int, most: int = _MAX_SEG) -> tuple[int, int]:
    """(segments, positions a segment) for a fibre of ``n``: one segment of the next power of
    two up to :data:`_WHOLE`, else the fewest segments (at most ``most``) of a power of two
    that pad ``n`` by at most 1/:data:`_PAD`, or where none does, the least padding.

    Example::

        segments(768), segments(3072), segments(25088), segments(1024)
        # (3, 256), (3, 1024), (13, 2048), (1, 1024)
    """
    whole = 1 << max(1, (n - 1).bit_length())
    if n <= _WHOLE:
        return 1, whole
    cuts = [(seg, 1 << (-(-n // seg) - 1).bit_length()) for seg in range(1, most + 1)]
    fit = [(seg, bs) for seg, bs in cuts if seg * bs * _PAD <= n * (_PAD + 1)]
    return fit[0] if fit else min(cuts, key=lambda cut: (cut[0] * cut[1], cut[0]))


def _pow2_below(x: int) -> int:
    return 1 << max(0, x.bit_length() - 1)


def _merged(shape: torch.Size, stride: tuple[int, ...]) -> tuple[int, int, int] | None:
    """The strides of a tensor seen as [A, n, R], its trailing axes merged as ``view`` merges
    them (axes of size 1 take any stride), or None where they do not merge without a copy.
    Computed from the sizes and strides: a view a tensor costs more than the rest of its
    host work."""
    inner, expect = 1, None
    for size, step in zip(reversed(shape[2:]), reversed(stride[2:])):
        if size == 1:
            continue
        if expect is None:
            inner = step
        elif step != expect:
            return None
        expect = step * size
    return stride[0], stride[1], inner


def applies(x: torch.Tensor, grad: torch.Tensor | None = None) -> bool:
    """Whether the kernel can select from ``x`` (with error feedback: ``x`` the residual,
    ``grad`` added into it): a CUDA tensor the kernel takes (:func:`refusal`), with triton
    importable."""
    return _kernel_device(x) and refusal(x, grad) is None


def _kernel_device(x: torch.Tensor) -> bool:
    """Whether ``x`` lies where the kernel runs, with triton importable (an empty tensor is
    left to select.py, which has nothing to search)."""
    kind = x.device.type
    return (kind == "cuda" or (CPU_TENSORS and kind == "cpu" and interpreted())) \
        and x.numel() > 0 and _triton() is not None


def refusal(x: torch.Tensor, grad: torch.Tensor | None = None) -> str | None:
    """Why the kernel cannot take ``x`` (and ``grad``), or None: its dtype, fewer than two
    dimensions, fibres longer than :data:`MAX_N`, trailing axes that do not merge into one
    without a copy, or a fibre whose offsets pass 32 bits."""
    return _refusal(x, grad)[0]


def _refusal(x: torch.Tensor, grad: torch.Tensor | None
             ) -> tuple[str | None, tuple[tuple[int, int, int], tuple[int, int, int]] | None]:
    """(:func:`refusal`'s answer, the strides of x and grad as [A, n, R] it found on the way)."""
    if x.dtype not in DTYPES or x.dim() < 2:
        return f"every tensor must be one of {[str(d) for d in DTYPES]} with dim() >= 2", None
    n = x.shape[1]
    if n > MAX_N:
        return f"fibres of {n} entries are longer than {MAX_N}", None
    xs = _merged(x.shape, x.stride())
    gs = xs if grad is None else _merged(grad.shape, grad.stride())
    for strides in (xs, gs):
        if strides is None:
            return "its trailing axes cannot be viewed as one without a copy", None
        if (n - 1) * abs(strides[1]) >= 2**31:
            return "a fibre's offsets pass 32 bits", None
    return None, (xs, gs)


class _Fibres(NamedTuple):
    """One item as the kernel reads it: [lead, n, rest] fibres at these pointers and strides."""
    variant: Variant
    lead: int
    n: int
    rest: int
    x_ptr: int
    g_ptr: int  # x's where there is no grad
    x_strides: tuple[int, int, int]
    g_strides: tuple[int, int, int]


@dataclass
class Item:
    """One tensor to select from: ``x`` viewed as [A, n, R] fibres along axis 1.

    Example::

        it = item(grad.view(64, -1), None, k=10)   # None where the kernel does not take it
        [selected] = select([it], stage)
    """
    x: torch.Tensor  # what is selected from; with grad, the residual, updated in place
    grad: torch.Tensor | None
    k: int
    # how the kernel reads x and grad, where :func:`item` has found it already
    read: _Fibres | None = field(default=None, repr=False, compare=False)


def item(x: torch.Tensor, grad: torch.Tensor | None, k: int) -> Item | None:
    """The item selecting ``k`` of each fibre of ``x`` (``grad``: error feedback), or None
    where the kernel does not take it (:func:`applies`, or ``k`` outside [1, n]); the checks
    are made once, for :func:`launch` too."""
    if not _kernel_device(x):
        return None
    why, read = _reading(x, grad, k)
    return None if why else Item(x, grad, k, read)


@dataclass
class Selected:
    """One tensor's selection: device views into the stage's buffer and their host copies,
    the rows carried (None: all) and whether a NaN or an infinity was selected."""
    values: torch.Tensor
    indices: torch.Tensor
    host_values: torch.Tensor
    host_indices: torch.Tensor
    rows: torch.Tensor | None
    nonfinite: bool


def select(items: list[Item], stage: Stage) -> list[Selected]:
    """Every item's per-fibre top-k into ``stage``'s buffer, then to its host buffer.

    Items with a ``grad`` are error feedback: ``x += grad`` first, and the
    selected entries of ``x`` end as zero. Returns once the host bytes are
    ready (they were copied on the side stream); the views stay valid until the
    next call on ``stage``. Every item must be one :func:`applies` takes.
    """
    return launch(items, stage).results()


class Launched:
    """A batch whose kernels and copy to host are queued: :meth:`results` waits for the copy
    and returns each item's :class:`Selected`, so that the caller can queue more work on the
    GPU (the next batch, in another stage) before it waits.

    Example::

        batch = launch(items, stage)   # kernels and copy queued; the host goes on
        ...
        selected = batch.results()     # waits for the copy
    """

    def __init__(self, items: list[Item], stage: Stage, layout: list, bytes_at: tuple[int, int, int],
                 order: list[int], starts: list[int], host: torch.Tensor, buffer: torch.Tensor):
        self.items, self.stage, self._layout, self._bytes_at = items, stage, layout, bytes_at
        self._order, self._starts, self._host, self._buffer = order, starts, host, buffer

    def results(self) -> list[Selected]:
        """Each item's selection, once the host bytes have landed."""
        self.stage.wait()
        if not self.items:
            return []
        # small reads on the host: numpy's, which cost less than torch's, one reduction each
        # over the whole batch: a program's flag byte is nonzero where it selected a NaN or an
        # infinity, a fibre's live byte zero where it selected only zeros
        host = self._host.numpy()
        live_from, flags_at, programs = self._bytes_at
        nonfinite = np.empty(len(self.items), dtype=bool)
        nonfinite[self._order] = np.maximum.reduceat(
            host[flags_at:flags_at + programs], [self._starts[i] for i in self._order]) > 0
        last = self._layout[-1]  # the live bytes end with the last item's (padding follows)
        all_live = np.minimum.reduceat(host[live_from:last[2] + last[3] // last[5]],
                                       [entry[2] - live_from for entry in self._layout]) > 0
        typed = _Typed(self._buffer, self._host)
        return [_result(item, self._layout[i], typed, host, bool(nonfinite[i]), bool(all_live[i]))
                for i, item in enumerate(self.items)]


def launch(items: list[Item], stage: Stage) -> Launched:
    """Queue every item's selection (one launch per variant) and the copy of the results to
    ``stage``'s host buffer, without waiting (see :class:`Launched`)."""
    if not items:
        return Launched([], stage, [], (0, 0, 0), [], [], stage.device_buffer(0), stage.device_buffer(0))
    kernel, _ = _triton()
    first = items[0].x
    fibres = [_read(it, first.dtype, first.device) for it in items]
    layout, live_from, flags_at = _lay_out(items, fibres)
    launches, order, starts, spans = _plan_launches(fibres)
    programs = sum(spans)
    buffer = stage.device_buffer(aligned(flags_at + programs))
    base = buffer.data_ptr()
    rows = (_row(f, item.k, base, layout[i], starts[i] - launches[f.variant][1])
            for i, (item, f) in enumerate(zip(items, fibres)))
    # the table holds the rows, then the items in program order and their programs; each
    # program's item is spread out on the device (one small upload, whatever the programs);
    # numpy builds it from the ints several times faster than torch.tensor
    at, m = len(items) * _COLUMNS, len(order)
    table = stage.table(torch.from_numpy(np.fromiter(
        itertools.chain(itertools.chain.from_iterable(rows), order, (spans[i] for i in order)),
        dtype=np.int64, count=at + 2 * m)))
    owners = torch.repeat_interleave(table[at:at + m], table[at + m:], output_size=programs)
    with on_device(first.device):
        for v, (count, first_program) in launches.items():
            kernel[(count,)](table, owners, first_program, buffer[flags_at + first_program:],
                             **v.constants(), num_warps=v.warps,
                             enable_fp_fusion=True)  # Triton's default, stated: left unstated, Triton 3.9 warns
    host = stage.to_host(aligned(flags_at + programs))
    return Launched(items, stage, layout, (live_from, flags_at, programs), order, starts, host, buffer)


def on_device(device: torch.device):
    """A context in which kernels launch on ``device``: Triton launches on the current CUDA
    device, which for a tensor on ``cuda:1`` need not be its own.

    Example::

        with on_device(torch.device("cuda", 1)):
            ...  # launches go to GPU 1
    """
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _reading(x: torch.Tensor, grad: torch.Tensor | None, k: int) -> tuple[str | None, _Fibres | None]:
    """(why the kernel cannot take ``x`` and ``grad`` with ``k``, or None; how it reads them)."""
    if grad is not None and (grad.shape != x.shape or grad.dtype != x.dtype or grad.device != x.device):
        return f"grad {tuple(grad.shape)} {grad.dtype} does not match {tuple(x.shape)} {x.dtype}", None
    why, strides = _refusal(x, grad)
    if why:
        return why, None
    shape = x.shape
    lead, n, rest = shape[0], shape[1], math.prod(shape[2:])
    if not 1 <= k <= n:
        return f"k={k} outside [1, {n}] for {tuple(shape)}", None
    xs, gs = strides
    x_ptr = x.data_ptr()
    g_ptr = x_ptr if grad is None else grad.data_ptr()
    contiguous = _in_fours(x_ptr, n, rest, xs) and (grad is None or _in_fours(g_ptr, n, rest, gs))
    return None, _Fibres(variant(n, k, x.dtype, grad is not None, contiguous), lead, n, rest, x_ptr, g_ptr, xs, gs)


def _read(it: Item, dtype: torch.dtype, device: torch.device) -> _Fibres:
    """How the kernel reads the item; an item it cannot take, or unlike the batch's ``dtype``
    and ``device``, is refused by name."""
    x = it.x
    read = it.read
    if read is None:
        why, read = _reading(x, it.grad, it.k)
        if why:
            raise ValueError(f"fibre kernel: {why}; got {x.dtype} {tuple(x.shape)} on {x.device}")
    if x.dtype != dtype or x.device != device:
        raise ValueError(f"fibre kernel: every tensor must be {dtype} on {device}; "
                         f"got {x.dtype} {tuple(x.shape)} on {x.device}")
    return read


def _lay_out(items: list[Item], fibres: list[_Fibres]) -> tuple[list[tuple], int, int]:
    """Where each item's values, indices and live bytes (one a fibre) go in the stage's buffer
    (values at, indices at, live at, count, index dtype, k), where the live bytes begin (every
    item's side by side, so that one reduction reads them all) and the bytes all take."""
    layout, at = [], 0
    for item, f in zip(items, fibres):
        count = f.lead * f.rest * item.k
        idt = index_dtype(f.n)
        values_at, at = at, aligned(at + count * item.x.element_size())
        indices_at, at = at, aligned(at + count * idt.itemsize)
        layout.append([values_at, indices_at, 0, count, idt, item.k])
    live_from = at
    for entry, f in zip(layout, fibres):
        entry[2], at = at, at + f.lead * f.rest
    return [tuple(entry) for entry in layout], live_from, aligned(at)


def _plan_launches(fibres: list[_Fibres]) -> tuple[dict[Variant, tuple[int, int]], list[int], list[int], list[int]]:
    """One launch per variant: {variant: (its programs, its first program)}; the items in
    program order; each item's first program and number of programs. Programs are numbered
    across launches, so that an item owns one run of flags. A variant's tile is the same for
    every tensor (a small tensor's last program is mostly padding), so what runs is what
    benchmarks/kernel_budget.py compiles."""
    groups: dict[Variant, list[int]] = {}
    spans = []
    for i, f in enumerate(fibres):
        groups.setdefault(f.variant, []).append(i)
        spans.append(-(-(f.lead * f.rest) // f.variant.fb))
    launches, order, starts, programs = {}, [], [0] * len(spans), 0
    for v, members in groups.items():
        launches[v] = (sum(spans[i] for i in members), programs)
        for i in members:
            starts[i], programs = programs, programs + spans[i]
        order += members
    return launches, order, starts, spans


def _in_fours(ptr: int, n: int, rest: int, strides: tuple[int, int, int]) -> bool:
    """Whether every fibre [A, n, R] at ``ptr`` with ``strides`` is adjacent in memory and can
    be read four entries at a time: 16-byte aligned, of a length and row strides in multiples
    of 4."""
    return (strides[1] == 1 and n % 4 == 0 and ptr % 16 == 0 and strides[0] % 4 == 0
            and (rest == 1 or strides[2] % 4 == 0))


def _row(f: _Fibres, k: int, base: int, layout: tuple, first: int) -> list[int]:
    """An item's row of the table: pointers, sizes, strides and its first program."""
    values_at, indices_at, live_at = layout[:3]
    return [f.x_ptr, f.g_ptr, base + values_at, base + indices_at, f.n, k, f.rest, f.lead * f.rest,
            *f.x_strides, *f.g_strides, first, base + live_at]


class _Typed:
    """The device buffer and its host mirror seen as each dtype once, so that an item's
    region is one strided view of it (every region starts aligned for any dtype)."""

    def __init__(self, buffer: torch.Tensor, host: torch.Tensor):
        self._raw, self._views = (buffer, host), {}

    def regions(self, at: int, dtype: torch.dtype, shape: tuple, strides: tuple
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(device, host) views of ``shape`` entries of ``dtype`` (contiguous: ``strides``)
        from byte ``at``."""
        views = self._views.get(dtype)
        if views is None:
            views = self._views[dtype] = tuple(t[:t.numel() // dtype.itemsize * dtype.itemsize].view(dtype)
                                               for t in self._raw)
        offset = at // dtype.itemsize
        return views[0].as_strided(shape, strides, offset), views[1].as_strided(shape, strides, offset)


def _result(item: Item, layout: tuple, typed: _Typed, host_np: np.ndarray, nonfinite: bool,
            all_live: bool) -> Selected:
    """One item's views, with the rows that selected only zeros left out (the kernel's byte a
    fibre, read on the host where not ``all_live``: a row is live where one of its fibres is)."""
    values_at, indices_at, live_at, count, idt, k = layout
    shape = (item.x.shape[0], k, *item.x.shape[2:])
    strides = _contiguous_strides(shape)
    values, host_values = typed.regions(values_at, item.x.dtype, shape, strides)
    indices, host_indices = typed.regions(indices_at, idt, shape, strides)
    rows = None
    if not all_live:
        live = host_np[live_at:live_at + count // k].reshape(shape[0], -1).any(1)
        if not live.all():
            rows = torch.from_numpy(np.flatnonzero(live))
            on_device = rows.to(values.device, non_blocking=True)
            values, indices = values.index_select(0, on_device), indices.index_select(0, on_device)
            host_values, host_indices = host_values.index_select(0, rows), host_indices.index_select(0, rows)
    return Selected(values, indices, host_values, host_indices, rows, nonfinite)


def _contiguous_strides(shape: tuple) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))
