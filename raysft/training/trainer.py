"""The training loop that runs on every worker. It needs torch.distributed, not Ray: Ray is plugged in through the
checkpoint `sink` (progress and checkpoints, raysft.checkpoint) and `resume_dir` (the checkpoint to continue
from). The loop is the same for every objective: SFT or DPO chooses its own loss, step and validation, once
(raysft.training.objective); the Checkpointer chooses the state to go on from, across its tiers."""

from __future__ import annotations

import os
import socket
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch.distributed.tensor import DTensor

from raysft.checkpoint import Checkpointer, Sink, TrainingObjects, checkpoint_name, find_resume_dir
from raysft.checkpoint.checkpointer import open_memory_tier
from raysft.config import TrainConfig
from raysft.data.dataloader import GlobalBatchSampler
from raysft.data.tokenizer import load_tokenizer
from raysft.distributed.layout import ParallelDims, gather_nodes
from raysft.model.build import (
    build_meta_model,
    load_initial_weights,
    load_model_config,
    materialize,
    tied_parameter_aliases,
)
from raysft.model.lora import add_adapters, record
from raysft.parallel.fsdp import parallelize
from raysft.training.gen_log import GenEvalLog
from raysft.training.metrics import (
    MetricsLogger,
    StepResult,
    StepTotals,
    matmul_parameters,
    peak_memory_gb,
    peak_tflops,
    training_flops,
)
from raysft.training.objective import Worker, objective_for
from raysft.training.optim import build_loss_scaler, build_lr_scheduler, build_optimizer, check_lr_continues
from raysft.training.step_guard import StepGuard

if TYPE_CHECKING:  # torchft is an optional dependency (the liveft extra): imported only by a live launch
    from raysft.training.live import LiveReplicas


def use_deterministic_kernels(device: torch.device) -> None:
    """Deterministic kernels only (train.deterministic): the same inputs give the same bits, so a stopped and
    resumed run equals the uninterrupted one on GPUs too. cuBLAS needs a fixed workspace (read when it starts, so
    set before the first matmul); the memory-efficient SDPA backward has no deterministic variant, so SDPA uses
    flash or math; flash attention, varlen included, reads the deterministic flag itself."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    if device.type == "cuda":
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
        torch.backends.cuda.enable_mem_efficient_sdp(False)


@dataclass
class WorkerContext:
    rank: int
    world_size: int
    device: torch.device
    node_rank: int = 0
    """The worker's node (Ray numbers nodes by IP); HYBRID_SHARD derives its mesh from every worker's."""
    node: str = ""
    """The worker's node as the memory tier keeps its snapshots apart (Ray's node id; empty: this host's name)."""


def resume_trainer(cfg: TrainConfig, store: Path, ctx: WorkerContext, sink: Sink,
                   preemption_deadline: Callable[[], float | None] = lambda: None,
                   eval_store: Path | None = None, stop_requested: Callable[[], bool] = lambda: False,
                   live: LiveReplicas | None = None) -> Trainer:
    """Collective: a Trainer that continues from the run's newest complete checkpoint (a fresh one if none)."""
    resume_dir, skipped = find_resume_dir(cfg.run_dir)
    trainer = Trainer(cfg, store, resume_dir, sink, ctx, preemption_deadline, eval_store, stop_requested, live)
    for path, reason in skipped:
        trainer.log.event("skipped_incomplete_checkpoint", checkpoint=path, reason=reason)
    return trainer


class Trainer:
    """Builds the sharded model, optimizer and data on this worker; `train()` runs to cfg.train.max_steps.

    `preemption_deadline` and `stop_requested` go to the Checkpointer, which decides when to save on them (see
    raysft.checkpoint.checkpointer.Checkpointer); after the save of a stop request, `train()` returns. With `live`,
    this worker is a replica group of one in a live quorum (raysft.training.live): each step is the quorum's, and
    only the group that `live` says writes logs the steps and saves the checkpoints.
    """

    def __init__(self, cfg: TrainConfig, store: Path, resume_dir: Path | None, sink: Sink,
                 ctx: WorkerContext, preemption_deadline: Callable[[], float | None] = lambda: None,
                 eval_store: Path | None = None, stop_requested: Callable[[], bool] = lambda: False,
                 live: LiveReplicas | None = None):
        self.cfg, self.ctx, self.live = cfg, ctx, live
        self.sink, self.resume_dir = sink, resume_dir
        self.stopped = False  # by a stop request, at self.state.step, with a checkpoint of that step
        # the launch's last step: train.stop_at_step ends a launch early, the schedule stays max_steps'
        self.end_step = cfg.train.stop_at_step or cfg.train.max_steps
        t = cfg.train
        # The mesh first: a layout that cannot work fails before anything is built.
        node_ranks, nodes = gather_nodes(ctx.node_rank, ctx.node or socket.gethostname())
        self.dims = ParallelDims.from_config(cfg.parallel, node_ranks, nodes)
        self.mesh, self.sequence_group = self.dims.build_mesh(ctx.device.type), self.dims.sequence_group()
        self.shard = self.dims.place(ctx.rank)
        if t.deterministic:
            use_deterministic_kernels(ctx.device)
        torch.manual_seed(t.seed + ctx.rank)  # each rank's own stream (dropout); checkpoints carry it on
        self.tokenizer = load_tokenizer(cfg.model, cfg.data.chat_template)
        self.hf_config = load_model_config(cfg.model, self.tokenizer)

        # Model: meta → sharded → materialized shards → each rank's slices of the weights.
        self.model = add_adapters(build_meta_model(self.hf_config, cfg.model.attn_implementation), cfg.model.lora)
        self.aliases = tied_parameter_aliases(self.model)
        self.matmul_params = matmul_parameters(self.model)
        self.peak_tflops = peak_tflops(ctx.device, cfg.parallel.mixed_precision)
        parallelize(self.model, self.mesh, cfg.parallel, self.sequence_group)
        materialize(self.model, torch.device("cpu") if cfg.parallel.cpu_offload else ctx.device)
        self.objective = objective_for(cfg)  # SFT or DPO: its loss, its step, its validation
        self.objective.prepare_model(self.model)
        self.optimizer = build_optimizer(self.model, t)
        self.scheduler = build_lr_scheduler(self.optimizer, t)
        self.scaler = build_loss_scaler(cfg.parallel, ctx.device)
        self.guard = StepGuard(t)
        self.objs = TrainingObjects(self.model, self.optimizer, self.scheduler, self.scaler, self.hf_config,
                                    self.tokenizer, self.aliases, self.guard, lora=record(cfg))
        self.log = MetricsLogger(cfg.run_dir if ctx.rank == 0 else None, t.max_steps, t.log_every_n_steps)
        self.totals = StepTotals(ctx.device, self.peak_tflops)
        self.checkpointer = Checkpointer(cfg.checkpoint, self.objs, self.sink, self.log, ctx.rank, ctx.device,
                                         preemption_deadline, stop_requested,
                                         open_memory_tier(cfg, self.objs, self.dims, ctx.device, self.log))
        resume = self.checkpointer.newest(resume_dir)  # the memory tier's snapshot or the stored checkpoint
        stores = [store] + ([eval_store] if eval_store else [])
        # LoRA checkpoints hold the adapters only; a reference pass reads the starting weights, also on a resume
        if not resume.found or cfg.model.lora.r or self.objective.needs_starting_weights(stores):
            fallback = load_initial_weights(self.model, cfg.model, self.hf_config, t.seed)
            if fallback:  # pretrained weights through rank 0's memory: say why, where the run's events are
                self.log.event("weights_from_rank0", path=cfg.model.path, reason=fallback)
        worker = Worker(self.shard, ctx.world_size, ctx.device, self.tokenizer.pad_token_id, self.log)
        self.objective_step = self.objective.step(store, self.model, worker)
        # before the restore replaces the starting weights (a DPO reference pass)
        self.evaluator = self.objective.evaluator(eval_store, self.model, worker) if eval_store else None
        self.state, held = self.checkpointer.restore(resume, t.seed)
        check_lr_continues(self.scheduler, t, self.state.step)  # a longer run must not make the LR jump back up
        if held is not None:  # a snapshot's metrics rows, not yet logged
            self.totals.hold(held.rows, held.values, ctx.rank, ctx.world_size, held.same_world)
        self.log.open_trackers(cfg, self.state.step if resume.found else None)
        # rank 0 logs the generation evaluations of the checkpoints as they end (raysft.training.gen_log)
        self.gen_log = GenEvalLog(cfg.run_dir, self.log) if cfg.eval.path and ctx.rank == 0 else None
        self.fresh = not resume.found
        num_samples = self.objective.samples_in(len(self.objective_step.dataset))  # SFT's samples, DPO's pairs
        self.sampler = GlobalBatchSampler(num_samples, t.global_batch_size, self.state.cursor)
        if live is not None:
            live.attach(self)

    def train(self) -> dict:
        t = self.cfg.train
        self.model.train()
        metrics: dict = {}
        stop = self.end_step
        self.checkpointer.start_notice_checks(self.state.step)
        if self.cfg.eval.path and self.cfg.eval.at_start and self.fresh:  # the base, evaluated as every checkpoint
            self.checkpointer.save(self.state, {})
        while self.state.step < stop:
            step_start = time.perf_counter()
            if self.train_step(reduce_metrics=False) is None:  # a live quorum ended the run at this step
                self._end_with_the_quorum(stop)
                break
            step = self.state.step
            if self.guard.diverged:  # every rank at once: log what led here, commit a save still being written
                self.reduce_metrics()
                self.checkpointer.finish(step)
                self.log.close()
                raise self.guard.diverged
            due = self.checkpointer.due(step, stop, time.perf_counter() - step_start)
            self.stopped = due.stop
            report = bool(t.report_every_n_steps) and step % t.report_every_n_steps == 0
            evaluate = self.evaluator is not None and self.evaluator.due(step, due.scheduled)
            # the same steps on every rank; in a live quorum every step, by the group that writes it
            if due.save or report or evaluate or step % t.log_every_n_steps == 0 or self.live is not None or \
                    self.checkpointer.holds_too_many(step, len(self.totals.rows)):
                metrics = self.reduce_metrics(evaluate)
            self.state.eval_loss = metrics.get("eval_loss") if evaluate else None
            self.state.eval_metrics = {k: v for k, v in metrics.items() if k.startswith("eval/")} if evaluate else None
            if due.save and self.writes():
                self.checkpointer.save(self.state, metrics, urgent=due.urgent)
            elif report and self.writes():
                self.sink.report({**metrics, "step": step}, step)
            self.checkpointer.snapshot(self.state, self.totals.rows)
            if self.stopped:
                self.log.event("stopped", step=step, reason="SIGTERM", hint="launch again to continue")
                break
            self.checkpointer.poll(step)
            if self.gen_log is not None:
                self.gen_log.poll()
        self.checkpointer.close(self.state.step)
        if self.live is not None:  # every group leaves together, the last step saved, none left to heal alone
            self.live.finish(self._saved, lambda: self.checkpointer.save(self.state, self.reduce_metrics(),
                                                                         urgent=True))
        if self.state.step < t.max_steps and not self.stopped and self.writes():
            self.log.event("stop", step=self.state.step, max_steps=t.max_steps,
                           hint="launch again without train.stop_at_step to continue")
        if self.gen_log is not None:  # what ended by now (under torchrun: every evaluation of this launch)
            self.gen_log.poll(now=True)
        self.log.close()
        return {**metrics, "step": self.state.step}

    def train_step(self, reduce_metrics: bool = True) -> dict | None:
        """One optimizer step over one global batch: the objective's forward/backward per micro-batch, clip, step
        unless the step guard skips it on every rank (raysft.training.step_guard: its decision is the step's one
        wait for the device); the metrics are kept until `reduce_metrics` (now, by default). None: no step, a live
        quorum ended the run here."""
        start = time.time()

        def backward(loss: torch.Tensor) -> None:
            self.scaler.scale(loss).backward()

        if self.live is not None:  # the quorum's step: this group's share, the gradients summed across the groups
            result = self.live.step(self, backward)
            if result is None:
                return None
        else:
            result = self.objective_step.forward_backward(self.model, self.sampler.next_batch(), backward)
        return self._optimizer_step(start, result, reduce_metrics)

    def _end_with_the_quorum(self, stop: int) -> None:
        """A live quorum ended the run at this step, every group with it: a stop request, unless this group was
        healed to the launch's end. The step is saved in LiveReplicas.finish."""
        if self.state.step < stop:
            self.stopped = True
            if self.writes():
                self.log.event("stopped", step=self.state.step, reason="SIGTERM", hint="launch again to continue")

    def _saved(self) -> bool:
        """Whether the run directory holds a checkpoint of this step (complete: a rename put it there whole)."""
        return (Path(self.cfg.run_dir) / checkpoint_name(self.state.step)).is_dir()

    def writes(self) -> bool:
        """Whether this worker writes the run's step rows and checkpoints: always, but in a live quorum only its
        writer's group does (the other groups run the same steps)."""
        return self.live is None or self.live.writes()

    def _optimizer_step(self, start: float, result: StepResult, reduce_metrics: bool) -> dict:
        """Clip, step unless the step guard skips it, and keep the step's metrics. The step's loss is
        `result.loss` summed over the ranks / `result.loss_tokens`."""
        t, ctx = self.cfg.train, self.ctx
        loss_scale = self.scaler.get_scale() if self.scaler.is_enabled() else None
        with warnings.catch_warnings():  # the scaler's found-inf flag meets DTensor grads: harmless notice
            warnings.filterwarnings("ignore", message="Found a non-scalar tensor with numel=1")
            self.scaler.unscale_(self.optimizer)  # true gradients before clipping (a no-op unless fp16)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), t.grad_clip)
        if isinstance(grad_norm, DTensor):
            grad_norm = grad_norm.full_tensor()
        lr = self.scheduler.get_last_lr()[0]
        skip = self.guard.check(self.state.step + 1, result.loss, result.loss_tokens, grad_norm)  # collective
        if skip is None:
            self.scaler.step(self.optimizer)  # (fp16 overflows are non-finite gradient norms: skipped above)
            self.scheduler.step()
        self.scaler.update()  # fp16: an overflow halves the loss scale
        self.optimizer.zero_grad(set_to_none=True)
        self.state.step += 1
        self.state.skipped_steps += skip is not None

        c = self.hf_config
        host = {"step": self.state.step, "loss_tokens": result.loss_tokens, "lr": lr, "epoch": self.state.cursor.epoch,
                "tokens": sum(result.lengths), "computed_tokens": result.computed_tokens,
                "peak_mem_gb": peak_memory_gb(ctx.device),
                "flops": training_flops(result.lengths, self.matmul_params, c.num_hidden_layers, c.hidden_size)}
        host.update(skipped=skip is not None, skipped_steps=self.state.skipped_steps)
        host.update(self.checkpointer.snapshot_metrics())  # the memory tier's skipped snapshots: never silent
        if loss_scale is not None:
            host["loss_scale"] = loss_scale
        if skip:
            host["skip_reason"] = skip
            self.log.event("skipped_step", step=self.state.step, reason=skip)
        host.update(result.host)
        self.totals.add(start, {"loss_sum": result.loss, "grad_norm": grad_norm}, host, result.means)
        return self.reduce_metrics() if reduce_metrics else {}

    def reduce_metrics(self, evaluate: bool = False) -> dict:
        """Collective: log the steps since the last call (see StepTotals) and return the newest one's metrics; with
        `evaluate`, the eval metrics of the weights now (after the reduction, so that tokens/s leaves eval out)."""
        rows = self.totals.reduce()
        if evaluate:
            rows[-1].update(self.evaluator.run(self.model))
        for row in rows if self.writes() else ():
            self.log.step(row["step"], {k: v for k, v in row.items() if k not in ("step", "time")}, at=row["time"])
        return {k: v for k, v in rows[-1].items() if k not in ("step", "time")} if rows else {}
