"""Workers set up to push different things are refused at start-up, naming both sides.

A server sums whatever arrives under a key. A worker that sparsifies with
another compressor, density or error feedback, or sends a tensor dense that
another sends sparse, mixes its payloads into the others' silently or fails
later on an innocent tensor; one that all-reduces what another pushes waits
for a rendezvous that never comes. So before anything else is pushed, every
worker describes what it will push (names, shapes, dtypes, each tensor's
compressor and density, the fusion and partition plan, the settings that
decide them) and all compare.

Only digests travel first (a few bytes a worker); where they differ, the full
descriptions follow, so every worker sees the same differences and raises the
same :class:`Disagreement` at once: none is left waiting for the others.
"""
from __future__ import annotations

import hashlib
import inspect
import json
from typing import Callable, Iterable

import torch

from adtopk_ps.compression import Compressor
from adtopk_ps.torch.fusion import plan_buckets
from adtopk_ps.torch.gradient_compression import GradientCompression

MAX_LINES = 5  # differences named in the message; the rest are counted
NAME = ".agreement"  # pushed as "allgather.object..agreement...": no module path has an empty part

Gather = Callable[[object, str], list]  # (this worker's object, a name) -> every worker's, in rank order


class Disagreement(ValueError):
    """Workers would push different things (raised alike on every worker, before any gradient).

    Example::

        try:
            opt = bps.DistributedOptimizer(opt, model.named_parameters(), compression)
        except bps.Disagreement as exc:
            sys.exit(f"worker {bps.rank()}: {exc}")
    """


def compressor_label(compressor: Compressor, ratio: float | None = None) -> str:
    """``adtopk(ratio=0.01, ef=vanilla)``: the name, the density (``ratio`` where the policy
    overrides it), every other parameter that differs from its default, and the error feedback."""
    inner = compressor.base
    parts = [f"ratio={ratio if ratio is not None else inner.ratio!r}"]
    for p in list(inspect.signature(type(inner).__init__).parameters.values())[1:]:
        if p.name == "ratio" or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or not hasattr(inner, p.name):
            continue
        value = getattr(inner, p.name)
        if isinstance(value, torch.dtype):
            value = str(value).removeprefix("torch.")
        elif not isinstance(value, (bool, int, float, str)):  # unset (None), or state
            continue
        if value != p.default:
            parts.append(f"{p.name}={value}")
    parts.append(f"ef={compressor.ef}")
    return f"{inner.name or type(inner).__name__}({', '.join(parts)})"


def describe(named: Iterable[tuple[str, torch.Tensor]], compression: "GradientCompression",
             settings: dict[str, object], fusion: int | None = None) -> dict:
    """What this worker will push, as plain data: ``settings`` (shown with ``repr``), the
    sparsification policy, every tensor's dtype, shape and compressor (by its planned routes)
    and, given the bucket capacity ``fusion``, the fusion buckets."""
    named = list(named)
    policy = compression.policy
    described = {name: repr(value) for name, value in settings.items()}
    described["the sparsification policy"] = (
        f"{type(policy).__name__}(ratio={policy.ratio!r}, "
        f"min_compress_bytes={policy.min_compress_bytes}, budget={policy.budget})")
    parameters = []
    for name, p in named:
        comp, ratio = compression.for_tensor(name)
        parameters.append([name, str(p.dtype).removeprefix("torch."), list(p.shape),
                           "dense" if comp is None else compressor_label(comp, ratio)])
    buckets = []
    if fusion is not None:
        names = {id(p): name for name, p in named}
        dense = {name for name, _ in named if compression.dense(name)}
        buckets = [[b.name, [names[id(p)] for p, _ in b.members]]
                   for b in plan_buckets(named, dense, fusion)]
    return {"settings": list(described.items()), "parameters": parameters, "buckets": buckets}


def _quoted(names: list[str]) -> str:
    shown = [repr(n) for n in names[:3]]
    if len(names) > 3:
        return f"{', '.join(shown)} and {len(names) - 3} more"
    return shown[0] if len(shown) == 1 else f"{', '.join(shown[:-1])} and {shown[-1]}"


def _spec(dtype: str, shape: list[int]) -> str:
    return f"{dtype}{list(shape)}"


def _compare(base: dict, other: dict) -> list[tuple[str, str, str, str]]:
    """(what, subject, worker 0's, the other's) for each difference; the fusion buckets
    only where nothing else differs (they follow from the rest)."""
    found = []
    mine, theirs = dict(base["settings"]), dict(other["settings"])
    for key in list(mine) + [k for k in theirs if k not in mine]:
        if mine.get(key) != theirs.get(key):
            found.append((key, "", mine.get(key, "nothing"), theirs.get(key, "nothing")))
    left = {name: rest for name, *rest in base["parameters"]}
    right = {name: rest for name, *rest in other["parameters"]}
    for name, (dtype, shape, _) in left.items():
        if name not in right:
            found.append(("the parameter {}", name, _spec(dtype, shape), "none"))
    for name, (dtype, shape, _) in right.items():
        if name not in left:
            found.append(("the parameter {}", name, "none", _spec(dtype, shape)))
    if set(left) == set(right) and list(left) != list(right):
        at = next(i for i, (a, b) in enumerate(zip(left, right)) if a != b)
        found.append(("the order of the parameters", "", f"{list(left)[at]!r} at position {at}",
                      repr(list(right)[at])))
    for name, (dtype, shape, route) in left.items():
        if name not in right:
            continue
        their_dtype, their_shape, their_route = right[name]
        for what, a, b in (("the dtype of {}", dtype, their_dtype),
                           ("the shape of {}", list(shape), list(their_shape)),
                           ("the compressor of {}", route, their_route)):
            if a != b:
                found.append((what, name, str(a), str(b)))
    if not found and base["buckets"] != other["buckets"]:
        mine, theirs = dict(base["buckets"]), dict(other["buckets"])
        for key in list(mine) + [k for k in theirs if k not in mine]:
            if mine.get(key) != theirs.get(key):
                found.append(("the fusion bucket {}", key, _members(mine.get(key)),
                              _members(theirs.get(key))))
    return found


def _members(names: list[str] | None) -> str:
    return "none" if names is None else f"members {_quoted(names)}"


def differences(descriptions: list[dict]) -> list[str]:
    """Every worker's description against worker 0's, one line per difference; a difference
    shared by several tensors, or by several workers, is one line."""
    subjects: dict[tuple, list[str]] = {}
    for rank, other in enumerate(descriptions[1:], 1):
        for what, subject, a, b in _compare(descriptions[0], other):
            subjects.setdefault((rank, what, a, b), []).append(subject)
    ranks: dict[tuple, list[int]] = {}
    for (rank, what, a, b), names in subjects.items():
        ranks.setdefault((what, tuple(names), a, b), []).append(rank)
    lines = []
    for (what, names, a, b), who in ranks.items():
        subject = what.format(_quoted(list(names))) if "{}" in what else what
        others = f"worker {who[0]} has" if len(who) == 1 else \
            f"workers {', '.join(map(str, who[:-1]))} and {who[-1]} have"
        lines.append(f"workers disagree on {subject}: worker 0 has {a}, {others} {b}")
    return lines


def agree(description: dict, gather: Gather, name: str = NAME) -> None:
    """Compare ``description`` with every other worker's (all must call it, in the same order);
    raise :class:`Disagreement` on every worker where any differs from worker 0's."""
    digest = hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()[:32]
    if len(set(gather(digest, f"{name}.digest"))) == 1:
        return
    lines = differences(gather(description, f"{name}.description"))
    if not lines:  # (the comparison covers every field; a digest can differ only with one)
        lines = ["workers disagree on what they will push, in a way not named here"]
    more = len(lines) - MAX_LINES
    raise Disagreement("\n".join(lines[:MAX_LINES] + ([f"(and {more} more)"] if more > 0 else [])))
