"""Checkpoints on disk for the elastic training job: a job whose workers come and go resumes
from the newest step any worker holds a committed, intact copy of, with however many
workers it has now.

An elastic job's replicas are equal after every step, so one copy of a step is the whole
job's state (the parameters, the optimizer's, the step and how far the epoch got). Saving
is checkpoint.py's commit: every worker writes its copy, ``worker{rank}-step{N:08d}.pt`` by
its rank then, and step N is committed only once every worker wrote it. Each worker prunes
every rank's older files in its folder, since ranks change with the membership.

On start the workers gather what each folder holds (shared, or one per host) and resume from
the newest step that was committed (a commit record names it, or copies from every rank of
that save are there) and that some worker holds intact. Its lowest-ranked holder loads it
and hands it to the others. The error-feedback residuals start at zero, as a joiner's do:
they were each worker's own, and the workers are not the same ones. Copies of one step
that hold different parameters come from different runs, and are refused.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch
from torch import nn

import adtopk_ps.torch as bps

from . import checkpoint
from .checkpoint import REFUSED, CheckpointError
from .checkpoint_file import Damaged, read_header


@dataclasses.dataclass(frozen=True)
class Copy:
    """One intact file of a step, as its header says."""

    path: str
    step: int
    saved_by: int  # the rank that saved it
    workers: int  # how many workers the job had then
    digest: str  # of its parameters
    epoch: int
    processed: int


@dataclasses.dataclass(frozen=True)
class Holdings:
    """What one worker's folder holds, as every worker is told it."""

    rank: int
    folder: str  # "" without --checkpoint-dir
    copies: tuple[Copy, ...] = ()
    faults: tuple[tuple[str, str, str], ...] = ()  # (file, "damaged" or "foreign", why)
    committed: int | None = None  # the newest step a commit record in the folder names


def meta(state: bps.elastic.TorchState, model: nn.Module) -> dict:
    """What an elastic copy's header holds beside the job: where the epoch got, and a digest
    of the parameters (copies of one step must agree)."""
    return {"elastic": {"epoch": state.epoch, "processed": state.processed,
                        "digest": checkpoint.parameters_digest(model)}}


def survey(directory: str | None, rank: int, job: dict) -> Holdings:
    """Every checkpoint file in this worker's folder, whoever saved it, read in full and
    checked; temporary files of an interrupted save removed."""
    if directory is None:
        return Holdings(rank, "")
    folder = Path(directory).resolve()
    for tmp in [*folder.glob("worker*-step*.pt.tmp"), *folder.glob("worker*.commit.tmp")]:
        checkpoint.remove(tmp, "left by an interrupted save")
    copies, faults = [], []
    for (saved_by, step), path in sorted(checkpoint.files(folder).items()):
        try:
            head = read_header(path)
        except (Damaged, OSError) as exc:
            faults.append((str(path), "damaged", str(exc)))
            continue
        extra = head.get("elastic")
        if not isinstance(extra, dict):
            faults.append((str(path), "foreign", "saved by a job that is not elastic"))
        elif head["job"] != job:
            faults.append((str(path), "foreign",
                           f"saved by another job: {checkpoint.differences(head['job'], job)}"))
        elif (head["step"], head["rank"]) != (step, saved_by):
            faults.append((str(path), "damaged", f"holds worker {head['rank']}'s step {head['step']}"))
        else:
            copies.append(Copy(str(path), step, saved_by, head["workers"], str(extra.get("digest")),
                               int(extra.get("epoch", 0)), int(extra.get("processed", 0))))
    records = [checkpoint.recorded(folder, int(p.name[6:-7])) for p in folder.glob("worker*.commit")
               if p.name[6:-7].isdigit()]
    newest = max((r for r in records if r is not None), default=None)
    return Holdings(rank, str(folder), tuple(copies), tuple(faults), newest)


def decide(holdings: list[Holdings], total: int) -> tuple[Copy | None, list[str], list[int]]:
    """The copy to resume from (None: start fresh), notes on what was passed over, and the
    committed steps some worker holds; or :class:`CheckpointError`. A function of the
    gathered holdings alone, so every worker decides alike."""
    if len({bool(h.folder) for h in holdings}) > 1:
        raise CheckpointError(REFUSED + "--checkpoint-dir is given to some workers only: " + "; ".join(
            f"worker {h.rank} has {h.folder or 'none'}" for h in holdings)
            + "; give it to every worker or to none")
    problems = [f"worker {h.rank}: {file} is foreign: {why}"
                for h in holdings for file, state, why in h.faults if state == "foreign"]
    if problems:
        raise CheckpointError(REFUSED + "\n  ".join(problems))
    by_step: dict[int, dict[str, Copy]] = {}
    for h in holdings:
        for c in h.copies:
            by_step.setdefault(c.step, {})[c.path] = c  # a shared folder: each file once
    record = max((h.committed for h in holdings if h.committed is not None), default=None)

    def committed(step: int) -> bool:
        copies = by_step[step].values()
        return (record is not None and step <= record) or \
            {c.saved_by for c in copies} >= set(range(max(c.workers for c in copies)))

    steps = sorted((s for s in by_step if committed(s)), reverse=True)
    damaged = list(dict.fromkeys(f"{file} is damaged ({why})" for h in holdings  # a shared
                                 for file, _, why in h.faults))  # folder: each file once
    notes = [f"step {s} was never committed (not every worker saved it): passed over"
             for s in sorted(by_step) if not committed(s)] + damaged
    if not steps:
        if record is None and not damaged:
            return None, notes, []
        raise CheckpointError(REFUSED + "\n  ".join(
            damaged + [f"no intact copy of a committed step is left"
                       + (f" (step {record} was committed)" if record is not None else "")
                       + "; restore the files, or remove every worker*-step*.pt and "
                         "worker*.commit file to start over"]))
    step = steps[0]
    copies = sorted(by_step[step].values(), key=lambda c: c.path)
    if len({c.digest for c in copies}) > 1:
        raise CheckpointError(f"{REFUSED}the copies of step {step} hold different parameters, so "
                              "they come from different runs: " + "; ".join(
                                  f"{c.path} {c.digest}" for c in copies))
    if step >= total:
        raise CheckpointError(f"{REFUSED}{copies[0].path} is too late: at step {step}, at or beyond "
                              f"the job's {total} steps: nothing left to train (raise --steps, or "
                              "remove the checkpoints to start over)")
    if record is not None and record > step:
        notes.append(f"step {record} was committed, but no intact copy of it is left")
    return copies[0], notes, sorted(steps)


def restore(directory: str | None, state: bps.elastic.TorchState, model: nn.Module,
            opt: torch.optim.Optimizer, cfg: dict, total: int) -> list[int]:
    """Resume every worker from the newest committed copy any of them holds, or start fresh:
    the committed steps (for :class:`checkpoint.Checkpoints`). Every worker calls it, before
    the first step, inside ``elastic.run`` (a re-form in it starts it again).

    Example::

        committed = restore(args.checkpoint_dir, state, model, opt, cfg, total)
    """
    rank = bps.rank()
    holdings = bps.allgather_object(survey(directory, rank, checkpoint.job_identity(cfg)),
                                    name="checkpoint.findings")
    chosen, notes, committed = decide(holdings, total)
    if chosen is not None:
        holder = min(h.rank for h in holdings if any(c.path == chosen.path for c in h.copies))
        failure = None
        if rank == holder:
            with bps.elastic.own_residuals(opt):
                failure = checkpoint.load_into(Path(chosen.path), model, opt)
            state.step, state.epoch, state.processed = chosen.step, chosen.epoch, chosen.processed
            state.save()
        failure = bps.broadcast_object(failure, holder, name="checkpoint.loaded")
        if failure:
            raise CheckpointError(f"{REFUSED}worker {holder}: {failure}")
        state.sync_from(holder)
        state.save()
        if checkpoint.parameters_digest(model) != chosen.digest:  # synced: every worker finds it
            raise CheckpointError(f"{REFUSED}{chosen.path} loaded parameters other than its "
                                  f"header's digest {chosen.digest}")
    mine = next(h for h in holdings if h.rank == rank)
    for c in mine.copies:
        if c.step not in committed and os.path.exists(c.path):
            checkpoint.remove(Path(c.path), "never committed")
    if rank == 0 and (chosen is not None or notes):
        print((f"resuming from step {chosen.step} ({chosen.path}), the newest committed step, "
               f"with {bps.size()} worker(s)" if chosen is not None
               else "starting fresh: no step was ever committed")
              + "".join(f"\n  {note}" for note in notes), flush=True)
    return committed
