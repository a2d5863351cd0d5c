"""The worker side of the Ray edge: the function every Ray Train worker runs, and the adapters that give the
Ray-free training loop (raysft.training.trainer) Ray's context, checkpoint registration, reports, preemption
notices and the driver's stop request. Nothing here runs on the driver; raysft.launch.ray_driver starts the workers
with `train_worker`.

Checkpoints on a local or shared (NFS) run.storage_path are written once, by the workers, straight into the run
directory, and registered with Ray where they lie (`checkpoint_upload_mode=NO_UPLOAD`, raysft.checkpoint's
DirectorySink); on remote storage (s3://, ...) each worker writes node-local scratch that Ray uploads."""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path

import ray

from raysft.checkpoint import (
    STATE_FILE,
    DirectorySink,
    ScratchSink,
    Sink,
    checkpoint_name,
    clear_scratch,
    existing_checkpoint_names,
    scratch_root,
)
from raysft.checkpoint.gen_record import recorded_metric, write_failure
from raysft.checkpoint.retention import eval_loss, unregistered
from raysft.config import TrainConfig, config_from_dict
from raysft.distributed.collectives import from_rank0
from raysft.errors import ends_the_run
from raysft.launch.paths import check_worker_paths
from raysft.launch.ray_controller import RAY_GRACE_S, RECORDED, record_run_ending, request_evaluation
from raysft.launch.ray_live import train_live
from raysft.launch.ray_train import Checkpoint, CheckpointUploadMode
from raysft.storage import Location, location, use_filesystem
from raysft.training.trainer import Trainer, WorkerContext, resume_trainer


def train_worker(loop_config: dict) -> None:
    cfg = config_from_dict(loop_config["config"])
    if loop_config["filesystem"] is not None:  # the driver's endpoint and options; credentials: this process's env
        use_filesystem(cfg.run.storage_path, loop_config["filesystem"], loop_config["filesystem_path"])
    _quiet_console()
    worker = ray_worker_context()
    if ray.train.get_context().get_local_rank() == 0:  # before the first collective, so before any worker saves
        clear_scratch(scratch_root(cfg.run.name, cfg.run_dir))
    try:
        store, eval_store = Path(loop_config["store"]), loop_config.get("eval_store")
        eval_store = Path(eval_store) if eval_store else None
        check_worker_paths(cfg, [s for s in (store, eval_store) if s],
                           f"node {ray.util.get_node_ip_address()} (rank {worker.rank})")
        if cfg.live.enabled:  # a replica group of one (every group asks for the driver's stop: it is the quorum's)
            newest = train_live(cfg, store, stop_requested(loop_config["stop_flag"], 0), loop_config["driver_ip"])
            register_lost_checkpoints(cfg, newest, worker.rank)  # every group is here: the run's last quorum held all
            return
        trainer = _build_trainer(cfg, store, worker, eval_store, stop_requested(loop_config["stop_flag"], worker.rank))
        register_lost_checkpoints(cfg, trainer.resume_dir, worker.rank)
        trainer.train()
    except Exception as e:
        if ends_the_run(e):  # the driver's EndRunOnRecordedError sees the record and ends the run, no restart
            record_run_ending(cfg.run_dir, worker.rank, e)
        raise


def stop_requested(flag, rank: int) -> Callable[[], bool]:
    """Rank 0 asks the driver's StopFlag (the loop shares the answer with every rank); a flag that is gone (the
    driver with it) is no request: Ray ends the workers of a dead driver itself."""
    def ask() -> bool:
        try:
            return rank == 0 and ray.get(flag.get.remote(), timeout=30)
        except (ray.exceptions.RayError, TimeoutError):
            return False

    return ask


def _quiet_console() -> None:
    """Ray Train logs every report (`Reporting training result N: TrainingReport(...)`, the whole metrics dict) at
    INFO through a logger named by its file's path, which RunConfig's logging_config does not reach; and the
    traceback of the error a worker raised (`Error in training function: ...`), which for a run-ending error
    says no more than the driver's one line. Drop those records from the console only: the worker's Ray Train
    log file still gets them. A Ray without those modules or that handler is left as it is."""
    try:
        from ray.train.v2._internal import util
        from ray.train.v2._internal.execution import context
    except ImportError:
        return
    noisy = context.__file__

    class _DropReports(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            if record.name == util.__name__ and record.levelno >= logging.ERROR and RECORDED.is_set():
                return False
            return record.name != noisy or record.levelno >= logging.WARNING

    for handler in logging.getLogger().handlers:
        if type(handler).__name__ == "PlainRayHandler":  # Ray Train's console handler; its file handlers differ
            handler.addFilter(_DropReports())


def _build_trainer(cfg: TrainConfig, store: Path, worker: WorkerContext, eval_store: Path | None = None,
                   stop: Callable[[], bool] = lambda: False) -> Trainer:
    """Resumes from the run's newest complete checkpoint. That is Ray's latest (`ray.train.get_checkpoint()`)
    unless Ray's record of a newer one died with a worker, or its latest was cut short."""
    sink = ray_sink(cfg, worker.rank, existing_checkpoint_names(cfg.run_dir))
    return resume_trainer(cfg, store, worker, sink, ray_preemption_deadline, eval_store, stop)


def ray_worker_context() -> WorkerContext:
    ctx = ray.train.get_context()
    return WorkerContext(rank=ctx.get_world_rank(), world_size=ctx.get_world_size(),
                         device=ray.train.torch.get_device(), node_rank=ctx.get_node_rank(),
                         node=ray.get_runtime_context().get_node_id())


def ray_preemption_deadline() -> float | None:
    """Collective (a Ray barrier: docs/BENCHMARKS.md times it): when a node of this run will be taken away, if Ray
    knows."""
    info = ray.train.get_preemption_info()
    if info is None:
        return None
    return info.deadline_ms / 1000 if info.deadline_ms else math.inf


def ray_sink(cfg: TrainConfig, rank: int, taken: frozenset[str]) -> Sink:
    """Straight into a local or shared run directory, registered with NO_UPLOAD (Ray prunes: ray_checkpoint_config);
    on remote storage, Ray's upload from node-local scratch."""
    score = scored_by(cfg)
    if isinstance(cfg.run_dir, Path):
        def commit(final: Path | None, metrics: dict) -> None:
            validate = final is not None and evaluation_wanted(cfg, location(final), metrics["step"])
            register_with_ray(final, scored_metrics(metrics, score), validate)

        return DirectorySink(cfg.run_dir, rank, taken=taken, on_report=ray.train.report, on_commit=commit)

    def report(metrics: dict, ckpt: Path | None, step: int) -> None:
        name = location(cfg.run_dir) / checkpoint_name(step, taken)
        # every rank joins rank 0's decision (a rank that wrote no part of this checkpoint too); none without eval
        wanted = bool(cfg.eval.path) and from_rank0(lambda: ckpt is not None and evaluation_wanted(cfg, name, step))
        ray_report(scored_metrics(metrics, score if ckpt else None), ckpt, step, taken, wanted and ckpt is not None)

    return ScratchSink(report, scratch_root(cfg.run.name, cfg.run_dir))


def evaluation_wanted(cfg: TrainConfig, ckpt: Location, step: int) -> bool:
    """Rank 0, registering checkpoint `ckpt`: whether to ask Ray for its generation evaluation. With
    eval.every_checkpoint false, not while the one asked for before has not ended, unless it is the base or the
    run's last (raysft.launch.ray_controller.request_evaluation); one not asked for is recorded as skipped."""
    if not cfg.eval.path:
        return False
    if cfg.eval.every_checkpoint:
        return True
    why = request_evaluation(cfg.run_dir, ckpt.name, always=step in (0, cfg.train.max_steps),
                             expires_s=cfg.eval.timeout_s + RAY_GRACE_S)
    if why is not None:
        write_failure(ckpt, {"step": step, "checkpoint": ckpt.name, "kind": "skipped", "key": None, "reason": why,
                             "finished": time.time()})
    return why is None


def scored_by(cfg: TrainConfig) -> str | None:
    """What Ray ranks checkpoints by (checkpoint.best_metric), with checkpoint.keep_best; else None."""
    return cfg.checkpoint.best_metric if cfg.checkpoint.keep_best else None


def scored_metrics(metrics: dict, score: str | None) -> dict:
    """With checkpoint.keep_best, a checkpoint reported without its score (one not validated, a preemption's; every
    one when the score is a generation evaluation's, which Ray's validation task adds later) gets the score NaN,
    which Ray ranks last, instead of Ray logging an error for the missing score. A failed evaluation leaves it so."""
    return {**metrics, score: math.nan} if score and score not in metrics else metrics


def register_with_ray(final: Path | None, metrics: dict, validate: bool = False) -> None:
    """Every rank reports (a barrier); rank 0 names the checkpoint, already complete in the run directory, and with
    `validate` (an eval section) asks for its generation evaluation: Ray's validation task (ray_driver)."""
    checkpoint = None
    if final is not None:
        checkpoint = Checkpoint(str(final), filesystem=ray.train.get_context().get_storage().storage_filesystem)
    ray.train.report(metrics, checkpoint=checkpoint, checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD,
                     validation=validate and checkpoint is not None)


def register_lost_checkpoints(cfg: TrainConfig, resume_dir: Path | None, rank: int) -> None:
    """Collective: register with Ray, in order, the complete checkpoints whose reports died with a worker, the one
    resumed from last (checkpoint.retention.unregistered), so that Ray, the one deleter under Ray, prunes them
    too. Each with the step, eval loss and score recorded with it, and its generation evaluation asked for (a
    recorded one is returned at once: raysft.evals.runner)."""
    latest = ray.train.get_checkpoint()

    def lost() -> list[tuple[str, dict]]:
        found = unregistered(cfg.run_dir, resume_dir, Path(latest.path).name if latest else None)
        return [(location(c).path, recorded_metrics(c, scored_by(cfg))) for c in found]

    storage = ray.train.get_context().get_storage().storage_filesystem
    for path, metrics in from_rank0(lost):
        checkpoint = Checkpoint(path, filesystem=storage) if rank == 0 else None
        ray.train.report(metrics, checkpoint=checkpoint, checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD,
                         validation=bool(cfg.eval.path) and checkpoint is not None)


def recorded_metrics(ckpt, score: str | None) -> dict:
    """The step, eval loss and score (checkpoint.best_metric) recorded with a checkpoint, as its commit and its
    evaluation reported them."""
    metrics = {"step": json.loads((location(ckpt) / STATE_FILE).read_text())["step"]}
    if (loss := eval_loss(ckpt)) is not None:
        metrics["eval_loss"] = loss
    if score and (value := recorded_metric(ckpt, score)) is not None:
        metrics[score] = value
    return scored_metrics(metrics, score)


def ray_report(metrics: dict, checkpoint_dir: Path | None, step: int, taken: frozenset[str] = frozenset(),
               validate: bool = False) -> None:
    if checkpoint_dir is None:
        ray.train.report(metrics)
    else:
        ray.train.report(metrics, checkpoint=Checkpoint.from_directory(checkpoint_dir),
                         checkpoint_dir_name=checkpoint_name(step, taken), validation=validate)
