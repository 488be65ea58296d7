"""One checkpoint file: its format, its atomic write and its verified read.

A checkpoint file is a header and a payload::

    adtopk-ps checkpoint 1\\n
    <sha256 of everything after this line, 64 hex digits>\\n
    {"bytes": ..., "job": {...}, "rank": 0, "step": 20, "workers": 2}\\n
    <torch.save of {"model": ..., "optimizer": ...} (and "servers": the servers' residuals)>

so a flipped byte anywhere, an empty or truncated file, or another job's or cluster
shape's file is found before ``torch.load`` reads it. Which files a worker keeps, and
which one the workers resume from, is checkpoint.py's business.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
from pathlib import Path

import torch
from torch import nn

MAGIC = b"adtopk-ps checkpoint 1\n"


class Damaged(ValueError):
    """A checkpoint file that is not intact; the message says how."""


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


def write(path: Path, model: nn.Module, opt: torch.optim.Optimizer, meta: dict,
          servers: list | None = None) -> None:
    """Write ``path`` atomically: a temporary file beside it, fsync, rename, fsync the directory.

    A crash at any moment leaves no torn file under ``path``'s name. On an ``OSError`` (a
    full disk, say) the temporary file is removed before the error goes on. Tensors are
    saved from the CPU (:func:`on_cpu`); :func:`read` loads them there. ``servers``: the
    servers' residuals (``PSClient.server_residuals``), where they hold any.

    Example::

        write(Path("ckpt/worker0-step00000020.pt"), model, opt,
              {"job": {...}, "rank": 0, "step": 20, "workers": 2})
    """
    buffer = io.BytesIO()
    state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    if servers:
        state["servers"] = servers
    torch.save(on_cpu(state), buffer)
    header = header_for(meta, buffer.getbuffer())
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
    except OSError:
        if tmp.is_file():
            tmp.unlink()
        raise


def read(path: Path) -> tuple[dict, dict]:
    """The header and the state saved in ``path``, tensors on the CPU; :class:`Damaged` if not intact."""
    meta, payload = _verified(path.read_bytes())
    try:
        state = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    except Exception as exc:  # an intact file that torch cannot read: another version's format
        raise Damaged(f"unreadable payload: {type(exc).__name__}: {exc}".splitlines()[0]) from exc
    if not isinstance(state, dict) or not {"model", "optimizer"} <= set(state):
        raise Damaged("payload holds no model and optimizer state")
    return meta, state


def read_header(path: Path) -> dict:
    """The header of ``path``, once the checksum over the whole file has passed (so the
    file is intact); :class:`Damaged` says what is wrong."""
    return _verified(path.read_bytes())[0]


def _verified(blob: bytes) -> tuple[dict, bytes]:
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
    return meta, payload
