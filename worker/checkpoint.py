"""Per-worker checkpoints that are verified, and agreed on by every worker, before a resume.

A checkpoint file is a header and a payload::

    adtopk-ps checkpoint 1\\n
    <sha256 of everything after this line, 64 hex digits>\\n
    {"bytes": ..., "job": {...}, "rank": 0, "step": 20, "workers": 2}\\n
    <torch.save of {"model": ..., "optimizer": ...}>

so a flipped byte anywhere, an empty or truncated file, or another job's or
cluster shape's file is found before ``torch.load`` reads it. On resume every
worker reports what it found and the workers gather the reports: the job
resumes only when every worker holds a valid checkpoint of this job at the
same step, starts fresh only when none does, and otherwise stops on every
worker alike with one message naming each file and worker at fault (one
worker resuming while another starts fresh trains replicas that never agree).
"""
from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
from pathlib import Path

import torch
from torch import nn

import adtopk_ps.torch as bps
from adtopk_ps.transport import ClusterError

MAGIC = b"adtopk-ps checkpoint 1\n"
# the keys that define what a checkpoint holds (parameters, optimizer state, residuals);
# the others (lr, steps, schedule, batch size, seed) may change between runs, as when extending one
JOB_KEYS = ("model", "model_args", "dataset", "dataset_args", "compression")


class CheckpointError(ClusterError):
    """The workers' checkpoints cannot all resume one job: refused on every worker alike."""


class Damaged(ValueError):
    """A checkpoint file that is not intact; the message says how."""


@dataclasses.dataclass(frozen=True)
class Finding:
    """What one worker found at its checkpoint path, as every worker is told it."""

    rank: int
    path: str
    state: str  # "off" (no checkpoint dir), "absent", "valid", "damaged", "foreign" or "late"
    reason: str = ""
    step: int | None = None


def job_identity(cfg: dict) -> dict:
    """The config keys a checkpoint belongs to, as they read back from its header."""
    job = {key: cfg.get(key) for key in JOB_KEYS}
    job["optimizer"] = cfg.get("optimizer", {}).get("name", "sgd")
    return json.loads(json.dumps(job, sort_keys=True, default=str))


def checkpoint_path(directory: str | os.PathLike, rank: int) -> Path:
    """Where worker ``rank`` keeps its checkpoint in ``directory``."""
    return Path(directory) / f"worker{rank}.pt"


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def header_for(meta: dict, payload: bytes | memoryview) -> bytes:
    """The header that goes before ``payload`` (``torch.save`` bytes) for ``meta``."""
    line = json.dumps({**meta, "bytes": len(payload)}, sort_keys=True).encode() + b"\n"
    digest = hashlib.sha256(line)
    digest.update(payload)
    return MAGIC + digest.hexdigest().encode() + b"\n" + line


def on_cpu(state: object) -> object:
    """``state`` (nested dicts, lists and tuples) with every tensor copied to the CPU: a
    checkpoint names no device, so one saved on a GPU resumes on a CPU and the other way round."""
    if isinstance(state, torch.Tensor):
        return state.detach().cpu()
    if isinstance(state, dict):
        return {key: on_cpu(value) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(on_cpu(value) for value in state)
    return state


def save(path: Path, model: nn.Module, opt: torch.optim.Optimizer, *, step: int, workers: int,
         rank: int, job: dict) -> None:
    """Write ``path`` atomically: a temporary file beside it, fsync, rename, fsync the directory.

    A crash at any moment leaves either the previous checkpoint or this one, never a torn file.
    Tensors are saved from the CPU (:func:`on_cpu`); :func:`read` loads them there, and
    loading them into the model and optimizer moves them to the model's device.

    Example::

        save(checkpoint_path("ckpt", rank), model, opt, step=step + 1, workers=size, rank=rank,
             job=job_identity(cfg))
    """
    buffer = io.BytesIO()
    torch.save(on_cpu({"model": model.state_dict(), "optimizer": opt.state_dict()}), buffer)
    header = header_for({"job": job, "rank": rank, "step": step, "workers": workers},
                        buffer.getbuffer())
    tmp = path.with_name(path.name + ".tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            f.write(header)
            f.write(buffer.getbuffer())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_directory(path.parent)
    except OSError as exc:  # a full disk, say: the previous checkpoint stays as it was
        if tmp.is_file():
            tmp.unlink()
        raise CheckpointError(f"worker {rank}: saving the step-{step} checkpoint to {path} "
                              f"failed ({exc.strerror or exc}); the previous one is kept") from None


def read(path: Path) -> tuple[dict, dict]:
    """The header and the state saved in ``path``, tensors on the CPU; :class:`Damaged` if not intact."""
    blob = path.read_bytes()
    if not blob:
        raise Damaged("empty file (0 bytes)")
    if not blob.startswith(MAGIC):
        if MAGIC.startswith(blob):
            raise Damaged(f"truncated: {len(blob)} bytes, inside its header")
        raise Damaged("not an adtopk-ps checkpoint (no checkpoint header)")
    lines = blob[len(MAGIC):].split(b"\n", 2)
    if len(lines) < 3:
        raise Damaged(f"truncated: {len(blob)} bytes, inside its header")
    stored, meta_line, payload = lines
    try:
        meta = json.loads(meta_line)
        declared = meta["bytes"]
    except (ValueError, TypeError, KeyError):
        meta, declared = None, None
    if isinstance(declared, int) and len(payload) < declared:
        raise Damaged(f"truncated: {len(payload)} of {declared} payload bytes ({len(blob)} in all)")
    digest = hashlib.sha256(meta_line + b"\n")
    digest.update(payload)
    if stored != digest.hexdigest().encode():
        raise Damaged(f"checksum mismatch: sha256 {digest.hexdigest()[:16]}... of the content, "
                      f"{stored[:16].decode(errors='replace')}... in the header")
    if not isinstance(meta, dict) or declared != len(payload) or not isinstance(meta.get("job"), dict) \
            or not all(type(meta.get(key)) is int for key in ("rank", "step", "workers")):
        raise Damaged("malformed header")
    try:
        state = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    except Exception as exc:  # an intact file that torch cannot read: another version's format
        raise Damaged(f"unreadable payload: {type(exc).__name__}: {exc}".splitlines()[0]) from exc
    if not isinstance(state, dict) or not {"model", "optimizer"} <= set(state):
        raise Damaged("payload holds no model and optimizer state")
    return meta, state


def _differences(saved: dict, job: dict) -> str:
    keys = sorted(set(saved) | set(job))
    return ", ".join(f"{k}={saved.get(k)!r} where this job has {job.get(k)!r}"
                     for k in keys if saved.get(k) != job.get(k))


def inspect(directory: str | None, rank: int, workers: int, job: dict, total: int,
            model: nn.Module, opt: torch.optim.Optimizer) -> Finding:
    """This worker's finding; a valid checkpoint is loaded into ``model`` and ``opt`` (on their devices).

    Loading before the workers agree is harmless: they either all resume from what they
    loaded, or (when any refuses) none trains at all.
    """
    if directory is None:
        return Finding(rank, "", "off", "no --checkpoint-dir")
    path = checkpoint_path(directory, rank).resolve()
    try:
        if not path.exists():
            return Finding(rank, str(path), "absent", "no such file")
        meta, state = read(path)
    except (Damaged, OSError) as exc:  # OSError: a directory we may not read, say
        return Finding(rank, str(path), "damaged", str(exc))
    step = meta["step"]
    if (meta["workers"], meta["rank"]) != (workers, rank):
        return Finding(rank, str(path), "foreign",
                       f"saved by worker {meta['rank']} of {meta['workers']}, "
                       f"this is worker {rank} of {workers}", step)
    if meta["job"] != job:
        return Finding(rank, str(path), "foreign",
                       f"saved by another job: {_differences(meta['job'], job)}", step)
    if step >= total:
        return Finding(rank, str(path), "late",
                       f"at step {step}, at or beyond the job's {total} steps: nothing left to train "
                       f"(raise --steps, or remove the checkpoints to start over)", step)
    try:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
    except Exception as exc:  # any failure is this worker's finding: raised here, the others would wait
        return Finding(rank, str(path), "foreign",
                       f"does not fit this model or optimizer: {str(exc).splitlines()[0]}", step)
    return Finding(rank, str(path), "valid", "", step)


_FAULTS = {"damaged": "damaged", "foreign": "foreign", "late": "too late"}


def _names(findings: list[Finding]) -> str:
    return ", ".join(f"worker {f.rank} ({f.path or f.reason})" for f in findings)


def decide(findings: list[Finding]) -> int | None:
    """The step every worker resumes from, None to start fresh, or :class:`CheckpointError`.

    A function of the gathered findings alone, so every worker decides alike.
    """
    problems = [f"worker {f.rank}: {f.path} is {_FAULTS[f.state]}: {f.reason}"
                for f in findings if f.state in _FAULTS]
    valid = [f for f in findings if f.state == "valid"]
    missing = [f for f in findings if f.state in ("absent", "off")]
    if valid and missing:
        problems.append(f"checkpoints on some workers only: {_names(valid)} would resume at step "
                        f"{valid[0].step}, {_names(missing)} would start fresh; restore the missing "
                        f"checkpoint(s), or remove them all to start over")
    steps = sorted({f.step for f in valid})
    if len(steps) > 1:
        problems.append("checkpoints at different steps: " + ", ".join(
            f"worker {f.rank} at step {f.step} ({f.path})" for f in valid))
    if problems:
        raise CheckpointError("checkpoints refused on every worker, none trains:\n  "
                              + "\n  ".join(problems))
    return steps[0] if valid else None


def restore(directory: str | None, model: nn.Module, opt: torch.optim.Optimizer, cfg: dict,
            total: int) -> int | None:
    """Resume every worker from its checkpoint, or none: the step to continue from, or None.

    Every worker calls it at start-up, with or without a checkpoint directory, before the
    first step; it raises :class:`CheckpointError` on every worker alike when they cannot all
    resume one job at one step.

    Example::

        start = restore(args.checkpoint_dir, model, opt, cfg, total)
        if start is None:
            bps.broadcast_parameters(model.state_dict(), root_rank=0)
    """
    rank, workers = bps.rank(), bps.size()
    mine = inspect(directory, rank, workers, job_identity(cfg), total, model, opt)
    step = decide(bps.allgather_object(mine, name="checkpoint.findings"))
    if step is not None:
        _check_same_parameters(directory, model)
    return step


def parameters_digest(model: nn.Module) -> str:
    """16 hex digits of a sha256 over the parameters: equal on every worker after each step."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def _check_same_parameters(directory: str | os.PathLike, model: nn.Module) -> None:
    """Data-parallel workers hold the same parameters after every step, so intact checkpoints
    that differ were saved by different runs (a re-run with another seed, an old copy)."""
    digests = bps.allgather_object(parameters_digest(model), name="checkpoint.parameters")
    if len(set(digests)) > 1:
        held = "; ".join(f"worker {r} ({checkpoint_path(directory, r)}) {d}"
                         for r, d in enumerate(digests))
        raise CheckpointError(f"checkpoints refused on every worker, none trains: they hold "
                              f"different parameters, so they come from different runs: {held}")
