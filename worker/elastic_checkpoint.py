"""Checkpoints on disk for the elastic training job: a job whose workers come and go resumes
from the newest step any worker holds a committed, intact copy of, with however many
workers it has now.

An elastic job's replicas are equal after every step, so one copy of a step is the whole
job's state (the parameters, the optimizer's, the step and how far the epoch got). Saving
is checkpoint.py's commit: every worker writes its copy, ``worker{rank}-step{N:08d}.pt`` by
its rank then, and step N is committed only once every worker wrote it. Each worker prunes
every rank's older files in its folder, since ranks change with the membership.

A commit is what its records say. After every worker wrote its copy of step N, each
worker writes ``worker{rank}.commit`` in its folder: the job's *run* (one more than the
newest run any record named when this run started) and the step and parameters' digest of
every generation it keeps. On start the workers gather what each folder holds (shared, or
one per host) and resume from the committed copy of the newest run, and within it of the
newest step, that some worker holds intact. A copy no record names with its digest was
never committed: a save cut short by a re-form leaves copies of step N that the job then
rolled back and took again with other workers, and such a copy is of step N but not of
the job's step N. A host that missed a run keeps records of an older run, which the newer
run's commits outrank. The lowest-ranked holder loads the chosen copy and hands it to the
others, who check the parameters against the digest. The error-feedback residuals start
at zero, as a joiner's do: they were each worker's own, and the workers are not the same
ones. Two copies of one step that one run committed with different parameters, or a
record that cannot be read, are refused.
"""
from __future__ import annotations

import dataclasses
import json
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
    committed: tuple[tuple[int, str, int], ...] = ()  # (step, digest, run) records name


def meta(state: bps.elastic.TorchState, digest: str) -> dict:
    """What an elastic copy's header holds beside the job: where the epoch got, and the
    digest of the parameters (a commit record names it)."""
    return {"elastic": {"epoch": state.epoch, "processed": state.processed, "digest": digest}}


def kept(saved: dict[int, str], step: int, digest: str, keep: int) -> dict[int, str]:
    """The generations kept once ``step`` is committed (the newest ``keep``, as
    :class:`checkpoint.Checkpoints` prunes), with their digests."""
    return dict(sorted({**saved, step: digest}.items())[-keep:])


def record(kept: dict[int, str], run: int) -> dict:
    """What a commit record holds: the run, and the digest of every generation kept."""
    return {"run": run, "kept": {str(step): digest for step, digest in kept.items()}}


def _records(folder: Path) -> tuple[set[tuple[int, str, int]], list[tuple[str, str, str]]]:
    """(step, digest, run) of every commit a record in ``folder`` names, and the records that
    cannot be read, as damaged: what they named is unknown, so nothing may be taken for
    never committed on their account."""
    named, faults = set(), []
    for path in sorted(folder.glob("worker*.commit")):
        try:
            content = json.loads(path.read_text())
            kept, run = content["kept"], content["run"]
            if type(run) is not int or not all(isinstance(digest, str) for digest in kept.values()):
                raise ValueError("a run that is not an integer, or a digest that is not a string")
            named |= {(int(step), digest, run) for step, digest in kept.items()}
        except (OSError, ValueError, KeyError, AttributeError, TypeError) as exc:
            faults.append((str(path), "damaged", f"an unreadable commit record ({exc})"))
    return named, faults


def survey(directory: str | None, rank: int, job: dict) -> Holdings:
    """Every checkpoint file in this worker's folder, whoever saved it, read in full and
    checked; temporary files of an interrupted save removed."""
    if directory is None:
        return Holdings(rank, "")
    folder = Path(directory).resolve()
    for tmp in [*folder.glob("worker*-step*.pt.tmp"), *folder.glob("worker*.commit.tmp")]:
        checkpoint.remove(tmp, "left by an interrupted save")
    records, faults = _records(folder)
    copies = []
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
            copies.append(Copy(str(path), step, str(extra.get("digest")),
                               int(extra.get("epoch", 0)), int(extra.get("processed", 0))))
    return Holdings(rank, str(folder), tuple(copies), tuple(faults), tuple(sorted(records)))


def decide(holdings: list[Holdings], total: int) -> tuple[Copy | None, list[str], dict[int, str]]:
    """The copy to resume from (None: start fresh), notes on what was passed over, and the
    committed steps some worker holds, with their digests; or :class:`CheckpointError`. A
    function of the gathered holdings alone, so every worker decides alike."""
    if len({bool(h.folder) for h in holdings}) > 1:
        raise CheckpointError(REFUSED + "--checkpoint-dir is given to some workers only: " + "; ".join(
            f"worker {h.rank} has {h.folder or 'none'}" for h in holdings)
            + "; give it to every worker or to none")
    problems = list(dict.fromkeys(f"{file} is foreign: {why}" for h in holdings
                                  for file, state, why in h.faults if state == "foreign"))
    if problems:
        raise CheckpointError(REFUSED + "\n  ".join(problems))
    # copies by (step, digest); in a shared folder each file once
    groups: dict[tuple[int, str], dict[str, Copy]] = {}
    for h in holdings:
        for c in h.copies:
            groups.setdefault((c.step, c.digest), {})[c.path] = c
    runs: dict[tuple[int, str], int] = {}  # each committed (step, digest): the newest run naming it
    for h in holdings:
        for step, digest, run in h.committed:
            runs[step, digest] = max(run, runs.get((step, digest), 0))
    held = sorted((g for g in groups if g in runs), key=lambda g: (runs[g], g[0]), reverse=True)
    damaged = list(dict.fromkeys(f"{file} is damaged ({why})" for h in holdings  # a shared
                                 for file, state, why in h.faults if state == "damaged"))  # folder
    if not held:
        notes = [f"{c.path} (step {c.step}) no commit record names it: passed over"
                 for g in sorted(groups) for c in groups[g].values()] + damaged
        if not runs and not damaged:  # a first save that never committed, or none at all
            return None, notes, {}
        newest = max(runs, default=None)
        raise CheckpointError(REFUSED + "\n  ".join(
            damaged + ["no intact copy of a committed step is left"
                       + (f" (step {newest[0]} was committed)" if newest else "")
                       + "; restore the files, or remove every worker*-step*.pt and "
                         "worker*.commit file to start over"]))
    best = held[0]
    rivals = [g for g in held if (runs[g], g[0]) == (runs[best], best[0])]
    if len(rivals) > 1:
        raise CheckpointError(f"{REFUSED}run {runs[best]} committed step {best[0]} with different "
                              "parameters, so its records come from different runs: " + "; ".join(
                                  f"{c.path} {c.digest}" for g in rivals for c in groups[g].values()))
    chosen = sorted(groups[best].values(), key=lambda c: c.path)[0]
    if best[0] >= total:
        raise CheckpointError(f"{REFUSED}{chosen.path} is too late: at step {best[0]}, at or beyond "
                              f"the job's {total} steps: nothing left to train (raise --steps, or "
                              "remove the checkpoints to start over)")
    # what this run holds of its own commits goes on; everything else is passed over
    lineage = {g[0]: g[1] for g in held if runs[g] == runs[best] and g[0] <= best[0]}
    notes = [f"{c.path} (step {c.step}) " + ("no commit record names it" if g not in runs else
                                             f"is of run {runs[g]}, which run {runs[best]} "
                                             f"went on from")
             + ": passed over" for g in sorted(groups) if lineage.get(g[0]) != g[1]
             for c in groups[g].values()] + damaged
    lost = max((s for (s, _), r in runs.items() if r == runs[best]), default=best[0])
    if lost > best[0]:
        notes.append(f"step {lost} was committed, but no intact copy of it is left")
    return chosen, notes, lineage


def run_number(holdings: list[Holdings]) -> int:
    """This run's number: one more than any record names."""
    return 1 + max((run for h in holdings for _, _, run in h.committed), default=0)


def restore(directory: str | None, state: bps.elastic.TorchState, model: nn.Module,
            opt: torch.optim.Optimizer, cfg: dict, total: int) -> dict[int, str]:
    """Resume every worker from the newest committed copy any of them holds, or start fresh:
    the committed steps and their digests (for the commits to come). Every worker calls it, before
    the first step, inside ``elastic.run`` (a re-form in it starts it again).

    Example::

        committed = restore(args.checkpoint_dir, state, model, opt, cfg, total)
    """
    rank = bps.rank()
    holdings = bps.allgather_object(survey(directory, rank, checkpoint.job_identity(cfg)),
                                    name="checkpoint.findings")
    chosen, notes, committed = decide(holdings, total)
    state.run = run_number(holdings)
    if chosen is not None:
        holder = min(h.rank for h in holdings if any((c.path, c.digest) == (chosen.path, chosen.digest)
                                                     for c in h.copies))
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
        if committed.get(c.step) != c.digest:
            checkpoint.remove(Path(c.path), "passed over")
    if rank == 0 and (chosen is not None or notes):
        print((f"resuming from step {chosen.step} ({chosen.path}), the newest committed step, "
               f"with {bps.size()} worker(s)" if chosen is not None
               else "starting fresh: no commit record names a copy here")
              + "".join(f"\n  {note}" for note in notes), flush=True)
    return committed
