"""The same compressors on torch.distributed, as a DDP communication hook.

    state = ADTopkHookState(model, {"compressor": "adtopk", "k": 0.01, "ef": "vanilla"})
    model.register_comm_hook(state, adtopk_hook)

Hybrid communication, as in the paper: the bucket's dense tensors (those
the partial-sparsification policy keeps dense) are summed with one
all_reduce; the sparse payloads of the rest are packed into one byte buffer
per rank and exchanged with one all_gather, then every rank sums all ranks'
payloads into its bucket with ``scatter_add_``. The byte packing keeps the
uint8/uint16 indices compact and works on every backend (gloo, NCCL).

(No ``from __future__ import annotations`` here: DDP checks the hook's
annotations against the real ``dist.GradBucket`` class.)
"""

import hashlib
import logging
import weakref
from typing import Mapping

import torch
import torch.distributed as dist

from adtopk_ps.compression import Compressor, Request, start_each
from adtopk_ps.core.payload import Payload
from adtopk_ps.torch.agreement import agree, describe
from adtopk_ps.torch.gradient_compression import GradientCompression
from adtopk_ps.wire.checks import check_positions

_ALIGN = 8  # segments start at multiples of 8 bytes, so byte views reinterpret cleanly


class ADTopkHookState:
    """What :func:`adtopk_hook` needs: the compression (its residuals), each parameter's name,
    the process group. Everything is kept by parameter name, so the state pickles as
    PowerSGD's does: ``torch.save`` it with the model's state_dict, ``torch.load`` both,
    load the state_dict into a new model and register the state on its DDP; the process
    group is left out and is the default group after loading (set ``process_group`` to
    change it).

    Example::

        ddp = torch.nn.parallel.DistributedDataParallel(model)
        state = bps.ADTopkHookState(model, {"compressor": "adtopk", "k": 0.01, "ef": "vanilla"})
        ddp.register_comm_hook(state, bps.adtopk_hook)
        torch.save({"model": ddp.state_dict(), "hook": state}, path)   # later: torch.load
    """

    def __init__(self, model: torch.nn.Module, compression: Compressor | str | Mapping | GradientCompression,
                 process_group: dist.ProcessGroup | None = None):
        """Unlike PowerSGD's, the constructor runs one collective: every rank of
        ``process_group`` compares what it will send (compressor, density, which tensors go
        sparse) and all raise :class:`.Disagreement` alike where any differs, since a rank
        that sparsified otherwise would be summed into the others silently. The model gives
        the parameters' names."""
        self.compression = GradientCompression.of(compression)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.compression.plan(named)
        group = process_group if process_group is not None else dist.group.WORLD
        agree(describe(named, self.compression, {}), lambda obj, _name: _all_gather(obj, group))
        self.names = {id(p): n for n, p in named}
        self._params = {n: weakref.ref(p) for n, p in named}
        self.process_group = process_group
        self.steps: dict[str, int] = {}
        self._saved: dict[str, str] = {}  # a loaded state's parameter digests, by name

    def __getstate__(self) -> dict:
        """Everything but the process group and the parameters themselves: in their place, a
        digest of each parameter's values, by which a loaded state knows its new model's
        parameters (the checkpoint restores them alongside it; see :meth:`name_of`)."""
        logging.getLogger("torch.distributed").warning(
            "NOTE: Process group is not serializable and excluded from a saved state.")
        digests = dict(self._saved)
        for name, ref in self._params.items():
            p = ref()
            if p is not None:
                digests[name] = _digest(p)
        state = {k: v for k, v in self.__dict__.items()
                 if k not in ("process_group", "names", "_params", "_saved")}
        return {**state, "_saved": digests}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.process_group = None  # the default group; set it after loading to change it
        self.names, self._params = {}, {}

    def name_of(self, p: torch.Tensor) -> str:
        """``p``'s name. A loaded state learns its new model's parameters at their first
        gradient, by their values: the model's state_dict from the same checkpoint gives
        each parameter the values it had when the state was saved (equal ones are taken in
        the model's order)."""
        name = self.names.get(id(p))
        if name is not None:
            return name
        digest = _digest(p)
        name = next((n for n, d in self._saved.items() if d == digest and n not in self._params),
                    None)
        if name is None:
            raise ValueError(f"a parameter of shape {tuple(p.shape)} has values that no "
                             f"parameter had when this ADTopkHookState was saved: load the "
                             f"model's state_dict from the same checkpoint as the state, "
                             f"before the first backward")
        self.names[id(p)] = name
        self._params[name] = weakref.ref(p)
        return name


def _digest(p: torch.Tensor) -> str:
    """A parameter's shape, dtype and values, as a short hash."""
    raw = p.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes()
    return hashlib.blake2b(f"{tuple(p.shape)}{p.dtype}".encode() + raw, digest_size=16).hexdigest()


def _all_gather(obj: object, group: dist.ProcessGroup) -> list:
    gathered = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, obj, group=group)
    return gathered


def _pad(n: int) -> int:
    return -n % _ALIGN


def _sizes(p: Payload) -> list[int]:
    """What another rank needs to cut ``p`` out of a blob: its count, and how many rows a
    fibre payload carries where it leaves some out (-1 where it carries all)."""
    return [p.count, -1 if p.rows is None else p.rows.numel()]


def _segments(p: Payload, count: int, carried: int) -> list[tuple[torch.dtype, int] | None]:
    """(dtype, elements) of the values, indices and row set of a payload like ``p`` with
    these sizes; None for each it lacks."""
    return [(p.values.dtype, count), None if p.indices is None else (p.indices.dtype, count),
            None if carried < 0 else (torch.int64, carried)]


def _pack(payloads: list[Payload], device: torch.device) -> torch.Tensor:
    parts = []
    for p in payloads:
        for t in (p.values, p.indices, p.rows):
            if t is None:
                continue
            raw = t.contiguous().view(-1).view(torch.uint8)
            parts += [raw, torch.zeros(_pad(raw.numel()), dtype=torch.uint8, device=device)]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8, device=device)


def _unpack(blob: torch.Tensor, like: list[Payload], sizes: list[list[int]]) -> list[Payload]:
    """Another rank's payloads, given ours as the template (same codecs, shapes, dtypes)."""
    out, at = [], 0
    for p, (count, carried) in zip(like, sizes):
        tensors = []
        for segment in _segments(p, count, carried):
            if segment is None:
                tensors.append(None)
                continue
            dtype, elements = segment
            n = elements * dtype.itemsize
            tensors.append(blob[at:at + n].view(dtype))
            at += n + _pad(n)
        values, indices, rows = tensors
        if p.codec == "fibre":  # (rows carried, kept per fibre, ...): every rank keeps as many
            shape = (p.view[0] if rows is None else rows.numel(), p.values.shape[1], *p.view[2:])
            values, indices = values.view(shape), indices.view(shape)
        q = Payload(p.codec, p.shape, p.dtype, values, indices, p.view, p.seed, rows)
        check_positions(q)
        out.append(q)
    return out


def adtopk_hook(state: ADTopkHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP communication hook: dense tensors of the bucket in one all_reduce, sparse payloads in one all_gather.

    Every rank sums every rank's payloads itself, so the result equals the PS path's
    average. Register it with the state built by :class:`ADTopkHookState`.

    Example::

        ddp.register_comm_hook(bps.ADTopkHookState(model, "adtopk"), bps.adtopk_hook)
    """
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    buffer = bucket.buffer()
    grads = bucket.gradients()
    dense, sparse, calls = [], [], []
    for p, g in zip(bucket.parameters(), grads):
        name = state.name_of(p)
        comp, ratio = state.compression.for_tensor(name)
        if comp is None:
            dense.append(g)
            continue
        step = state.steps.get(name, 0)
        state.steps[name] = step + 1
        sparse.append(g)
        calls.append((comp, Request(g, name, step, ratio)))
    # a bucket's tensors go to each compressor at once (one CUDA kernel launch for ADTopk)
    payloads = list(start_each(calls))

    futures = []
    flat_dense = torch.cat([g.reshape(-1) for g in dense]) if dense else None
    if flat_dense is not None:
        futures.append(dist.all_reduce(flat_dense, group=group, async_op=True).get_future())
    gathered: list[torch.Tensor] = []
    all_counts: list[list[list[int]]] = []
    if payloads:
        counts = torch.tensor([_sizes(p) for p in payloads], dtype=torch.int64, device=buffer.device)
        count_lists = [torch.empty_like(counts) for _ in range(world)]
        dist.all_gather(count_lists, counts, group=group)  # variable-size payloads need this
        all_counts = [c.tolist() for c in count_lists]
        local = _pack(payloads, buffer.device)
        longest = max(_packed_size(payloads, c) for c in all_counts)
        local = torch.cat([local, local.new_zeros(longest - local.numel())])
        gathered = [torch.empty_like(local) for _ in range(world)]
        futures.append(dist.all_gather(gathered, local, group=group, async_op=True).get_future())

    def finish(_) -> torch.Tensor:
        if flat_dense is not None:
            flat_dense.div_(world)
            at = 0
            for g in dense:
                g.copy_(flat_dense[at:at + g.numel()].view_as(g))
                at += g.numel()
        for g in sparse:
            g.zero_()
        for blob, counts in zip(gathered, all_counts):
            for g, q in zip(sparse, _unpack(blob, payloads, counts)):
                q.accumulate_into(g)
        for g in sparse:
            g.div_(world)
        return buffer

    return torch.futures.collect_all(futures).then(finish)


def _packed_size(like: list[Payload], sizes: list[list[int]]) -> int:
    size = 0
    for p, (count, carried) in zip(like, sizes):
        for segment in _segments(p, count, carried):
            if segment is not None:
                n = segment[1] * segment[0].itemsize
                size += n + _pad(n)
    return size
