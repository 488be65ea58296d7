"""Job configs: a YAML file, with command-line flags overriding its keys."""
from __future__ import annotations

import argparse
import copy
from pathlib import Path

import yaml

DEFAULTS = {
    "model": "cnn", "model_args": {},
    "dataset": "digits", "dataset_args": {},
    "batch_size": 32,
    "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9, "weight_decay": 0.0},
    "lr_schedule": {"name": "constant", "warmup_steps": 0},
    "epochs": 10, "steps": None,
    "compression": {"compressor": "adtopk", "k": 0.01, "ef": "vanilla"},
    "min_compress_bytes": 65536, "budget": False, "cost_model": False, "dense_transport": "ps",
    "eval_every": 50, "checkpoint_every": 100, "seed": 0,
    "metrics": None, "progress": True,
    "nonfinite": "stop",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
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


def load(args: argparse.Namespace) -> dict:
    path = Path(args.config)
    if not path.is_file():
        raise ValueError(f"config file {path} does not exist")
    loaded = yaml.safe_load(path.read_text()) or {}
    if not isinstance(loaded, dict):
        raise ValueError(f"config file {path} must hold a mapping")
    unknown = set(loaded) - set(DEFAULTS)
    if unknown:
        raise ValueError(f"config {path}: unknown keys {sorted(unknown)}; valid: {sorted(DEFAULTS)}")
    cfg = copy.deepcopy(DEFAULTS)
    cfg.update(loaded)
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
            raise ValueError(f"--set {item!r} must look like KEY=VALUE")
        *parents, leaf = key.split(".")
        if parents[:1] and parents[0] not in DEFAULTS or not parents and leaf not in DEFAULTS:
            raise ValueError(f"--set {key}: unknown key; valid: {sorted(DEFAULTS)}")
        node = cfg
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = yaml.safe_load(value)
    return cfg
