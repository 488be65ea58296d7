"""Per-key BSP aggregation: a round completes when every worker has pushed once.

Dense pushes add into a preallocated buffer; sparse ones ``scatter_add_`` into
it in place, with no dense expansion per push. The answer to the round is
whichever encoding of the sum is smaller: the sparse union or the dense
tensor, or (optionally) a top-k re-sparsification with a server residual, as
wide as a fixed density or as the round's pushes were on average. The union
grows with the number of workers (every worker pulls all of it); an answer as
wide as one push does not.

A dense first push that arrived over the wire becomes the round's buffer
itself (its memory is the received frame's), so dense keys cost no copy.
Otherwise the round sums into one of two preallocated buffers used in
alternate rounds: a dense answer is sent straight from its buffer, and
round r+2, the next one to touch that buffer, cannot start before every
worker has received round r's answer (each worker pushes round r+1 only
after that).

A round whose pushes are all sparse costs work in proportion to what was
pushed, not to the key's size: it lands in a buffer known to be all zeros,
the answer is the union of the pushed positions, and only those positions
are zeroed again afterwards, rather than scanning the whole sum for
nonzeros. For float32 the compiled
:mod:`server.sparse_sum` does this without numpy's sort. Either way a sparse
answer's positions ascend.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import numpy as np
import torch

from adtopk_ps.compression import Compressor, ErrorFeedback
from adtopk_ps.core.dtypes import index_dtype
from adtopk_ps.core.payload import Payload

from . import sparse_sum


class PushRejected(ValueError):
    """A push that must not enter the aggregate; the text goes back to its sender."""


@dataclass
class KeyState:
    """One key's round: its shape and dtype, who has pushed, and the buffers the sum lands in."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    sparse: bool
    round: int = 0
    pushed: set[int] = field(default_factory=set)
    union_bound: int = 0  # values pushed this round: the sparse union is at most this many
    current: torch.Tensor | None = None  # the sum of the round in progress
    buffers: tuple[torch.Tensor, torch.Tensor] | None = None  # allocated on first need
    clean: list[bool] = field(default_factory=lambda: [True, True])  # buffer known to be zeros
    touched: list[torch.Tensor] | None = None  # flat positions pushed, while every push is sparse
    wire: torch.dtype | None = None  # every push of the round dense and cast to this (fp16)
    flagging: set[int] = field(default_factory=set)  # pushers of this round that saw a NaN or inf
    flagged: list[int] = field(default_factory=list)  # the same, of the last round answered

    def start_round(self, payload: Payload, owned: bool) -> None:
        """Begin a round with its first push; a dense push received over the wire becomes the buffer itself."""
        vals = payload.values
        self.touched = None
        if owned and payload.codec == "dense" and vals.dtype == self.dtype and vals.is_contiguous():
            self.current = vals.view(self.shape)
            return
        if self.buffers is None:
            self.buffers = (torch.zeros(self.shape, dtype=self.dtype),
                            torch.zeros(self.shape, dtype=self.dtype))
        which = self.round % 2
        if payload.codec != "dense" and self.clean[which]:
            self.current = self.buffers[which]
            self.touched = [self._land(payload)]
        else:
            self.current = payload.write_into(self.buffers[which])
        self.clean[which] = False

    def add(self, payload: Payload) -> None:
        """Add one more push of this round into its sum (a sparse one by the compiled sum
        where it applies, whether or not the round still lists its positions)."""
        if payload.codec == "dense":
            payload.accumulate_into(self.current)
            self.touched = None
        elif self.touched is not None:
            self.touched.append(self._land(payload))
        elif self._land_compiled(payload) is None:
            payload.accumulate_into(self.current)

    def _land(self, payload: Payload) -> torch.Tensor:
        """Add a sparse push to a round whose pushes were all sparse; returns positions that
        may be new to the round (every position that is, perhaps some that are not)."""
        fresh = self._land_compiled(payload)
        if fresh is not None:
            return fresh
        payload.accumulate_into(self.current)
        return payload.flat_positions()

    def _land_compiled(self, payload: Payload) -> torch.Tensor | None:
        """Add a sparse push by the compiled sum: the positions that were zero before, or
        None (nothing added) where that path does not apply."""
        if not sparse_sum.applies(payload, self.current):
            return None
        try:
            return sparse_sum.add(self.current, payload)
        except ValueError as exc:  # nothing landed
            raise PushRejected(str(exc)) from None

    def sparse_answer(self, aggregate: torch.Tensor, touched: list[torch.Tensor],
                      which: int) -> Payload:
        """The nonzero sums at the pushed positions; the buffer is zeroed again where they were."""
        flat = aggregate.view(-1)
        listed = torch.cat(touched)
        if sparse_sum.applies_to(flat) and not dense_is_smaller(listed.numel(), flat):
            union, values = sparse_sum.take_nonzero(flat, listed)
        else:
            union = union_of(listed)
            values = flat[union]
            nonzero = values != 0  # zero rows (dead units) are pushed too; they need not come back
            union, values = union[nonzero], values[nonzero]
            if dense_is_smaller(union.numel(), flat):
                return Payload("dense", self.shape, self.dtype, flat)  # the buffer stays as it is
            flat.index_fill_(0, union, 0)
        self.clean[which] = True
        return Payload("coo", self.shape, self.dtype, values, union.to(index_dtype(flat.numel())))


def union_of(positions: torch.Tensor) -> torch.Tensor:
    """Sorted distinct positions (numpy's vectorised sort: torch.unique measured slower here)."""
    every = positions.numpy()
    ordered = np.sort(every)
    first = np.empty(ordered.shape, dtype=bool)
    first[:1] = True
    np.not_equal(ordered[1:], ordered[:-1], out=first[1:])
    return torch.from_numpy(ordered[first])


def dense_is_smaller(count: int, flat: torch.Tensor) -> bool:
    """Whether ``count`` (value, position) pairs take at least the bytes of ``flat`` dense."""
    itemsize = flat.element_size()
    return count * (itemsize + index_dtype(flat.numel()).itemsize) >= flat.numel() * itemsize


def smaller_encoding(aggregate: torch.Tensor, union_bound: int | None = None) -> Payload:
    """The smaller of the sparse union and the dense tensor.

    ``union_bound`` (how many values were pushed) spares the scan for the
    union when even that many could not beat the dense encoding.
    """
    flat = aggregate.view(-1)
    dense = Payload("dense", tuple(aggregate.shape), aggregate.dtype, flat)
    if union_bound is not None and dense_is_smaller(union_bound, flat):
        return dense
    if dense_is_smaller(int(torch.count_nonzero(flat)), flat):
        return dense
    positions = torch.nonzero(flat).view(-1)
    return Payload("coo", tuple(aggregate.shape), aggregate.dtype, flat[positions],
                   positions.to(index_dtype(flat.numel())))


def tightened(answer: Payload, aggregate: torch.Tensor) -> Payload:
    """A re-sparsified answer without the zeros a selection pads it with (where fewer entries
    than it keeps are nonzero: pushes that overlap, say), or the dense tensor where that is no
    larger. Either way it adds up to what was selected, so the residual stays right."""
    if answer.codec != "coo":
        return answer
    live = answer.values != 0
    if not bool(live.all()):
        answer = dataclasses.replace(answer, values=answer.values[live], indices=answer.indices[live])
    if dense_is_smaller(answer.count, aggregate.view(-1)):
        return Payload("dense", answer.shape, answer.dtype, answer.decompress().view(-1))
    return answer


def in_dtype(answer: Payload, wire: torch.dtype | None) -> Payload:
    """The answer's values in the dtype every push of the round travelled in (a cast such as
    fp16 halves the answer too); the sum itself was kept in the key's dtype."""
    if wire is None or answer.values.dtype == wire:
        return answer
    return dataclasses.replace(answer, values=answer.values.to(wire))


def residual_name(key: int) -> str:
    """The name a re-sparsifying server's residual of ``key`` goes by."""
    return f"key{key}"


def check_residual(key: int, shape: tuple[int, ...], dtype: torch.dtype, state: KeyState) -> None:
    """A residual put back for ``key`` must be of its shape and dtype."""
    if (tuple(shape), dtype) != (state.shape, state.dtype):
        raise PushRejected(f"key {key} holds {state.dtype} {state.shape}; the residual put back for "
                           f"it is {dtype} {tuple(shape)}: the checkpoint is of another model")


class Aggregator:
    """All keys of one server."""

    def __init__(self, num_workers: int, resparsify: Compressor | None = None,
                 max_keys: int = 1 << 20, max_bytes: int = 1 << 34,
                 pushes_wide: float | None = None):
        """``resparsify``: the compressor that re-sparsifies sparse keys' answers (with a
        residual kept here), at its own density, or with ``pushes_wide`` that many times as
        wide as the round's pushes were on average: the density the workers chose, whatever
        it is, however many workers there are."""
        if pushes_wide is not None and not pushes_wide > 0:
            raise ValueError(f"pushes_wide must be positive, got {pushes_wide!r}")
        self.num_workers = num_workers
        self.resparsify = ErrorFeedback(resparsify) if resparsify is not None else None
        self.pushes_wide = pushes_wide
        self.max_keys, self.max_bytes = max_keys, max_bytes
        self.keys: dict[int, KeyState] = {}
        self.bytes_held = 0
        # key -> bytes of a residual put back before the key's first push (in bytes_held)
        self.prepaid: dict[int, int] = {}

    def push(self, key: int, round: int, sender: int, payload: Payload,
             owned: bool = False, nonfinite: bool = False) -> Payload | None:
        """Add one worker's push; returns the round's answer when it completes.

        ``owned``: the payload's memory belongs to the server (it was decoded
        from the wire), so a dense first push may become the round's sum.
        ``nonfinite``: the sender saw a NaN or an infinity in it; the answered
        round's flagging ranks are then in ``keys[key].flagged``.
        """
        self.check_sender(sender)
        state = self.keys.get(key)
        if state is None:
            state = self._declare(key, payload)
        if payload.shape != state.shape or payload.dtype != state.dtype:
            raise PushRejected(
                f"key {key} holds {state.dtype} {state.shape}, push has {payload.dtype} {payload.shape}")
        if round != state.round:
            raise PushRejected(f"push for round {round} of key {key}, which is at round {state.round}")
        if sender in state.pushed:
            raise PushRejected(f"worker {sender} already pushed round {round} of key {key}")
        cast = payload.values.dtype if payload.codec == "dense" else None
        if state.pushed:
            state.add(payload)
            state.wire = state.wire if cast == state.wire else None
        else:
            state.start_round(payload, owned)
            state.union_bound = 0
            state.wire = cast if cast != state.dtype else None
        state.union_bound += payload.count
        state.pushed.add(sender)
        if nonfinite:
            state.flagging.add(sender)
        if len(state.pushed) < self.num_workers:
            return None
        state.pushed.clear()
        state.round += 1
        state.flagged, state.flagging = sorted(state.flagging), set()
        return in_dtype(self._answer(key, state, round), state.wire)

    def residual(self, key: int, round: int) -> torch.Tensor | None:
        """What re-sparsification has held back of ``key`` so far, as of ``round``: after
        every earlier round's answer, before this one's (a checkpoint's); None where nothing
        is held. Asked as of another round, it is refused: the worker's step and the
        server's would not match."""
        state = self.keys.get(key)
        at = state.round if state is not None else 0
        if round != at:
            raise PushRejected(f"the residual of key {key} was asked as of round {round}; the "
                               f"key is at round {at}")
        if self.resparsify is None:
            return None
        return self.resparsify.memory.residuals.get(residual_name(key))

    def restore(self, key: int, round: int, payload: Payload) -> None:
        """Hold ``payload`` (dense) as ``key``'s residual from ``round`` on: a resumed
        checkpoint's, put back before that round completes. A key not pushed yet is checked
        against it when its first push comes."""
        if self.resparsify is None:
            raise PushRejected(f"a residual came for key {key}, but this server does not re-sparsify "
                               f"its answers (BYTEPS_SERVER_COMPRESSOR is not set): the checkpoint "
                               f"was saved by a job whose servers did")
        if payload is None or payload.codec != "dense":
            raise PushRejected(f"the residual of key {key} must come dense, got "
                               f"{'no tensor' if payload is None else payload.codec}")
        state = self.keys.get(key)
        at = state.round if state is not None else 0
        if round != at:
            raise PushRejected(f"the residual of key {key} came for round {round}; the key is at "
                               f"round {at}")
        if state is not None:
            check_residual(key, payload.shape, payload.dtype, state)
        else:  # held from now on: it counts against the limits as the key will
            nbytes = payload.values.numel() * payload.values.element_size()
            others = self.bytes_held - self.prepaid.get(key, 0)
            if key not in self.prepaid and len(self.keys) + len(self.prepaid) >= self.max_keys:
                raise PushRejected(f"a residual for key {key} would exceed the server's limit of "
                                   f"{self.max_keys} keys")
            if others + nbytes > self.max_bytes:
                raise PushRejected(f"the residual of key {key} needs {nbytes} bytes; the server "
                                   f"holds {others} of its {self.max_bytes} byte limit "
                                   f"(PS_SERVER_MAX_BYTES)")
            self.bytes_held, self.prepaid[key] = others + nbytes, nbytes
        self.resparsify.memory.residuals[residual_name(key)] = \
            payload.values.view(payload.shape).clone()

    def check_sender(self, sender: int) -> None:
        """Refuse a push whose sender is not a worker rank."""
        if not 0 <= sender < self.num_workers:
            raise PushRejected(f"sender {sender} is not a worker rank (0..{self.num_workers - 1})")

    def _declare(self, key: int, payload: Payload) -> KeyState:
        if len(self.keys) + len(self.prepaid) - (key in self.prepaid) >= self.max_keys:
            raise PushRejected(f"key {key} would exceed the server's limit of {self.max_keys} keys")
        sparse = payload.codec != "dense"
        # two buffers, and a re-sparsifying server's residual for a sparse key
        copies = 3 if sparse and self.resparsify is not None else 2
        nbytes = copies * math.prod(payload.shape) * payload.dtype.itemsize
        others = self.bytes_held - self.prepaid.get(key, 0)  # (a residual put back is one copy)
        if others + nbytes > self.max_bytes:
            raise PushRejected(f"key {key} needs {nbytes} bytes; the server holds {others} "
                               f"of its {self.max_bytes} byte limit (PS_SERVER_MAX_BYTES)")
        state = KeyState(payload.shape, payload.dtype, sparse)
        held = self.resparsify.memory.residuals.get(residual_name(key)) if self.resparsify else None
        if held is not None:  # restored before the key's first push
            check_residual(key, tuple(held.shape), held.dtype, state)
        self.bytes_held += nbytes - self.prepaid.pop(key, 0)
        self.keys[key] = state
        return state

    def _answer(self, key: int, state: KeyState, round: int) -> Payload:
        aggregate, state.current = state.current, None
        touched, state.touched = state.touched, None
        comp, name = self.resparsify, residual_name(key)
        if comp is not None and not state.sparse and name in comp.memory.residuals:
            # a key that went dense since its residual was kept (a resumed job's cost model
            # routed it otherwise): what was held back goes out with this answer
            aggregate = aggregate + comp.memory.residuals.pop(name)
            touched = None
        if comp is not None and state.sparse and aggregate.numel() and comp.accepts(aggregate):
            width = None  # the compressor's own density
            if self.pushes_wide is not None:
                wide = math.floor(self.pushes_wide * state.union_bound / self.num_workers)
                # pushes that together are no wider go out as their sum, at the union's
                # cost, unless an earlier round's residual waits to go out with them
                if wide >= state.union_bound and name not in comp.memory.residuals:
                    comp = None
                else:
                    width = min(1.0, (wide + 0.5) / aggregate.numel())  # (+ 0.5: selection floors it)
            if comp is not None:
                answer = tightened(comp.compress(aggregate, name, round, width), aggregate)
                if state.flagged:  # the residual must not keep a NaN or an infinity for later rounds
                    comp.forget([name])
                return answer
        if touched is not None:
            return state.sparse_answer(aggregate, touched, round % 2)
        return smaller_encoding(aggregate, state.union_bound)
