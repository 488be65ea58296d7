"""Reading the BytePS/DMLC environment contract with errors that name the variable."""
from __future__ import annotations

import os
from typing import Mapping


class EnvError(ValueError):
    """A required environment variable is missing or malformed."""


def env_int(name: str, default: int | None = None, minimum: int | None = None,
            environ: Mapping[str, str] | None = None) -> int:
    """An integer variable; without a default it is required."""
    environ = os.environ if environ is None else environ
    raw = environ.get(name)
    if raw is None or raw.strip() == "":
        if default is None:
            raise EnvError(f"environment variable {name} is required but not set")
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        raise EnvError(f"environment variable {name}={raw!r} is not an integer") from None
    if minimum is not None and value < minimum:
        raise EnvError(f"environment variable {name}={value} must be >= {minimum}")
    return value
