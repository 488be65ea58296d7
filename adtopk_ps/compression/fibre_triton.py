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
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from ..dtypes import index_dtype, wire_name
from .staging import Stage, aligned

# bits of |x| below the sign, and the key of an infinity (a NaN's key is clipped to it)
_BITS = {torch.float32: 31, torch.float16: 15, torch.bfloat16: 15}
#: the wire's float dtypes (adtopk_ps/dtypes.py) this kernel selects in: all but float64
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
    from . import _fibre_kernel
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
        tl = _triton()[1]
        return dict(DT=getattr(tl, wire_name(self.dtype)), IDT=getattr(tl, _TL_INDEX[self.index_bytes]),
                    BITS=_BITS[self.dtype], INF_KEY=_INF_KEY[self.dtype], FB=self.fb, SEG=self.seg,
                    BS=self.bs, RUNS=self.runs, VEC=4 if self.contiguous else 1,
                    FEEDBACK=self.feedback, KEEP=self.keeps_sums, ASM=not interpreted(), W=_COLUMNS)


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


def _three_d(x: torch.Tensor) -> torch.Tensor | None:
    """``x`` as [A, n, R] without a copy, or None where its trailing axes do not merge."""
    try:
        return x.view(x.shape[0], x.shape[1], math.prod(x.shape[2:]))
    except RuntimeError:
        return None


def applies(x: torch.Tensor, grad: torch.Tensor | None = None) -> bool:
    """Whether the kernel can select from ``x`` (with error feedback: ``x`` the residual,
    ``grad`` added into it): a CUDA tensor the kernel takes (:func:`refusal`), with triton
    importable."""
    if x.device.type != "cuda" and not (CPU_TENSORS and x.device.type == "cpu" and interpreted()):
        return False
    return x.numel() > 0 and refusal(x, grad) is None and _triton() is not None  # empty: select.py's arange


def refusal(x: torch.Tensor, grad: torch.Tensor | None = None) -> str | None:
    """Why the kernel cannot take ``x`` (and ``grad``), or None: its dtype, fewer than two
    dimensions, fibres longer than :data:`MAX_N`, trailing axes that do not merge into one
    without a copy, or a fibre whose offsets pass 32 bits."""
    return _refusal(x, grad)[0]


def _refusal(x: torch.Tensor, grad: torch.Tensor | None) -> tuple[str | None, tuple]:
    """(:func:`refusal`'s answer, the views [A, n, R] of x and grad it made on the way)."""
    if x.dtype not in DTYPES or x.dim() < 2:
        return f"every tensor must be one of {[str(d) for d in DTYPES]} with dim() >= 2", ()
    if x.shape[1] > MAX_N:
        return f"fibres of {x.shape[1]} entries are longer than {MAX_N}", ()
    views = tuple(_three_d(t) for t in ((x,) if grad is None else (x, grad)))
    for view in views:
        if view is None:
            return "its trailing axes cannot be viewed as one without a copy", ()
        if (view.shape[1] - 1) * abs(view.stride(1)) >= 2**31:
            return "a fibre's offsets pass 32 bits", ()
    return None, views


@dataclass
class Item:
    """One tensor to select from: ``x`` viewed as [A, n, R] fibres along axis 1."""
    x: torch.Tensor  # what is selected from; with grad, the residual, updated in place
    grad: torch.Tensor | None
    k: int


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

    def __init__(self, items: list[Item], stage: Stage, layout: list, flags_at: int,
                 starts: list[int], spans: list[int], host: torch.Tensor, buffer: torch.Tensor):
        self.items, self.stage, self._layout, self._flags_at = items, stage, layout, flags_at
        self._starts, self._spans, self._host, self._buffer = starts, spans, host, buffer

    def results(self) -> list[Selected]:
        """Each item's selection, once the host bytes have landed."""
        self.stage.wait()
        if not self.items:
            return []
        host = self._host.numpy()  # small reads on the host: numpy's, which cost less than torch's
        flags = np.concatenate([[0], np.cumsum(host[self._flags_at:self._flags_at + sum(self._spans)])])
        typed = _Typed(self._buffer, self._host)
        return [_result(item, self._layout[i], typed, host,
                        bool(flags[self._starts[i] + self._spans[i]] > flags[self._starts[i]]))
                for i, item in enumerate(self.items)]


def launch(items: list[Item], stage: Stage) -> Launched:
    """Queue every item's selection (one launch per variant) and the copy of the results to
    ``stage``'s host buffer, without waiting (see :class:`Launched`)."""
    if not items:
        return Launched([], stage, [], 0, [], [], stage.device_buffer(0), stage.device_buffer(0))
    kernel, _ = _triton()
    views = [_views(item, items[0].x) for item in items]
    variants = _variants(items, views)
    layout, flags_at = _lay_out(items)
    launches, order, starts, spans = _plan_launches(variants, views)
    programs = sum(spans)
    buffer = stage.device_buffer(aligned(flags_at + programs))
    base = buffer.data_ptr()
    rows = (_row(x3, g3, item.k, base, layout[i], starts[i] - launches[v][1])
            for i, (item, (x3, g3), v) in enumerate(zip(items, views, variants)))
    # the table holds the rows, then the items in program order and their programs; each
    # program's item is spread out on the device (one small upload, whatever the programs);
    # numpy builds it from the ints several times faster than torch.tensor
    at, m = len(items) * _COLUMNS, len(order)
    table = stage.table(torch.from_numpy(np.fromiter(
        itertools.chain(itertools.chain.from_iterable(rows), order, (spans[i] for i in order)),
        dtype=np.int64, count=at + 2 * m)))
    owners = torch.repeat_interleave(table[at:at + m], table[at + m:], output_size=programs)
    with on_device(items[0].x.device):
        for v, (count, first) in launches.items():
            kernel[(count,)](table, owners, first, buffer[flags_at + first:],
                             **v.constants(), num_warps=v.warps,
                             enable_fp_fusion=True)  # Triton's default, stated: left unstated, Triton 3.9 warns
    host = stage.to_host(aligned(flags_at + programs))
    return Launched(items, stage, layout, flags_at, starts, spans, host, buffer)


def on_device(device: torch.device):
    """A context in which kernels launch on ``device``: Triton launches on the current CUDA
    device, which for a tensor on ``cuda:1`` need not be its own.

    Example::

        with on_device(torch.device("cuda", 1)):
            ...  # launches go to GPU 1
    """
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _views(item: Item, first: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The item's x and grad as [A, n, R] (grad: x's view where there is none); an item the
    kernel cannot take, or unlike the batch's ``first``, is refused by name."""
    x, grad = item.x, item.grad
    if grad is not None and (grad.shape, grad.dtype, grad.device) != (x.shape, x.dtype, x.device):
        raise ValueError(f"fibre kernel: grad {tuple(grad.shape)} {grad.dtype} does "
                         f"not match {tuple(x.shape)} {x.dtype}")
    why, views = _refusal(x, grad)
    if x.dtype != first.dtype or x.device != first.device or why:
        raise ValueError(f"fibre kernel: {why or f'every tensor must be {first.dtype} on {first.device}'}; "
                         f"got {x.dtype} {tuple(x.shape)} on {x.device}")
    if not 1 <= item.k <= x.shape[1]:
        raise ValueError(f"fibre kernel: k={item.k} outside [1, {x.shape[1]}] for {tuple(x.shape)}")
    return views[0], views[-1]


def _lay_out(items: list[Item]) -> tuple[list[tuple[int, int, int, int, torch.dtype]], int]:
    """Where each item's values, indices and live bytes (one a fibre) go in the stage's buffer
    (values at, indices at, live at, count, index dtype), and the bytes they take."""
    layout, at = [], 0
    for item in items:
        x = item.x
        fibres = x.shape[0] * math.prod(x.shape[2:])
        count = fibres * item.k
        idt = index_dtype(x.shape[1])
        values_at, at = at, aligned(at + count * x.element_size())
        indices_at, at = at, aligned(at + count * idt.itemsize)
        live_at, at = at, aligned(at + fibres)
        layout.append((values_at, indices_at, live_at, count, idt))
    return layout, at


def _variants(items: list[Item], views: list[tuple[torch.Tensor, torch.Tensor]]) -> list[Variant]:
    return [variant(x3.shape[1], item.k, x3.dtype, item.grad is not None,
                    _in_fours(x3) and (item.grad is None or _in_fours(g3)))
            for item, (x3, g3) in zip(items, views)]


def _plan_launches(variants: list[Variant], views: list[tuple[torch.Tensor, torch.Tensor]]
                   ) -> tuple[dict[Variant, tuple[int, int]], list[int], list[int], list[int]]:
    """One launch per variant: {variant: (its programs, its first program)}; the items in
    program order; each item's first program and number of programs. Programs are numbered
    across launches, so that an item owns one run of flags. A variant's tile is the same for every tensor (a
    small tensor's last program is mostly padding), so what runs is what
    benchmarks/kernel_budget.py compiles."""
    groups: dict[Variant, list[int]] = {}
    spans = []
    for i, (v, (x3, _)) in enumerate(zip(variants, views)):
        groups.setdefault(v, []).append(i)
        spans.append(-(-(x3.shape[0] * x3.shape[2]) // v.fb))
    launches, order, starts, programs = {}, [], [0] * len(spans), 0
    for v, members in groups.items():
        launches[v] = (sum(spans[i] for i in members), programs)
        for i in members:
            starts[i], programs = programs, programs + spans[i]
        order += members
    return launches, order, starts, spans


def _in_fours(view: torch.Tensor) -> bool:
    """Whether every fibre of ``view`` [A, n, R] is adjacent in memory and can be read four
    entries at a time: 16-byte aligned, of a length and row strides in multiples of 4."""
    return (view.stride(1) == 1 and view.shape[1] % 4 == 0 and view.data_ptr() % 16 == 0
            and view.stride(0) % 4 == 0 and (view.shape[2] == 1 or view.stride(2) % 4 == 0))


def _row(x3: torch.Tensor, g3: torch.Tensor, k: int, base: int, layout: tuple, first: int) -> list[int]:
    """An item's row of the table: pointers, sizes, strides and its first program."""
    values_at, indices_at, live_at, _, _ = layout
    return [x3.data_ptr(), g3.data_ptr(), base + values_at, base + indices_at, x3.shape[1],
            k, x3.shape[2], x3.shape[0] * x3.shape[2], *x3.stride(), *g3.stride(), first,
            base + live_at]


class _Typed:
    """The device buffer and its host mirror seen as each dtype once, so that an item's
    region is one strided view of it (every region starts aligned for any dtype)."""

    def __init__(self, buffer: torch.Tensor, host: torch.Tensor):
        self._raw, self._views = (buffer, host), {}

    def regions(self, at: int, dtype: torch.dtype, shape: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        """(device, host) views of ``shape`` (contiguous) entries of ``dtype`` from byte ``at``."""
        views = self._views.get(dtype)
        if views is None:
            views = self._views[dtype] = tuple(t[:t.numel() // dtype.itemsize * dtype.itemsize].view(dtype)
                                               for t in self._raw)
        strides, step = [], 1
        for size in reversed(shape):
            strides.append(step)
            step *= size
        return tuple(v.as_strided(shape, strides[::-1], at // dtype.itemsize) for v in views)


def _result(item: Item, layout: tuple, typed: _Typed, host_np: np.ndarray, nonfinite: bool) -> Selected:
    """One item's views, with the rows that selected only zeros left out (the kernel's byte a
    fibre, read on the host: a row is live where one of its fibres is)."""
    values_at, indices_at, live_at, count, idt = layout
    shape = (item.x.shape[0], item.k, *item.x.shape[2:])
    values, host_values = typed.regions(values_at, item.x.dtype, shape)
    indices, host_indices = typed.regions(indices_at, idt, shape)
    live = host_np[live_at:live_at + count // item.k].reshape(shape[0], -1).any(1)
    if not live.all():
        rows = torch.from_numpy(np.flatnonzero(live))
        on_device = rows.to(values.device, non_blocking=True)
        values, indices = values.index_select(0, on_device), indices.index_select(0, on_device)
        host_values, host_indices = host_values.index_select(0, rows), host_indices.index_select(0, rows)
    else:
        rows = None
    return Selected(values, indices, host_values, host_indices, rows, nonfinite)
