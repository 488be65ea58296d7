"""Checkpoints the job can always resume from: generations, a commit across the workers,
and a resume from the newest step every worker holds intact.

Each worker keeps its own files, ``worker{rank}-step{step:08d}.pt`` in checkpoint_file.py's
format, in its ``--checkpoint-dir`` (on its own disk, or in a folder the workers share).
Saving step N (:meth:`Checkpoints.commit`):

1. every worker writes its file; a write that fails (a full disk) leaves no temporary file;
2. the workers tell each other whether their write worked: step N is committed only when
   every worker has written it. Each records the commit in ``worker{rank}.commit`` and only
   then removes its committed generations beyond the newest ``keep``;
3. a write that failed on any worker ends the job on every worker with one message naming
   the worker, the file and the error. Nothing is removed before a newer step is committed,
   so a full disk costs at most the steps since the last commit.

On start (:func:`restore`) every worker surveys its folder and the workers gather what each
holds. They resume from the newest step that every worker holds intact and for this job,
saying which and why any newer file was passed over; start fresh when no worker holds
anything; and otherwise refuse on every worker alike, naming each file at fault (one worker
resuming while another starts fresh trains replicas that never agree). Generations newer
than the resumed step were never committed; they are removed, as the run writes them again.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
from pathlib import Path

import torch
from torch import nn

import adtopk_ps.torch as bps
from adtopk_ps.client.errors import PushPullError
from adtopk_ps.cluster.transport import ClusterError

from .checkpoint_file import Damaged, read, read_header, write

log = logging.getLogger("adtopk_ps.checkpoint")

# the keys that define what a checkpoint holds (parameters, optimizer state, residuals);
# the others (lr, steps, schedule, batch size, seed) may change between runs, as when extending one
JOB_KEYS = ("model", "model_args", "dataset", "dataset_args", "compression")
REFUSED = "checkpoints refused on every worker, none trains:\n  "


class CheckpointError(ClusterError):
    """The workers' checkpoints cannot all resume one job, or a step could not be committed:
    raised on every worker alike."""


@dataclasses.dataclass(frozen=True)
class Finding:
    """What one worker holds in its checkpoint folder, as every worker is told it."""

    rank: int
    folder: str  # "" without --checkpoint-dir
    held: dict[int, str]  # step -> file, for every intact file of this job and cluster shape
    faults: tuple[tuple[str, str, str], ...] = ()  # (file, "damaged" or "foreign", why)
    committed: int | None = None  # the last step this worker recorded as committed


def job_identity(cfg: dict) -> dict:
    """The config keys a checkpoint belongs to, as they read back from its header."""
    job = {key: cfg.get(key) for key in JOB_KEYS}
    job["optimizer"] = cfg.get("optimizer", {}).get("name", "sgd")
    return json.loads(json.dumps(job, sort_keys=True, default=str))


def generation_path(directory: str | os.PathLike, rank: int, step: int) -> Path:
    """Where worker ``rank`` keeps its checkpoint of ``step`` in ``directory``."""
    return Path(directory) / f"worker{rank}-step{step:08d}.pt"


def generations(directory: str | os.PathLike, rank: int) -> dict[int, Path]:
    """Worker ``rank``'s checkpoint files in ``directory``, by step."""
    return {step: path for (_, step), path in files(directory, rank).items()}


def files(directory: str | os.PathLike, rank: int | None = None) -> dict[tuple[int, int], Path]:
    """Worker ``rank``'s (None: every worker's) checkpoint files in ``directory``, by (rank,
    step): only names :func:`generation_path` writes (``step8`` beside ``step00000008`` is
    not a second step 8)."""
    pattern = re.compile(r"worker(\d+)-step(\d+)\.pt")
    found = (pattern.fullmatch(p.name) for p in Path(directory).glob(
        f"worker{'*' if rank is None else rank}-step*.pt"))
    return {(int(m[1]), int(m[2])): Path(directory) / m[0] for m in found
            if m and generation_path(directory, int(m[1]), int(m[2])).name == m[0]}


class Checkpoints:
    """This worker's checkpoint folder during a run: it writes each generation, commits it
    with the other workers, and prunes.

    ``committed``: the steps every worker holds, as :func:`restore` found them; the same on
    every worker, so every worker's messages and pruning agree (a record file on disk may
    be stale or missing). Only committed generations are pruned, and only once a newer one
    is committed: a stray or damaged file named like a newer generation takes no slot.

    Example::

        start, committed = restore("ckpt", model, opt, cfg, total)
        checkpoints = Checkpoints("ckpt", keep=2, committed=committed)
        checkpoints.commit(model, opt, step=20, job=job_identity(cfg))
    """

    def __init__(self, directory: str | os.PathLike, keep: int, committed: list[int],
                 every_rank: bool = False) -> None:
        self.directory, self.keep = Path(directory), keep
        self.committed = sorted(committed)
        self.every_rank = every_rank  # prune every rank's files (an elastic job's ranks change)

    def commit(self, model: nn.Module, opt: torch.optim.Optimizer, *, step: int, job: dict,
               meta: dict | None = None, record: dict | None = None) -> Path:
        """Write this worker's checkpoint of ``step`` (its header holds ``meta`` too), commit
        it with every other worker's and keep the newest ``keep`` committed generations; the
        commit record holds ``record`` too. Every worker calls it at the same steps;
        :class:`CheckpointError` on every worker alike when any worker's write failed."""
        rank, workers = bps.rank(), bps.size()
        path = generation_path(self.directory, rank, step)
        try:
            # what the servers hold back from their answers, if anything: in worker 0's file,
            # and in every file where any worker's copy of a step may be the one resumed
            servers = bps.client().server_residuals() if rank == 0 or self.every_rank else None
            write(path, model, opt, {**(meta or {}), "job": job, "rank": rank, "step": step,
                                     "workers": workers}, servers)
            failure = None
        except OSError as exc:  # the file's temporary copy is gone; the older generations stay
            failure = f"worker {rank}: saving to {path} failed ({exc.strerror or exc})"
        except (PushPullError, TimeoutError) as exc:
            failure = f"worker {rank}: the servers' residuals for {path} could not be fetched ({exc})"
        failures = [f for f in bps.allgather_object(failure, name="checkpoint.commit") if f]
        if failures:
            then = (f"step {self.committed[-1]}, the last committed" if self.committed
                    else "the start (none committed)")
            raise CheckpointError(f"the step-{step} checkpoint is not committed: {'; '.join(failures)}; "
                                  f"the job stops, and a rerun resumes from {then}")
        self.committed.append(step)
        _record_commit(self.directory, rank, step, record)
        kept = set(self.committed[-self.keep:])
        for (_, old), file in files(self.directory, None if self.every_rank else rank).items():
            if old < step and old not in kept:
                remove(file, "an older generation")
        self.committed = sorted(kept)
        return path


def _record_commit(folder: Path, rank: int, step: int, extra: dict | None = None) -> None:
    """A record of the last committed step (and ``extra``); the files themselves decide a
    plain job's resume, so a record that cannot be written (a disk that just filled) costs
    only its mention in messages."""
    record, tmp = folder / f"worker{rank}.commit", folder / f"worker{rank}.commit.tmp"
    try:
        tmp.write_text(json.dumps({**(extra or {}), "step": step}) + "\n")
        os.replace(tmp, record)
    except OSError as exc:
        log.warning("worker %d: step %d is committed, but its record %s could not be written (%s)",
                    rank, step, record, exc.strerror or exc)
        tmp.unlink(missing_ok=True)


def _committed(folder: Path, rank: int) -> int | None:
    try:
        step = json.loads((folder / f"worker{rank}.commit").read_text())["step"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return step if type(step) is int else None


def remove(path: Path, why: str) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError as exc:
        log.warning("could not remove %s, %s: %s", path, why, exc.strerror or exc)


def survey(directory: str | None, rank: int, workers: int, job: dict) -> Finding:
    """What this worker holds: every generation read in full and checked, and the temporary
    files of an interrupted save removed."""
    if directory is None:
        return Finding(rank, "", {})
    folder = Path(directory).resolve()
    for tmp in [*folder.glob(f"worker{rank}-step*.pt.tmp"), folder / f"worker{rank}.commit.tmp"]:
        if tmp.is_file():
            remove(tmp, "left by an interrupted save")
    held, faults = {}, []
    for step, path in sorted(generations(folder, rank).items()):
        try:
            meta = read_header(path)
        except (Damaged, OSError) as exc:  # OSError: a file we may not read, say
            faults.append((str(path), "damaged", str(exc)))
            continue
        if "elastic" in meta:
            faults.append((str(path), "foreign", "saved by an elastic job"))
        elif (meta["workers"], meta["rank"]) != (workers, rank):
            faults.append((str(path), "foreign", f"saved by worker {meta['rank']} of "
                                                 f"{meta['workers']}, this is worker {rank} of {workers}"))
        elif meta["job"] != job:
            faults.append((str(path), "foreign", f"saved by another job: {differences(meta['job'], job)}"))
        elif meta["step"] != step:
            faults.append((str(path), "damaged", f"holds step {meta['step']} under the name of step {step}"))
        else:
            held[step] = str(path)
    return Finding(rank, str(folder), held, tuple(faults), _committed(folder, rank))


def differences(saved: dict, job: dict) -> str:
    keys = sorted(set(saved) | set(job))
    return ", ".join(f"{k}={saved.get(k)!r} where this job has {job.get(k)!r}"
                     for k in keys if saved.get(k) != job.get(k))


def decide(findings: list[Finding], total: int) -> tuple[int | None, list[str], list[int]]:
    """The step every worker resumes from (None: start fresh), notes on the files passed
    over, and the steps every worker holds (committed), or :class:`CheckpointError`. A
    function of the gathered findings alone, so every worker decides alike.

    Files that no step has in common are refused, unless none can have been committed (no
    worker's commit record reaches them: the first save failed, or a worker died in it):
    then they are passed over and the job starts fresh."""
    problems = [f"worker {f.rank}: {file} is foreign: {why}"
                for f in findings for file, state, why in f.faults if state == "foreign"]
    common = sorted(set.intersection(*(set(f.held) for f in findings)))
    if not problems and common:
        step = common[-1]
        if step < total:
            return step, _passed_over(findings, common), common
        problems = [f"worker {f.rank}: {f.held[step]} is too late: at step {step}, at or beyond the "
                    f"job's {total} steps: nothing left to train (raise --steps, or remove the "
                    f"checkpoints to start over)" for f in findings]
    elif not problems and not any(f.faults for f in findings) and _never_committed(findings):
        if len({bool(f.folder) for f in findings}) == 1:
            return None, _passed_over(findings, []), []
        # a fresh start where only some workers save: they would wait in every commit
        problems = ["--checkpoint-dir is given to some workers only: " + "; ".join(
            f"worker {f.rank} has {f.folder or 'none'}" for f in findings)
            + "; give it to every worker or to none"]
    elif not problems:
        problems = [f"worker {f.rank}: {file} is damaged: {why}" for f in findings for file, _, why in f.faults]
        problems.append("no step is held intact by every worker: " + "; ".join(map(_holding, findings))
                        + _last_commit(findings) + "; restore the missing files, or remove every "
                        "worker*-step*.pt and worker*.commit file to start over")
    raise CheckpointError(REFUSED + "\n  ".join(problems))


def _last_record(findings: list[Finding]) -> int | None:
    """The newest step any worker's commit record names."""
    return max((f.committed for f in findings if f.committed is not None), default=None)


def _never_committed(findings: list[Finding]) -> bool:
    held = [s for f in findings for s in f.held]
    last = _last_record(findings)
    return not held or last is None or last < min(held)


def _last_commit(findings: list[Finding]) -> str:
    last = _last_record(findings)
    return f" (step {last} was committed)" if last is not None else ""


def _holding(f: Finding) -> str:
    if not f.folder:
        return f"worker {f.rank} has no --checkpoint-dir"
    if not f.held:
        return f"worker {f.rank} holds none ({f.folder})"
    return f"worker {f.rank} holds step(s) {', '.join(map(str, sorted(f.held)))} ({f.folder})"


def _passed_over(findings: list[Finding], common: list[int]) -> list[str]:
    notes = [f"worker {f.rank}'s step {s} ({f.held[s]}) is not held by every worker, so it was "
             f"never committed: removed" for f in findings for s in sorted(f.held) if s not in common]
    notes += [f"worker {f.rank}'s {file} is damaged ({why})" for f in findings for file, _, why in f.faults]
    step = common[-1] if common else -1
    committed = {f.committed for f in findings if f.committed is not None and f.committed > step}
    notes += [f"step {c} was committed, but not every worker still holds it intact" for c in sorted(committed)]
    return notes


def restore(directory: str | None, model: nn.Module, opt: torch.optim.Optimizer, cfg: dict,
            total: int) -> tuple[int | None, list[int]]:
    """Resume every worker from one step, or none: the step to continue from (None: start
    fresh) and the steps every worker holds, for :class:`Checkpoints`.

    Every worker calls it at start-up, with or without a checkpoint directory, before the
    first step; it raises :class:`CheckpointError` on every worker alike when they cannot all
    resume one job at one step.

    Example::

        start, committed = restore(args.checkpoint_dir, model, opt, cfg, total)
        if start is None:
            bps.broadcast_parameters(model.state_dict(), root_rank=0)
    """
    rank, workers = bps.rank(), bps.size()
    mine = survey(directory, rank, workers, job_identity(cfg))
    step, notes, committed = decide(bps.allgather_object(mine, name="checkpoint.findings"), total)
    if step is not None:
        path = Path(mine.held[step])
        _check_loaded(path, load_into(path, model, opt), model)
    for held, file in mine.held.items():
        if held not in committed:
            remove(Path(file), "never committed")
    if rank == 0 and (step is not None or notes):
        print((f"resuming from step {step}, the newest step every worker holds intact"
               if step is not None else "starting fresh: no step was ever committed")
              + "".join(f"\n  {note}" for note in notes), flush=True)
    return step, committed


def load_into(path: Path, model: nn.Module, opt: torch.optim.Optimizer) -> str | None:
    """Load ``path`` into ``model`` and ``opt`` (on their devices): None, or what failed.
    Any failure is reported to every worker, never raised here: the others would wait.

    Example::

        failure = load_into(generation_path("ckpt", 0, 20), model, opt)
    """
    try:
        _, state = read(path)
    except (Damaged, OSError) as exc:  # changed since the survey
        return f"{path} is damaged: {exc}"
    try:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
    except Exception as exc:
        return f"{path} is foreign: does not fit this model or optimizer: {str(exc).splitlines()[0]}"
    try:
        if "servers" in state:  # before any push of the resumed job
            bps.client().restore_server_residuals(state["servers"])
    except (ValueError, PushPullError, TimeoutError) as exc:
        return f"the servers' residuals in {path} cannot be put back: {str(exc).splitlines()[0]}"
    return None


def parameters_digest(model: nn.Module) -> str:
    """16 hex digits of a sha256 over the parameters: equal on every worker after each step."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def _check_loaded(path: Path, failure: str | None, model: nn.Module) -> None:
    """Every worker loaded its file, and they hold the same parameters: data-parallel workers
    do after every step, so intact checkpoints that differ come from different runs (a re-run
    with another seed, an old copy)."""
    reports = bps.allgather_object((failure, None if failure else parameters_digest(model), str(path)),
                                   name="checkpoint.parameters")
    failed = [f"worker {r}: {why}" for r, (why, _, _) in enumerate(reports) if why]
    if failed:
        raise CheckpointError(REFUSED + "\n  ".join(failed))
    if len({digest for _, digest, _ in reports}) > 1:
        held = "; ".join(f"worker {r} ({file}) {digest}" for r, (_, digest, file) in enumerate(reports))
        raise CheckpointError(f"{REFUSED}they hold different parameters, so they come from "
                              f"different runs: {held}")
