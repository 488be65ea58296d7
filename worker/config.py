"""Job configs: a YAML file, with command-line flags overriding its keys, validated in full
(``validate.py``) before the job starts."""
from __future__ import annotations

import argparse
import copy
from pathlib import Path

import yaml

from .validate import ConfigError, validate

DEFAULTS = {
    "model": "cnn", "model_args": {},
    "dataset": "digits", "dataset_args": {},
    "batch_size": 32,
    "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9, "weight_decay": 0.0},
    "lr_schedule": {"name": "constant", "warmup_steps": 0},
    "epochs": 10, "steps": None,
    "compression": {"compressor": "adtopk", "k": 0.01, "ef": "vanilla"},
    "min_compress_bytes": 65536, "budget": False, "cost_model": False, "dense_transport": "ps",
    "eval_every": 50, "checkpoint_every": 100, "checkpoint_keep": 2, "verify_every": 100, "seed": 0,
    "metrics": None, "progress": True,
    "nonfinite": "stop",  # a NaN or Inf gradient: "stop" the job naming it, or "skip" the step
    "device": "auto",  # "auto" (this local rank's GPU where there is one, else the CPU), "cpu", "cuda"
    "elastic": None,  # {"commit_every": N, "min_workers": .., "max_workers": ..}: see worker/elastic.py
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The training job's command line (``python -m worker --help``)."""
    ap = argparse.ArgumentParser(prog="python -m worker", description="The training job that bpslaunch starts.")
    ap.add_argument("--config", required=True, help="a YAML file in configs/")
    ap.add_argument("--steps", type=int, help="train this many steps (overrides epochs)")
    ap.add_argument("--epochs", type=int)
    ap.add_argument("--batch-size", type=int, dest="batch_size")
    ap.add_argument("--lr", type=float)
    ap.add_argument("--seed", type=int)
    ap.add_argument("--compressor", help="compressor name (none, adtopk, topk, ...)")
    ap.add_argument("--ratio", type=float, help="the compressor's density")
    ap.add_argument("--metrics", help="write JSON-lines metrics here (rank 0)")
    ap.add_argument("--metrics-out", dest="metrics_out", help="write the final summary as JSON here")
    ap.add_argument("--checkpoint-dir", dest="checkpoint_dir", help="save and resume from here")
    ap.add_argument("--stop-after", type=int, dest="stop_after",
                    help="end this run after so many steps (as a preempted job would)")
    ap.add_argument("--checksums", action="store_true",
                    help="print a checksum of the parameters after every step (every rank)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override any config key (dotted for nested, YAML value), e.g. optimizer.lr=0.1")
    return ap.parse_args(argv)


def _yaml(text: str, where: str):
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{where} is not valid YAML: {' '.join(str(exc).split())}") from None


def load(args: argparse.Namespace) -> dict:
    """The config file with the flags and ``--set`` overrides applied; raises ``ConfigError``
    (a ValueError) naming the first bad key or value."""
    path = Path(args.config)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    loaded = _yaml(path.read_text(), f"config file {path}") or {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"config file {path} must hold a mapping")
    cfg = copy.deepcopy(DEFAULTS)
    cfg.update(loaded)
    _validated(cfg)  # the file alone first, so that the overrides below apply to sound values
    for key in ("steps", "epochs", "batch_size", "seed", "metrics"):
        if getattr(args, key) is not None:
            cfg[key] = getattr(args, key)
    if args.lr is not None:
        cfg["optimizer"] = {**cfg["optimizer"], "lr": args.lr}
    if args.compressor is not None:
        cfg["compression"] = {"compressor": args.compressor, **(
            {} if args.compressor == "none" else {"k": cfg["compression"].get("k", 0.01),
                                                  "ef": cfg["compression"].get("ef", "vanilla")})}
    if args.ratio is not None:
        cfg["compression"] = {**cfg["compression"], "k": args.ratio}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--set {item!r} must look like KEY=VALUE")
        *parents, leaf = key.split(".")
        node = cfg
        for depth, part in enumerate(parents):
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {key}: config key {'.'.join(parents[:depth + 1])} "
                                  f"is not a mapping")
        node[leaf] = _yaml(value, f"--set {item}")
    if args.stop_after is not None and args.stop_after < 1:
        raise ConfigError(f"--stop-after={args.stop_after}: must be an integer >= 1")
    return _validated(cfg)


def _validated(cfg: dict) -> dict:
    validate(cfg)
    if isinstance(cfg["compression"], str):  # a compressor's name alone: one spelling from here on
        cfg["compression"] = {"compressor": cfg["compression"]}
    return cfg
