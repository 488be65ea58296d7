"""The job config's schema: every key and value is checked before the worker joins the cluster.

A bad value would otherwise surface late (after every role has started, as a traceback) or
not at all (a negative batch size trains). Each error names the key, the value and what is
valid; an unknown key gets the closest valid one. To add a key, add it to ``config.DEFAULTS``
and give ``SCHEMA`` a check for it.
"""
from __future__ import annotations

import difflib
import inspect
import os
from typing import Any, Callable, Mapping

import torch

from adtopk_ps.compression import COMPRESSORS, create, parameters
from adtopk_ps.torch.gradient_compression import TRANSPORTS
from adtopk_ps.torch.nonfinite import POLICIES

from .data import DATASETS, DatasetUnavailable, check_available
from .models import MODELS

OPTIMIZERS = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}
LR_SCHEDULES = {"constant": {"warmup_steps"}, "cosine": {"warmup_steps"},
                "step": {"warmup_steps", "gamma", "every"}}
DEVICES = ("auto", "cpu", "cuda")  # see device.py

Check = Callable[[str, Any, Mapping], None]  # (dotted key, value, the whole config)


class ConfigError(ValueError):
    """A config key or value that the job cannot run with."""


def _fail(key: str, value: Any, valid: str) -> None:
    raise ConfigError(f"config key {key}={value!r}: {valid}")


def unknown_keys(key: str, given: Mapping, valid: set[str] | list[str]) -> None:
    """Refuse keys of ``given`` outside ``valid``, suggesting the closest valid one."""
    for name in given:
        if name not in valid:
            close = difflib.get_close_matches(str(name), [str(v) for v in valid], n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            where = f"{key}.{name}" if key else str(name)
            raise ConfigError(f"config key {where}: unknown key; {hint}valid: {sorted(valid)}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _number_hint(value: Any, how: str = "with a dot, e.g. 1.0e-3") -> str:
    """YAML 1.1 reads ``1e-3`` (no dot) as a string; say how to write it."""
    try:
        float(value)
    except (TypeError, ValueError):
        return ""
    return f" (YAML reads this as a string; write it {how})" if isinstance(value, str) else ""


def integer(minimum: int, optional: bool = False) -> Check:
    """A check that a value is an integer of at least ``minimum`` (or null where ``optional``)."""
    def check(key: str, value: Any, _cfg: Mapping) -> None:
        if value is None and optional:
            return
        if not _is_int(value) or value < minimum:
            _fail(key, value, f"must be an integer >= {minimum}" + (" or null" if optional else "")
                  + _number_hint(value, "in digits, e.g. 2"))
    return check


def boolean(key: str, value: Any, _cfg: Mapping) -> None:
    """Check that a value is true or false."""
    if not isinstance(value, bool):
        _fail(key, value, "must be true or false")


def choice(options: Mapping | tuple) -> Check:
    """A check that a value is one of ``options``, suggesting the closest where it is not."""
    def check(key: str, value: Any, _cfg: Mapping) -> None:
        if not isinstance(value, str) or value not in options:
            close = difflib.get_close_matches(str(value), list(options), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            _fail(key, value, f"{hint}must be one of {sorted(options)}")
    return check


def _mapping(key: str, value: Any) -> None:
    if not isinstance(value, Mapping):
        _fail(key, value, "must be a mapping")


def _kwargs(key: str, given: Any, fn: Callable, skip: tuple[str, ...] = ()) -> None:
    """Keyword arguments for ``fn`` (a model or dataset): known names, of their defaults' types."""
    _mapping(key, given)
    params = {name: p.default for name, p in inspect.signature(fn).parameters.items()
              if name not in ("self", *skip)}
    unknown_keys(key, given, set(params))
    for name, value in given.items():
        default = params[name]
        if _is_int(default) and (not _is_int(value) or value < 1):
            _fail(f"{key}.{name}", value, "must be an integer >= 1")
        if isinstance(default, float) and (not _is_number(value) or value <= 0):
            _fail(f"{key}.{name}", value, "must be a number > 0")
        if isinstance(default, str) and not isinstance(value, str):
            _fail(f"{key}.{name}", value, "must be a string")


def model_args(key: str, value: Any, cfg: Mapping) -> None:
    """Check ``model_args`` against the chosen model's parameters."""
    _kwargs(key, value, MODELS[cfg["model"]])


def dataset_args(key: str, value: Any, cfg: Mapping) -> None:
    """Check ``dataset_args`` against the chosen dataset's parameters."""
    _kwargs(key, value, DATASETS[cfg["dataset"]], skip=("seed",))
    try:
        check_available(cfg["dataset"], value)
    except DatasetUnavailable as exc:
        raise ConfigError(f"config key dataset={cfg['dataset']!r}: {exc}") from None


def optimizer(key: str, value: Any, _cfg: Mapping) -> None:
    """The name, then the keyword arguments that torch's optimizer takes, with values it
    accepts (it is built once on a stand-in parameter, so its own checks apply)."""
    _mapping(key, value)
    spec = dict(value)
    choice(OPTIMIZERS)(f"{key}.name", spec.pop("name", "sgd"), _cfg)
    cls = OPTIMIZERS[value.get("name", "sgd")]
    params = {n: p.default for n, p in inspect.signature(cls.__init__).parameters.items()
              if n not in ("self", "params")}
    unknown_keys(key, spec, set(params) | {"name"})
    if "lr" in spec and (not _is_number(spec["lr"]) or spec["lr"] <= 0):
        _fail(f"{key}.lr", spec["lr"], "must be a number > 0" + _number_hint(spec["lr"]))
    for name, val in spec.items():
        default = params[name]
        if _is_number(default) and not _is_number(val):
            _fail(f"{key}.{name}", val, "must be a number" + _number_hint(val))
        if isinstance(default, bool) and not isinstance(val, bool):
            _fail(f"{key}.{name}", val, "must be true or false")
        if isinstance(default, tuple) and not (isinstance(val, (list, tuple)) and len(val) == len(default)
                                               and all(_is_number(v) for v in val)):
            _fail(f"{key}.{name}", val, f"must be a list of {len(default)} numbers")
    try:
        cls([torch.zeros(1, requires_grad=True)], **spec)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ConfigError(f"config key {key}={dict(value)!r}: torch.optim.{cls.__name__} "
                          f"refuses it: {exc}") from None


def lr_schedule(key: str, value: Any, _cfg: Mapping) -> None:
    """Check the LR schedule's name and its keys."""
    _mapping(key, value)
    name = value.get("name", "constant")
    choice(LR_SCHEDULES)(f"{key}.name", name, _cfg)
    unknown_keys(key, value, LR_SCHEDULES[name] | {"name"})
    if "warmup_steps" in value:
        integer(0)(f"{key}.warmup_steps", value["warmup_steps"], _cfg)
    if "every" in value:
        integer(1)(f"{key}.every", value["every"], _cfg)
    if "gamma" in value and (not _is_number(value["gamma"]) or value["gamma"] <= 0):
        _fail(f"{key}.gamma", value["gamma"], "must be a number > 0" + _number_hint(value["gamma"]))


def elastic(key: str, value: Any, _cfg: Mapping) -> None:
    """null (a fixed set of workers), or the elastic job's keys: ``commit_every`` (steps
    between commits in memory, default 1) and the bounds the cluster must have
    (``min_workers``, ``max_workers``: PS_MIN_WORKERS, PS_MAX_WORKERS)."""
    if value is None:
        return
    _mapping(key, value)
    unknown_keys(key, value, {"commit_every", "min_workers", "max_workers"})
    if "commit_every" in value:
        integer(1)(f"{key}.commit_every", value["commit_every"], _cfg)
    for bound in ("min_workers", "max_workers"):
        if bound in value:
            integer(1, optional=True)(f"{key}.{bound}", value[bound], _cfg)
    low, high = value.get("min_workers"), value.get("max_workers")
    if low is not None and high is not None and low > high:
        _fail(f"{key}.min_workers", low, f"must not be above elastic.max_workers ({high})")


def compression(key: str, value: Any, _cfg: Mapping) -> None:
    """Built once with the compressor registry, so every compressor's own checks apply."""
    spec = {"compressor": value} if isinstance(value, str) else value  # a name alone is a spec too
    _mapping(key, spec)
    name = spec.get("compressor")
    if name is None:
        _fail(key, value, "needs a 'compressor' key")
    choice(COMPRESSORS)(f"{key}.compressor", name, _cfg)
    unknown_keys(key, spec, {"compressor", "ef", "k", "compressor_k", *parameters(name)})
    try:
        create(spec)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"config key {key}={dict(spec)!r}: {exc}") from None


def device(key: str, value: Any, cfg: Mapping) -> None:
    """One of DEVICES. Not a GPU's index: every worker reads the same config, and each takes
    its GPU by its local rank."""
    if isinstance(value, str) and value.startswith("cuda:"):
        _fail(key, value, "name no GPU index: every worker takes the GPU of its local rank "
                          "(BYTEPS_LOCAL_RANK, or PS_DEVICE_INDEX, which bpslaunch --local sets "
                          "to the worker's id); write cuda, and limit the GPUs with "
                          "CUDA_VISIBLE_DEVICES")
    if isinstance(value, str) and value.lower() == "gpu":  # closest by spelling is 'cpu'
        _fail(key, value, f"did you mean 'cuda'? must be one of {sorted(DEVICES)}")
    choice(DEVICES)(key, value, cfg)


def metrics(key: str, value: Any, _cfg: Mapping) -> None:
    """Check that ``metrics`` is null or a file in an existing folder."""
    if value is None:
        return
    if not isinstance(value, str) or not value:
        _fail(key, value, "must be a file path or null")
    folder = os.path.dirname(os.path.abspath(value))
    if not os.path.isdir(folder):
        _fail(key, value, f"its folder {folder} does not exist")


SCHEMA: dict[str, Check] = {
    "model": choice(MODELS), "model_args": model_args,
    "dataset": choice(DATASETS), "dataset_args": dataset_args,
    "batch_size": integer(1),
    "optimizer": optimizer, "lr_schedule": lr_schedule,
    "epochs": integer(1), "steps": integer(1, optional=True),
    "compression": compression, "min_compress_bytes": integer(0),
    "budget": boolean, "cost_model": boolean, "dense_transport": choice(TRANSPORTS),
    "eval_every": integer(1), "checkpoint_every": integer(1), "checkpoint_keep": integer(1), "verify_every": integer(0),
    "seed": integer(0),
    "metrics": metrics, "progress": boolean,
    "nonfinite": choice(POLICIES), "device": device, "elastic": elastic,
}


def validate(cfg: Mapping) -> None:
    """Raise ``ConfigError`` for the first key or value that the job cannot run with."""
    unknown_keys("", cfg, set(SCHEMA))
    for key, check in SCHEMA.items():  # in order: model before model_args, dataset before its args
        if key not in cfg:
            raise ConfigError(f"config key {key} is missing")
        check(key, cfg[key], cfg)
