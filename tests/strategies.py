"""Hypothesis strategies for gradients of many shapes and dtypes, and what the payload
property tests share."""
import math

import msgpack
import torch
from hypothesis import strategies as st

DTYPES = [torch.float32, torch.float16, torch.bfloat16]

small_dim = st.integers(1, 9)
axis_dim = st.one_of(st.integers(1, 3), st.integers(4, 300), st.sampled_from([255, 256, 257, 1024, 1500, 4096]))

shapes_2d = st.tuples(st.integers(1, 40), axis_dim)
shapes_4d = st.tuples(st.integers(1, 6), axis_dim, small_dim, st.integers(1, 3))
# axis 1 longer than uint16 can index: indices must widen to int32
wide_shapes = st.sampled_from([(2, 70000), (1, 65537, 1, 2)])
shapes = st.one_of(shapes_2d, shapes_4d, wide_shapes)
ratios = st.one_of(st.sampled_from([0.001, 0.01, 0.1, 0.5, 1.0]), st.floats(0.001, 1.0))


@st.composite
def gradients(draw, shape_strategy=shapes, dtypes=DTYPES):
    shape = draw(shape_strategy)
    dtype = draw(st.sampled_from(dtypes))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * draw(st.sampled_from([1e-3, 1.0, 100.0]))
    if draw(st.booleans()):  # exact ties and zeros are legal gradients too
        x = x.round()
    if draw(st.booleans()):  # dead units: whole slices along dim 0 that are zero (or all of them)
        x[torch.rand(shape[0], generator=gen) < draw(st.sampled_from([0.3, 1.0]))] = 0
    return x.to(dtype)


# the header fields every message has; the rest of a push's header describes its payload
ENVELOPE = ("v", "op", "key", "round", "sender")


def encoded_payload_bytes(frames) -> int:
    """The bytes of an encoded push that are its payload's: the header fields past the
    envelope, packed alone, and every buffer (what ``wire.payload_nbytes`` must equal)."""
    fields = {k: v for k, v in msgpack.unpackb(bytes(frames[0])).items() if k not in ENVELOPE}
    return len(msgpack.packb(fields)) + sum(memoryview(f).nbytes for f in frames[1:])


def rule_positions(x: torch.Tensor, k: int) -> torch.Tensor:
    """Positions a fibre selection writes (select.py's rule), one fibre at a time in Python:
    key |x| (a NaN's an infinity), the k largest keys, of equal keys the lower positions,
    written in ascending order. ``x`` is ``[A, n, *rest]``, the result ``[A, min(k, n), *rest]``."""
    lead, n, rest = x.shape[0], x.shape[1], tuple(x.shape[2:])
    k = min(k, n)
    fibres = x.detach().double().reshape(lead, n, math.prod(rest))
    out = torch.empty((lead, k, fibres.shape[2]), dtype=torch.int64)
    for a in range(lead):
        for j in range(fibres.shape[2]):
            key = [math.inf if math.isnan(v) else abs(v) for v in fibres[a, :, j].tolist()]
            chosen = sorted(range(n), key=lambda p: (-key[p], p))[:k]
            out[a, :, j] = torch.tensor(sorted(chosen), dtype=torch.int64)
    return out.view(lead, k, *rest)
