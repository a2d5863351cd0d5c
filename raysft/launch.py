"""The Ray edge: prepare data on the driver, start a TorchTrainer, and adapt Ray's context, checkpoints and
reports to the Ray-free training loop in raysft.trainer."""

from __future__ import annotations

import functools
import math
import os
from pathlib import Path

import ray
import ray.train
import torch.distributed as dist
from ray.train import Checkpoint, CheckpointConfig, FailureConfig, Result, RunConfig, ScalingConfig, WorkerGroupError
from ray.train.torch import TorchConfig, TorchTrainer

from raysft.checkpoint import incomplete_reason
from raysft.config import ConfigError, TrainConfig
from raysft.config import ScalingConfig as RaysftScaling
from raysft.data import prepare_store
from raysft.tokenizer import load_tokenizer
from raysft.trainer import Trainer, WorkerContext

CHECKPOINT_PREFIX = "checkpoint_"  # + zero-padded step: names sort by step
# Attempts to (re)start the worker group before giving up, so an unschedulable run fails instead of waiting forever.
CONTROLLER_FAILURE_LIMIT = 3


class ClusterTooSmall(RuntimeError):
    """The Ray cluster can never place the requested workers."""


def train(config: TrainConfig) -> Result:
    """Tokenize the data (or reuse the store), then train on the Ray cluster in RAY_ADDRESS or a local one.

    Launching again with the same run.name and run.storage_path resumes from the run's latest checkpoint.
    """
    tokenizer = load_tokenizer(config.model, config.data.chat_template)
    store = prepare_store(config.data, tokenizer, config.store_dir)
    print(f"raysft: data store {store.path} ({store.num_samples} samples{', reused' if store.reused else ''})",
          flush=True)
    connect_ray(config.scaling)
    check_cluster_can_place(config.scaling)
    s = config.scaling
    trainer = TorchTrainer(
        train_loop_per_worker=_train_fn,
        train_loop_config={"config": config.to_dict(), "store": str(store.path)},
        torch_config=TorchConfig(backend="nccl" if s.use_gpu else "gloo"),
        scaling_config=ScalingConfig(num_workers=s.num_workers, use_gpu=s.use_gpu,
                                     resources_per_worker=worker_resources(s)),
        run_config=RunConfig(
            name=config.run.name,
            storage_path=str(Path(config.run.storage_path).expanduser().resolve()),
            failure_config=FailureConfig(max_failures=s.max_failures,
                                         controller_failure_limit=CONTROLLER_FAILURE_LIMIT),
            checkpoint_config=CheckpointConfig(num_to_keep=config.checkpoint.keep),
        ),
    )
    print(f"raysft: run {config.run.name} in {config.run_dir}", flush=True)
    try:
        return trainer.fit()
    except WorkerGroupError as e:  # a layout the workers found unusable is a config error, not a crash
        config_errors = [x for x in e.worker_failures.values() if isinstance(x, ConfigError)]
        if config_errors:
            raise config_errors[0] from e
        raise


def connect_ray(scaling: RaysftScaling) -> None:
    """Join the cluster in RAY_ADDRESS, or start a local Ray with just enough logical CPUs for the workers."""
    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):
        ray.init()
    else:
        ray.init(num_cpus=math.ceil(scaling.num_workers * scaling.cpus_per_worker))


def worker_resources(scaling: RaysftScaling) -> dict[str, float]:
    return {"CPU": scaling.cpus_per_worker, **({"GPU": 1.0} if scaling.use_gpu else {})}


def check_cluster_can_place(scaling: RaysftScaling) -> None:
    need = worker_resources(scaling)
    fits = 0
    for node in ray.nodes():
        if node.get("Alive"):
            res = node.get("Resources", {})
            fits += int(min(res.get(k, 0.0) / v for k, v in need.items()))
    if fits < scaling.num_workers:
        raise ClusterTooSmall(
            f"the Ray cluster fits {fits} workers of {need}, but scaling.num_workers={scaling.num_workers}: "
            "lower scaling.num_workers or scaling.cpus_per_worker, or add nodes")


def _train_fn(loop_config: dict) -> None:
    cfg = TrainConfig.from_dict(loop_config["config"])
    worker = ray_worker_context()
    store = Path(loop_config["store"])
    report = functools.partial(ray_report, taken=existing_checkpoint_names(cfg.run_dir, worker.rank))
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        Trainer(cfg, store, None, report, worker).train()
        return
    with checkpoint.as_directory() as latest:
        resume_dir, skipped = choose_resume_dir(Path(latest), worker.rank)
        trainer = Trainer(cfg, store, resume_dir, report, worker)
    for path, reason in skipped:
        trainer.log.event("skipped_incomplete_checkpoint", checkpoint=path, reason=reason)
    trainer.train()


def choose_resume_dir(latest: Path, rank: int) -> tuple[Path | None, list[tuple[str, str]]]:
    """Collective: the newest complete checkpoint, starting from the one Ray registered last and going back
    through the older ones beside it, and the (path, reason) of each incomplete one skipped. Rank 0 checks sizes
    and checksums against each manifest; None if no checkpoint is complete (the run starts over)."""
    result: list = [None, []]
    if rank == 0:
        older = [p for p in checkpoint_dirs(latest.parent) if p.name < latest.name]
        for candidate in [latest, *reversed(older)]:
            reason = incomplete_reason(candidate)
            if reason is None:
                result[0] = str(candidate)
                break
            result[1].append((str(candidate), reason))
    dist.broadcast_object_list(result, src=0)
    return (Path(result[0]) if result[0] else None), result[1]


def ray_worker_context() -> WorkerContext:
    ctx = ray.train.get_context()
    return WorkerContext(rank=ctx.get_world_rank(), world_size=ctx.get_world_size(),
                         device=ray.train.torch.get_device(), node_rank=ctx.get_node_rank())


def existing_checkpoint_names(run_dir: Path, rank: int) -> frozenset[str]:
    """Collective: the checkpoint directories already in the run (rank 0 looks), fixed for this launch."""
    names = [[p.name for p in checkpoint_dirs(run_dir)] if rank == 0 else None]
    dist.broadcast_object_list(names, src=0)
    return frozenset(names[0])


def checkpoint_dirs(run_dir: Path) -> list[Path]:
    """The run's checkpoint directories, oldest first (their names sort by step)."""
    return sorted(p for p in run_dir.glob(f"{CHECKPOINT_PREFIX}*") if p.is_dir())


def checkpoint_name(step: int, taken: frozenset[str] = frozenset()) -> str:
    """checkpoint_<step, 8 digits>; a step saved again after resuming from an older checkpoint gets .1, .2, ...
    (Ray would merge it into the old directory, and pruning one entry would delete both)."""
    name = base = f"{CHECKPOINT_PREFIX}{step:08d}"
    n = 0
    while name in taken:
        n += 1
        name = f"{base}.{n}"
    return name


def ray_report(metrics: dict, checkpoint_dir: Path | None, step: int, taken: frozenset[str] = frozenset()) -> None:
    if checkpoint_dir is None:
        ray.train.report(metrics)
    else:
        ray.train.report(metrics, checkpoint=Checkpoint.from_directory(checkpoint_dir),
                         checkpoint_dir_name=checkpoint_name(step, taken))
