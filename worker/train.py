"""The training job: one data-parallel worker of a bpslaunch cluster.

    bpslaunch --local --num-workers 2 --num-servers 2 -- python -m worker --config configs/digits-cnn.yaml
"""
from __future__ import annotations

import logging
import math
import sys
import time

import torch
from torch import nn
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

import adtopk_ps.torch as bps
from adtopk_ps.client.errors import CollectiveError, PushPullError
from adtopk_ps.cluster.stop import stop_quietly_on_signals
from adtopk_ps.cluster.transport import ClusterError, RegistrationRefused
from adtopk_ps.compression import SparsificationPolicy, create
from adtopk_ps.core.env import EnvError
from adtopk_ps.torch.runtime import mark_failed

from . import checkpoint
from . import config as job_config
from . import device as job_device
from . import elastic, elastic_checkpoint
from .data import Dataset, DatasetUnavailable, load
from .models import build
from .outputs import MetricsLog, OutputError, writable_outputs, write_summary
from .validate import OPTIMIZERS


def lr_at(step: int, total: int, base: float, schedule: dict) -> float:
    """Linear warm-up, then constant, cosine or step decay."""
    warmup = schedule.get("warmup_steps", 0)
    if step < warmup:
        return base * (step + 1) / warmup
    kind = schedule.get("name", "constant")
    if kind == "constant":
        return base
    if kind == "cosine":
        progress = (step - warmup) / max(1, total - warmup)
        return base * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    if kind == "step":
        return base * schedule.get("gamma", 0.1) ** (step // schedule.get("every", total))
    raise ValueError(f"unknown lr schedule {kind!r}; valid: constant, cosine, step")


def make_optimizer(model: nn.Module, spec: dict) -> torch.optim.Optimizer:
    """The torch optimizer a config's ``optimizer`` section names."""
    spec = dict(spec)
    name = spec.pop("name", "sgd")
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; valid: {sorted(OPTIMIZERS)}")
    return OPTIMIZERS[name](model.parameters(), **spec)


def make_compression(cfg: dict) -> bps.GradientCompression:
    """The config's compressor with its partial-sparsification policy, cost model and dense transport."""
    spec = cfg["compression"]
    name = spec.get("compressor", "none") if isinstance(spec, dict) else spec
    compressor = None if name == "none" else create(spec)
    # the policy's density is the compressor's own, however the config spelt it
    policy = SparsificationPolicy(compressor.ratio if compressor else 1.0,
                                  min_compress_bytes=cfg["min_compress_bytes"], budget=cfg["budget"])
    return bps.GradientCompression(compressor, policy, measure_costs=cfg["cost_model"],
                                   dense_transport=cfg["dense_transport"])


def evaluate(model: nn.Module, data: Dataset) -> tuple[float, float]:
    """Test loss and accuracy of ``model`` on ``data``'s test set."""
    model.eval()
    with torch.no_grad():
        logits = model(data.x_test)
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), data.y_test.reshape(-1))
        accuracy = (logits.argmax(-1) == data.y_test).float().mean()
    model.train()
    return float(accuracy), float(loss)


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def job_description(cfg: dict, device: torch.device) -> dict:
    """What every worker must share: the config's values by name (metrics and progress, each
    worker's own, left out), with the kind of device. A worker that joins a running job with
    another is refused as it registers."""
    mine = _flat({k: v for k, v in cfg.items() if k not in ("metrics", "progress")})
    mine["device"] = device.type
    return mine


def agree_on_config(cfg: dict, device: torch.device) -> None:
    """Every worker trains by one config: each reads its learning rate and schedule from its own
    every step, which no broadcast of the optimizer's state would correct. Raises
    :class:`bps.Disagreement` on every worker alike, naming the keys and both sides.

    ``device`` is compared by the kind each worker took (``auto`` may take a GPU on one host and
    the CPU on another): the same update on a CPU and on a GPU can round differently, and the
    replicas would drift apart. Which GPU each takes may differ."""
    configs = bps.allgather_object(job_description(cfg, device), name="job.config")
    lines = [f"{key}: worker 0 has {configs[0].get(key)!r}, worker {rank} has {other.get(key)!r}"
             for rank, other in enumerate(configs[1:], 1)
             for key in sorted(set(configs[0]) | set(other)) if configs[0].get(key) != other.get(key)]
    if lines:
        raise bps.Disagreement("workers disagree on the job config: " + "; ".join(lines[:5])
                               + (f" (and {len(lines) - 5} more)" if len(lines) > 5 else ""))


def train(cfg: dict, args, device: torch.device, dataset: Dataset) -> dict:
    """Train on ``device``: the data, the model, its optimizer state and the residuals all live
    there (checkpoints are saved from the CPU and load onto whatever device this run has).
    ``dataset`` is read before joining, so that a damaged one stops this worker at once."""
    if cfg["elastic"]:
        return train_elastic(cfg, args, device, dataset)
    rank, size = join(cfg, device)
    agree_on_config(cfg, device)
    data = dataset.shard(rank, size).to(device)
    model, compression, opt = make_model(cfg, device)
    batch = cfg["batch_size"]
    total = cfg["steps"] or cfg["epochs"] * data.batches_per_epoch(batch)
    start, committed = starting_step(args, model, opt, cfg, total)
    checkpoints = (checkpoint.Checkpoints(args.checkpoint_dir, cfg["checkpoint_keep"], committed)
                   if args.checkpoint_dir else None)
    base_lr = cfg["optimizer"].get("lr", 0.01)
    log = MetricsLog(cfg["metrics"]) if cfg["metrics"] and rank == 0 else None
    client = bps.client()
    bar = tqdm(total=total, initial=start, disable=not cfg["progress"] or rank != 0,
               file=sys.stdout, mininterval=1.0, ascii=True, desc="train")
    loss_value, began, done = float("nan"), time.perf_counter(), 0
    end = total if args.stop_after is None else min(total, start + args.stop_after)
    for step in range(start, end):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, total, base_lr, cfg["lr_schedule"])
        loss_value = train_step(model, opt, data.batch(step, batch, cfg["seed"] * 1000 + rank))
        done += 1
        bar.update(1)
        bar.set_postfix(loss=f"{loss_value:.3f}", refresh=False)
        if cfg["verify_every"] and (step + 1) % cfg["verify_every"] == 0:
            bps.verify_replicas(model, step + 1)  # a drifted replica ends the job, named
        if args.checksums:  # through tqdm, so the line never shares one with the bar
            tqdm.write(f"checksum step {step + 1}: {checkpoint.parameters_digest(model)}", file=sys.stdout)
        last = step + 1 == end
        if log is not None and ((step + 1) % cfg["eval_every"] == 0 or last):
            record = {"step": step + 1, "loss": loss_value,
                      "samples_per_s": size * batch * done / (time.perf_counter() - began),
                      **traffic(client, opt)}
            record["accuracy"], record["test_loss"] = evaluate(model, data)
            log.append(record)
        if checkpoints and ((step + 1) % cfg["checkpoint_every"] == 0 or last):
            checkpoints.commit(model, opt, step=step + 1, job=checkpoint.job_identity(cfg))
    bar.close()
    result = summary(model, data, compression, opt, loss_value, end, size * batch * done, began)
    if log is not None:
        log.close()
    bps.shutdown()
    return result


def train_elastic(cfg: dict, args, device: torch.device, dataset: Dataset) -> dict:
    """:func:`train` as an elastic job (worker/elastic.py): every worker deals each step's
    samples from the whole training set, and commits in memory every ``commit_every`` steps;
    after a re-form the workers agree on the config again (a joiner for the first time) and
    go on from the newest commit."""
    join(cfg, device)
    elastic.check_cluster(cfg)
    data = dataset.to(device)
    model, compression, opt = make_model(cfg, device)
    batch, seed, base_lr = cfg["batch_size"], cfg["seed"], cfg["optimizer"].get("lr", 0.01)
    state, client = elastic.new_state(model, opt), bps.client()
    # by the job's shape, the same on every worker (a joiner's size() is the job's now)
    per_step = batch * client.config.num_workers
    total = cfg["steps"] or cfg["epochs"] * -(-len(data.x_train) // per_step)
    every = cfg["elastic"].get("commit_every", 1)
    checkpoints = (checkpoint.Checkpoints(args.checkpoint_dir, cfg["checkpoint_keep"], [],
                                          every_rank=True) if args.checkpoint_dir else None)
    log: list[MetricsLog] = []  # opened by whichever worker is rank 0 when a record is due
    seen = {"samples": 0, "loss": float("nan")}
    began = time.perf_counter()

    @bps.elastic.run
    def run(state: bps.elastic.TorchState) -> None:
        agree_on_config(cfg, device)  # after every re-form: a joiner's first agreement
        if not state.surveyed:  # the job's start (a joiner that comes later skips it)
            state.saved = elastic_checkpoint.restore(args.checkpoint_dir, state, model, opt, cfg, total)
            state.surveyed = True  # --stop-after counts from where the job resumed:
            state.end = total if args.stop_after is None else min(total, state.step + args.stop_after)
            state.commit()
        while state.step < state.end:
            rank, size = bps.rank(), bps.size()
            for group in opt.param_groups:
                group["lr"] = lr_at(state.step, total, base_lr, cfg["lr_schedule"])
            x, y, taken = elastic.round_batch(data, state.epoch, state.processed, rank, size,
                                              batch, seed)
            seen["loss"] = train_step(model, opt, (x, y))
            seen["samples"] += taken
            state.step, state.processed = state.step + 1, state.processed + taken
            if state.processed >= len(data.x_train):
                state.epoch, state.processed = state.epoch + 1, 0
            if cfg["verify_every"] and state.step % cfg["verify_every"] == 0:
                bps.verify_replicas(model, state.step)
            if args.checksums:
                print(f"checksum step {state.step}: {checkpoint.parameters_digest(model)}", flush=True)
            last = state.step == state.end
            if rank == 0 and cfg["metrics"] and (state.step % cfg["eval_every"] == 0 or last):
                if not log:
                    log.append(MetricsLog(cfg["metrics"]))
                record = {"step": state.step, "loss": seen["loss"], "workers": size,
                          "samples_per_s": seen["samples"] / (time.perf_counter() - began),
                          **traffic(client, opt)}
                record["accuracy"], record["test_loss"] = evaluate(model, data)
                log[0].append(record)
            if checkpoints and (state.step % cfg["checkpoint_every"] == 0 or last):
                digest = checkpoint.parameters_digest(model)
                kept = elastic_checkpoint.kept(state.saved, state.step, digest, checkpoints.keep)
                checkpoints.committed = sorted(state.saved)  # the job's, a joiner's too
                checkpoints.commit(model, opt, step=state.step, job=checkpoint.job_identity(cfg),
                                   meta=elastic_checkpoint.meta(state, digest),
                                   record=elastic_checkpoint.record(kept, state.run))
                state.saved = kept
                state.commit()
            elif state.step % every == 0 or last:
                state.commit()
    run(state)
    result = summary(model, data, compression, opt, seen["loss"], state.step, seen["samples"],
                     began)
    for opened in log:
        opened.close()
    bps.shutdown()
    return result


def make_model(cfg: dict, device: torch.device) -> tuple[nn.Module, bps.GradientCompression,
                                                         bps.DistributedOptimizer]:
    """The config's model on ``device`` (built on the CPU: one initialisation anywhere), its
    gradient compression and the distributed optimizer over them."""
    model = build(cfg["model"], cfg["model_args"]).to(device)
    compression = make_compression(cfg)
    opt = bps.DistributedOptimizer(make_optimizer(model, cfg["optimizer"]), model.named_parameters(),
                                   compression, nonfinite=cfg["nonfinite"])
    return model, compression, opt


def summary(model: nn.Module, data: Dataset, compression: bps.GradientCompression,
            opt: bps.DistributedOptimizer, train_loss: float, steps: int, samples: int,
            began: float) -> dict:
    """The run's summary: test accuracy and loss, throughput over the ``samples`` all workers
    took since ``began``, traffic, and a digest of the parameters."""
    wall = time.perf_counter() - began
    accuracy, test_loss = evaluate(model, data)
    return {"accuracy": accuracy, "loss": test_loss, "train_loss": train_loss, "steps": steps,
            "samples_per_s": samples / wall if samples else 0.0, **traffic(bps.client(), opt),
            "compressor": compression.compressor.name if compression.compressor else "none",
            "wall_s": wall, "workers": bps.size(), "rank": bps.rank(),
            "checksum": checkpoint.parameters_digest(model)}


def join(cfg: dict, device: torch.device) -> tuple[int, int]:
    """Join the cluster from ``device``: this worker's rank and the number of workers."""
    if device.type == "cuda":  # kernels that launch on the current device's stream (Triton's)
        torch.cuda.set_device(device)  # and the CUDA context: this GPU's, not the first's
    torch.manual_seed(cfg["seed"])
    bps.init(job=job_description(cfg, device))
    rank, size = bps.rank(), bps.size()
    print(f"worker {rank} of {size} trains on {job_device.describe(device)}", flush=True)
    return rank, size


def starting_step(args, model: nn.Module, opt: bps.DistributedOptimizer, cfg: dict,
                  total: int) -> tuple[int, list[int]]:
    """The step this run starts at (its checkpoint's, or 0 with worker 0's parameters and
    optimizer state on every worker) and the steps every worker's checkpoints hold."""
    start, committed = checkpoint.restore(args.checkpoint_dir, model, opt, cfg, total)
    if start is not None:
        return start, committed
    bps.broadcast_parameters(model.state_dict(), root_rank=0)
    bps.broadcast_optimizer_state(opt, root_rank=0)
    return 0, committed


def train_step(model: nn.Module, opt: bps.DistributedOptimizer, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
    """One step on ``batch``: its loss."""
    x, y = batch
    opt.zero_grad(set_to_none=True)
    logits = model(x)
    loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    loss.backward()
    opt.step()
    return loss.item()


def traffic(client, opt: bps.DistributedOptimizer) -> dict:
    """What this worker has sent and received so far, and its seconds compressing."""
    return {"bytes_pushed": client.bytes_pushed, "bytes_pulled": client.bytes_pulled,
            "bytes_allreduced": opt.allreduce_bytes, "compress_s": client.compress_seconds}


def end_progress_lines() -> None:
    """Close any open progress bar, so that what is printed next starts on a line of its own."""
    for bar in list(getattr(tqdm, "_instances", ())):
        bar.close()


def main(argv: list[str] | None = None) -> int:
    """``python -m worker``: the training job; returns the exit status."""
    # the cluster's notices at INFO, as the server and the scheduler log them; other libraries'
    # loggers keep their own levels
    logging.basicConfig(format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("adtopk_ps").setLevel(logging.INFO)
    stop_quietly_on_signals("worker", before=end_progress_lines)
    args = job_config.parse_args(argv)
    try:
        cfg = job_config.load(args)  # validated in full before this worker joins the cluster
        device = job_device.resolve(cfg["device"])  # likewise: no GPU for device: cuda
        dataset = load(cfg["dataset"], cfg["seed"], cfg["dataset_args"])  # and a damaged dataset
        writable_outputs(args.checkpoint_dir, args.metrics_out, cfg["metrics"])  # and its outputs
    except ValueError as exc:  # (EnvError too: a malformed BYTEPS_LOCAL_RANK)
        print(f"worker: {exc}", file=sys.stderr)
        return 2
    try:
        with logging_redirect_tqdm():  # a log line never shares one with the bar
            summary = train(cfg, args, device, dataset)
    except BaseException as exc:
        end_progress_lines()  # an error never shares a line with the bar
        if isinstance(exc, (EnvError, DatasetUnavailable)):  # started outside bpslaunch, a bad
            # DMLC_* variable, or a dataset too small for the workers (every worker finds it)
            return ended_on(exc, 2, str(exc))
        if isinstance(exc, RegistrationRefused):  # another job's config, shape or id: the
            print(f"worker: {exc}", file=sys.stderr, flush=True)  # job, if one runs, goes on
            return 2
        if not isinstance(exc, (ClusterError, TimeoutError, bps.Disagreement,
                                bps.NonFiniteGradient, bps.ReplicasDiverged, CollectiveError,
                                OutputError, PushPullError)):
            raise
        return ended_on(exc, 1)
    if summary["rank"] == 0:
        print("summary: " + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                     for k, v in summary.items()), flush=True)
        if args.metrics_out:
            try:
                write_summary(args.metrics_out, summary)
            except OutputError as exc:
                return ended_on(exc, 1)
    return 0


def ended_on(exc: BaseException, status: int, line: str | None = None) -> int:
    """The job's one line for the error it ends on (``line``, or the error's type and text),
    and ``status`` for it to exit with; the scheduler and the servers are told, so that they
    exit with it too (role mode)."""
    named = f"{type(exc).__name__}: {exc}"
    print(f"worker: {line or named}", file=sys.stderr, flush=True)
    mark_failed(named, status)
    return status
