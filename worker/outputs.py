"""Where the job writes (checkpoint folder, metrics, summary): checked before the worker
joins, and every later write failure (a full disk) named with its file, never a traceback."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from .validate import ConfigError


class OutputError(RuntimeError):
    """A write of the job's outputs failed; the message names the file and the reason."""


def writable_outputs(checkpoint_dir: str | None, metrics_out: str | None,
                     metrics: str | None) -> None:
    """Where the job will write, checked before it joins the cluster: a folder it cannot
    write to, found only when the first checkpoint or the summary is due, costs the run."""
    if checkpoint_dir:
        folder = Path(checkpoint_dir)
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=folder, prefix=".write-check-"):
                pass
        except OSError as exc:
            raise ConfigError(f"--checkpoint-dir {checkpoint_dir}: cannot write there "
                              f"({exc.strerror or exc})") from None
    for what, file in (("--metrics-out", metrics_out), ("config key metrics", metrics)):
        if not file:
            continue
        folder = Path(file).resolve().parent
        if not folder.is_dir() or not os.access(folder, os.W_OK) or \
                (Path(file).exists() and not os.access(file, os.W_OK)):
            raise ConfigError(f"{what} {file}: cannot write there (its folder {folder} is "
                              f"missing or not writable)")


class MetricsLog:
    """Worker 0's JSON-lines metrics file, a record a line, unbuffered: each record is in the
    file when :meth:`append` returns, and a failed one leaves nothing to flush at exit.

    Example::

        log = MetricsLog(cfg["metrics"])
        log.append({"step": 50, "accuracy": 0.91})
        log.close()
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._file = _named(path, lambda: open(path, "ab", buffering=0))

    def append(self, record: dict) -> None:
        """Write ``record`` as one line."""
        _named(self.path, lambda: self._file.write(json.dumps(record).encode() + b"\n"))

    def close(self) -> None:
        """Close the file."""
        _named(self.path, self._file.close)


def write_summary(path: str, summary: dict) -> None:
    """The run's summary as JSON in ``path`` (``--metrics-out``)."""
    _named(path, lambda: Path(path).write_text(json.dumps(summary, indent=2) + "\n"))


def _named(path: str, action):
    try:
        return action()
    except OSError as exc:
        raise OutputError(f"writing {path} failed ({exc.strerror or exc})") from None
