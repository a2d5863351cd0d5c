"""The generation evaluation as Ray Train's validation function, and the in-process one of the torchrun launch.

Under Ray (raysft.launch.ray_driver gives `validate_checkpoint` to TorchTrainer's ValidationConfig, and every
checkpoint report asks for it): Ray runs it as a task of its own on each registered checkpoint, on eval.num_cpus /
eval.num_gpus, while the workers train on; the metrics it returns join that checkpoint's (so
checkpoint_score_attribute ranks by them). It keeps its record beside the checkpoint, returns a recorded
evaluation of the same key without generating again, and on a failure or timeout records it and raises: Ray marks
the checkpoint's validation failed, its metrics stay without the score (ranked last), and training goes on.

Under torchrun (`EvaluatingSink`): after each checkpoint is committed, rank 0 evaluates it in this process while
the other ranks wait, so training blocks for the evaluation. The others wait on the process group's store, not in
a collective, so an evaluation longer than the process group's timeout breaks nothing.

Nothing here imports Ray: Ray hands `validate_checkpoint` a ray.train.Checkpoint, of which it reads the path and
the filesystem.
"""

from __future__ import annotations

import gc
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from raysft.checkpoint import Sink, checkpoint_dirs
from raysft.checkpoint.discovery import step_of
from raysft.config import GenEvalConfig, TrainConfig
from raysft.evals.engines import resolve_engine
from raysft.evals.runner import MAX_ATTEMPTS, evaluate_checkpoint
from raysft.storage import Location, native


def validation_kwargs(cfg: TrainConfig) -> dict:
    """The validation function's keyword arguments (JSON values, as Ray's ValidationTaskConfig wants them), with the
    engine settled here, on the driver, for every evaluation of the run, and the evaluation task's resources."""
    return {"settings": asdict(cfg.eval), "system_prompt": cfg.data.system_prompt, "engine": resolve_engine(cfg.eval),
            "resources": task_resources(cfg)}


# Ray's validation task itself only waits on the evaluation's (raysft.launch.ray_controller.validate_checkpoint).
# Its process killed (not its node: raysft.launch.ray_driver.validation_task_options), Ray starts it again, at most
# twice: each start is an attempt at the evaluation (MAX_ATTEMPTS), and once its retries are spent Ray 2.60 ends the run
VALIDATION_TASK_RESOURCES = {"num_cpus": 0, "max_retries": 2}


def task_resources(cfg: TrainConfig) -> dict:
    """The evaluation task's resources (Ray's options of a task). With vLLM the task only drives: vLLM's own engine
    actor holds the GPUs. Not retried: a failure is recorded and the checkpoint stays unranked."""
    gpus = 0 if resolve_engine(cfg.eval) == "vllm" else cfg.eval.num_gpus
    return {"num_cpus": cfg.eval.num_cpus, "num_gpus": gpus, "max_retries": 0}


def validate_checkpoint(checkpoint, settings: dict, system_prompt: str = "", engine: str = "hf") -> dict:
    """Ray Train's ValidationFn: {gen/<scorer>: score} of `checkpoint` (a ray.train.Checkpoint), at most
    MAX_ATTEMPTS attempts at it across the run's launches. Ray may run the next task in the same worker process:
    what the model held goes back before this one returns."""
    ckpt = native(Location(checkpoint.filesystem, checkpoint.path))
    try:
        record, _ = evaluate_checkpoint(ckpt, GenEvalConfig(**settings), system_prompt, engine,
                                        max_attempts=MAX_ATTEMPTS)
    finally:
        release_memory()
    return dict(record["metrics"])


def release_memory() -> None:
    """What an evaluation's model held goes back: to the next task in the same process (Ray), or to training
    (torchrun, where rank 0 evaluates in the training process)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class EvaluatingSink:
    """A Sink that, after committing a checkpoint, has rank 0 evaluate it in-process (the torchrun launch). A
    checkpoint saved for a stop request is not evaluated (the process is about to exit): its evaluation is left to
    `raysft eval`, or to the next launch's at_start."""

    launches = 0  # the sinks this process made: every rank makes its own in the same order, so the keys agree

    def __init__(self, inner: Sink, cfg: TrainConfig, rank: int, stop_requested: Callable[[], bool] = lambda: False):
        self.inner, self.cfg, self.rank, self.stop_requested = inner, cfg, rank, stop_requested
        self.shared = inner.shared
        self.engine = resolve_engine(cfg.eval)
        EvaluatingSink.launches += 1
        self.prefix, self.commits = f"raysft/gen_eval/{EvaluatingSink.launches}", 0

    def stage(self, step: int) -> Path:
        return self.inner.stage(step)

    def discard(self, staged: Path) -> None:
        self.inner.discard(staged)

    def report(self, metrics: dict, step: int) -> None:
        self.inner.report(metrics, step)

    def commit(self, staged: Path, step: int, metrics: dict, wrote: bool) -> None:
        self.inner.commit(staged, step, metrics, wrote)
        self.commits += 1
        key = f"{self.prefix}/{self.commits}"  # a key of this launch's: a process may run several launches
        store = dist.distributed_c10d._get_default_store()
        if self.rank != 0:
            while not store.check([key]):  # not a collective: no process-group timeout applies
                time.sleep(0.1)
            return
        try:
            if not self.stop_requested():
                self._evaluate(step)
        finally:
            store.set(key, "done")

    def _evaluate(self, step: int) -> None:
        ckpts = [c for c in checkpoint_dirs(self.cfg.run_dir) if step_of(c) == step]
        if not ckpts:
            return  # pruned at once (keep: the checkpoint is not the newest): nothing to evaluate
        # loading the model (a LoRA checkpoint's export and merge) and sampling draw random numbers: on a stream of
        # their own, so that the training's (dropout; a resumed run's, restored from the checkpoint) is as it was
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        try:  # the record (result or failure) is logged by the trainer's GenEvalLog
            with torch.random.fork_rng(devices=devices):
                evaluate_checkpoint(ckpts[-1], self.cfg.eval, self.cfg.data.system_prompt, self.engine)
        except Exception as e:  # noqa: BLE001 - an evaluation never ends training
            sys.stderr.write(f"raysft: generation evaluation of {ckpts[-1]} failed: {type(e).__name__}: {e}\n")
        finally:
            release_memory()
