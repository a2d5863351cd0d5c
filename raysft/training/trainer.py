"""The training loop that runs on every worker. It needs torch.distributed, not Ray: Ray is plugged in through the
checkpoint `sink` (progress and checkpoints, raysft.checkpoint) and `resume_dir` (the checkpoint to continue
from)."""

from __future__ import annotations

import os
import socket
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from raysft.checkpoint import Checkpointer, Sink, TrainingObjects, TrainState, find_resume_dir
from raysft.checkpoint.discovery import read_run_id, read_set_aside, step_of
from raysft.checkpoint.memory import MemoryTier
from raysft.config import TrainConfig
from raysft.data.dataloader import (
    DataCursor,
    GlobalBatchSampler,
    TokenizedDataset,
    collate,
    micro_batches,
    sample_lengths,
    to_device,
)
from raysft.data.tokenizer import load_tokenizer
from raysft.model.build import (
    build_meta_model,
    load_initial_weights,
    load_model_config,
    materialize,
    tied_parameter_aliases,
)
from raysft.model.lora import add_adapters, record
from raysft.model.loss import install_chunked_loss, micro_batch_loss_sum
from raysft.model.preference_loss import disable_dropout, install_sequence_nll
from raysft.parallel.collectives import all_ranks, from_rank0
from raysft.parallel.fsdp import parallelize
from raysft.parallel.layout import ParallelDims, gather_nodes
from raysft.parallel.sequence import model_batch
from raysft.training.evaluation import Evaluator
from raysft.training.gen_log import GenEvalLog
from raysft.training.metrics import (
    MetricsLogger,
    StepTotals,
    matmul_parameters,
    peak_memory_gb,
    peak_tflops,
    training_flops,
)
from raysft.training.optim import build_loss_scaler, build_lr_scheduler, build_optimizer
from raysft.training.preference import PreferenceStep
from raysft.training.preference_eval import PreferenceEvaluator
from raysft.training.reference import compute_reference, read_reference, reference_file, write_reference
from raysft.training.step_guard import StepGuard


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
                   eval_store: Path | None = None, stop_requested: Callable[[], bool] = lambda: False) -> Trainer:
    """Collective: a Trainer that continues from the run's newest complete checkpoint (a fresh one if none)."""
    resume_dir, skipped = find_resume_dir(cfg.run_dir)
    trainer = Trainer(cfg, store, resume_dir, sink, ctx, preemption_deadline, eval_store, stop_requested)
    for path, reason in skipped:
        trainer.log.event("skipped_incomplete_checkpoint", checkpoint=path, reason=reason)
    return trainer


class Trainer:
    """Builds the sharded model, optimizer and data on this worker; `train()` runs to cfg.train.max_steps.

    `preemption_deadline` and `stop_requested` go to the Checkpointer, which decides when to save on them (see
    raysft.checkpoint.checkpointer.Checkpointer); after the save of a stop request, `train()` returns.
    """

    def __init__(self, cfg: TrainConfig, store: Path, resume_dir: Path | None, sink: Sink,
                 ctx: WorkerContext, preemption_deadline: Callable[[], float | None] = lambda: None,
                 eval_store: Path | None = None, stop_requested: Callable[[], bool] = lambda: False):
        self.cfg, self.ctx = cfg, ctx
        self.sink, self.resume_dir = sink, resume_dir
        self.stopped = False  # by a stop request, at self.state.step, with a checkpoint of that step
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
        dpo = t.objective == "dpo"
        if dpo:
            install_sequence_nll(self.model, t.loss_chunk_tokens)
            if cfg.dpo.disable_dropout:
                disable_dropout(self.model)
        elif t.loss_chunk_tokens:
            install_chunked_loss(self.model, t.loss_chunk_tokens)
        self.optimizer = build_optimizer(self.model, t)
        self.scheduler = build_lr_scheduler(self.optimizer, t)
        self.scaler = build_loss_scaler(cfg.parallel, ctx.device)
        self.guard = StepGuard(t)
        self.objs = TrainingObjects(self.model, self.optimizer, self.scheduler, self.scaler, self.hf_config,
                                    self.tokenizer, self.aliases, self.guard, lora=record(cfg))
        self.log = MetricsLogger(cfg.run_dir if ctx.rank == 0 else None, t.max_steps, t.log_every_n_steps)
        self.totals = StepTotals(ctx.device, self.peak_tflops)
        self.checkpointer = Checkpointer(cfg.checkpoint, self.objs, self.sink, self.log, ctx.rank, ctx.device,
                                         preemption_deadline, stop_requested)
        self.dataset = TokenizedDataset(store)
        self.memory = self._memory_tier() if cfg.checkpoint.memory_every_n_steps else None
        snapshot = self.memory.find(step_of(resume_dir) if resume_dir else None, self.dims) if self.memory else None
        resuming = resume_dir is not None or snapshot is not None
        reference = reference_file(store, cfg) if dpo and not cfg.model.lora.r else None
        eval_reference = reference_file(eval_store, cfg) if dpo and eval_store and not cfg.model.lora.r else None
        # the reference pass needs the starting weights, also on a resume that finds no reference file
        missing_reference = reference is not None and not all_ranks(reference.is_file())
        missing_eval_reference = eval_reference is not None and not all_ranks(eval_reference.is_file())
        if not resuming or cfg.model.lora.r or missing_reference or missing_eval_reference:  # LoRA: adapters only
            fallback = load_initial_weights(self.model, cfg.model, self.hf_config, t.seed)
            if fallback:  # pretrained weights through rank 0's memory: say why, where the run's events are
                self.log.event("weights_from_rank0", path=cfg.model.path, reason=fallback)
        self.preference = None
        if dpo:
            self.preference = PreferenceStep(cfg, self.dataset, self._reference(reference, missing_reference),
                                             self.shard.dp_rank, self.shard.dp_size, ctx.device,
                                             self.tokenizer.pad_token_id)
        eval_logps = self._reference(eval_reference, missing_eval_reference, TokenizedDataset(eval_store)) \
            if eval_reference else None  # before a checkpoint replaces the starting weights
        if snapshot is not None:
            self.state, held = self.memory.restore(snapshot)
            self.totals.rows = [(start, host, values.to(ctx.device)) for start, host, values in held]
            self.log.event("resume", step=self.state.step, tier="memory", world_size=ctx.world_size)
        elif resume_dir is not None:
            self.state = self.checkpointer.load(resume_dir)
            self.log.event("resume", step=self.state.step, checkpoint=str(resume_dir), world_size=ctx.world_size)
        else:
            self.state = TrainState(step=0, cursor=DataCursor(seed=t.seed))
            self.log.event("start", world_size=ctx.world_size, checkpoint_mode=self.checkpointer.mode)
        self.log.open_trackers(cfg, self.state.step if resuming else None)
        self.evaluator = None
        if eval_store and dpo:
            self.evaluator = PreferenceEvaluator(eval_store, cfg, eval_logps, self.shard.dp_rank, self.shard.dp_size,
                                                 ctx.device, self.tokenizer.pad_token_id)
        elif eval_store:
            self.evaluator = Evaluator(eval_store, cfg, self.shard, ctx.device, self.tokenizer.pad_token_id)
        # rank 0 logs the generation evaluations of the checkpoints as they end (raysft.training.gen_log)
        self.gen_log = GenEvalLog(cfg.run_dir, self.log) if cfg.eval.path and ctx.rank == 0 else None
        self.fresh = not resuming
        num_samples = self.preference.num_pairs if self.preference else len(self.dataset)
        self.sampler = GlobalBatchSampler(num_samples, t.global_batch_size, self.state.cursor)

    def _reference(self, path: Path | None, missing: bool,
                   dataset: TokenizedDataset | None = None) -> torch.Tensor | None:
        """Collective when `missing`: the reference log-probabilities of every row of the store (the training one, or
        `dataset`'s), computed by a pass of the starting model and written beside the store; else read from there
        (None with LoRA: adapters off)."""
        if path is None:
            return None
        dataset = dataset or self.dataset
        if missing:
            start = time.perf_counter()
            logps = compute_reference(self.model, dataset, self.cfg, self.shard, self.ctx.device,
                                      self.tokenizer.pad_token_id)
            if self.ctx.rank == 0:
                write_reference(path, logps, path.parent.parent, self.cfg)
            torch.distributed.barrier()
            self.log.event("reference_logps", file=str(path), rows=len(logps),
                           seconds=round(time.perf_counter() - start, 3))
            return logps
        self.log.event("reference_logps", file=str(path), reused=True)
        return read_reference(path, len(dataset))

    def _memory_tier(self) -> MemoryTier:
        """Collective: the memory tier of this run on this worker's node (raysft.checkpoint.memory)."""
        cfg = self.cfg
        run_id, set_aside = from_rank0(lambda: (read_run_id(cfg.run_dir), read_set_aside(cfg.run_dir)))
        return MemoryTier(self.objs, cfg.checkpoint, run_id, self.dims, cfg.parallel.sharding, self.ctx.device,
                          self.log, set_aside)

    def train(self) -> dict:
        t = self.cfg.train
        self.model.train()
        metrics: dict = {}
        stop = t.stop_at_step or t.max_steps  # stop_at_step ends this launch early; the schedule stays max_steps'
        self.checkpointer.start_notice_checks(self.state.step)
        if self.cfg.eval.path and self.cfg.eval.at_start and self.fresh:  # the base, evaluated as every checkpoint
            self.checkpointer.save(self.state, {})
        while self.state.step < stop:
            step_start = time.perf_counter()
            self.train_step(reduce_metrics=False)
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
            if due.save or report or evaluate or step % t.log_every_n_steps == 0:  # the same steps on every rank
                metrics = self.reduce_metrics(evaluate)
            self.state.eval_loss = metrics.get("eval_loss") if evaluate else None
            self.state.eval_metrics = {k: v for k, v in metrics.items() if k.startswith("eval/")} if evaluate else None
            if due.save:
                self.checkpointer.save(self.state, metrics, urgent=due.urgent)
            elif report:
                self.sink.report({**metrics, "step": step}, step)
            if self.memory is not None:
                self.memory.snapshot(self.state, self.totals.rows)
            if self.stopped:
                self.log.event("stopped", step=step, reason="SIGTERM", hint="launch again to continue")
                break
            self.checkpointer.poll(step)
            if self.gen_log is not None:
                self.gen_log.poll()
        self.checkpointer.finish(self.state.step)
        if self.memory is not None:  # ended by the launch itself: the stored checkpoint is the newest
            self.memory.close(remove=True)
        if self.state.step < t.max_steps and not self.stopped:
            self.log.event("stop", step=self.state.step, max_steps=t.max_steps,
                           hint="launch again without train.stop_at_step to continue")
        if self.gen_log is not None:  # what ended by now (under torchrun: every evaluation of this launch)
            self.gen_log.poll(now=True)
        self.log.close()
        return {**metrics, "step": self.state.step}

    def train_step(self, reduce_metrics: bool = True) -> dict:
        """One optimizer step over one global batch: forward/backward per micro-batch, clip, step unless the step
        guard skips it on every rank (raysft.training.step_guard: its decision is the step's one wait for the
        device); the metrics are kept until `reduce_metrics` (now, by default)."""
        ctx = self.ctx
        start = time.time()
        global_batch = self.sampler.next_batch()
        if self.preference is not None:
            pairs = self.preference.forward_backward(
                self.model, global_batch, lambda loss: self.scaler.scale(loss * ctx.world_size).backward())
            return self._optimizer_step(start, pairs.loss, 1, pairs.lengths, pairs.computed_tokens, reduce_metrics,
                                        pairs.metrics, len(global_batch))
        # Normalize by the assistant tokens of the whole global batch, so the gradient is the same for any
        # split into workers, micro-batches and sequence slices (FSDP averages gradients over every worker,
        # sequence groups included: hence × world size).
        loss_tokens = max(1, int(self.dataset.num_loss_tokens[global_batch].sum()))
        loss_sum = torch.zeros((), device=ctx.device)
        lengths: list[int] = []
        computed = 0
        for batch, sizes, last in self._micro_batches(global_batch):
            lengths += sizes
            computed += batch["input_ids"].numel()
            self.model.set_requires_gradient_sync(last)  # reduce once per optimizer step
            ce = micro_batch_loss_sum(self.model, batch)
            self.scaler.scale(ce * ctx.world_size / loss_tokens).backward()
            loss_sum += ce.detach()
        return self._optimizer_step(start, loss_sum, loss_tokens, lengths, computed, reduce_metrics)

    def _optimizer_step(self, start: float, loss_sum: torch.Tensor, loss_tokens: int, lengths: list[int],
                        computed: int, reduce_metrics: bool, pair_means: dict | None = None, pairs: int = 0) -> dict:
        """Clip, step unless the step guard skips it, and keep the step's metrics. The step's loss is `loss_sum`
        summed over the ranks / `loss_tokens` (DPO: the ranks' shares of the mean, / 1)."""
        t, ctx = self.cfg.train, self.ctx
        loss_scale = self.scaler.get_scale() if self.scaler.is_enabled() else None
        with warnings.catch_warnings():  # the scaler's found-inf flag meets DTensor grads: harmless notice
            warnings.filterwarnings("ignore", message="Found a non-scalar tensor with numel=1")
            self.scaler.unscale_(self.optimizer)  # true gradients before clipping (a no-op unless fp16)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), t.grad_clip)
        if isinstance(grad_norm, DTensor):
            grad_norm = grad_norm.full_tensor()
        lr = self.scheduler.get_last_lr()[0]
        skip = self.guard.check(self.state.step + 1, loss_sum, loss_tokens, grad_norm)  # collective
        if skip is None:
            self.scaler.step(self.optimizer)  # (fp16 overflows are non-finite gradient norms: skipped above)
            self.scheduler.step()
        self.scaler.update()  # fp16: an overflow halves the loss scale
        self.optimizer.zero_grad(set_to_none=True)
        self.state.step += 1
        self.state.skipped_steps += skip is not None

        c = self.hf_config
        host = {"step": self.state.step, "loss_tokens": loss_tokens, "lr": lr, "epoch": self.state.cursor.epoch,
                "tokens": sum(lengths), "computed_tokens": computed, "peak_mem_gb": peak_memory_gb(ctx.device),
                "flops": training_flops(lengths, self.matmul_params, c.num_hidden_layers, c.hidden_size)}
        host.update(skipped=skip is not None, skipped_steps=self.state.skipped_steps)
        if self.memory is not None:  # snapshots passed over so far (raysft.checkpoint.memory: never silent)
            host["memory_snapshots_skipped"] = self.memory.skipped
        if loss_scale is not None:
            host["loss_scale"] = loss_scale
        if skip:
            host["skip_reason"] = skip
            self.log.event("skipped_step", step=self.state.step, reason=skip)
        if pair_means:
            host["pairs"] = pairs
        self.totals.add(start, {"loss_sum": loss_sum, "grad_norm": grad_norm}, host, pair_means)
        return self.reduce_metrics() if reduce_metrics else {}

    def _micro_batches(self, global_batch):
        """This rank's micro-batches on the device, each with its samples' lengths and whether it is the last.
        Each is collated (and, on CUDA, pinned and copied without blocking) while the device still runs the
        previous one's backward. The workers of a sequence group take the same samples, each its own slice of
        them; the group's first counts their lengths in the metrics."""
        t, ctx, shard = self.cfg.train, self.ctx, self.shard
        parts = micro_batches(global_batch, self.dataset.num_tokens, shard.dp_rank, shard.dp_size,
                              t.micro_batch_size, t.micro_batch_tokens)
        for i, indices in enumerate(parts):
            batch = collate(self.dataset, indices, self.tokenizer.pad_token_id, self.cfg.data.packing)
            sizes = sample_lengths(batch) if shard.sp_rank == 0 else []
            batch = model_batch(batch, shard, self.tokenizer.pad_token_id, bool(t.loss_chunk_tokens))
            yield to_device(batch, ctx.device), sizes, i == len(parts) - 1

    def reduce_metrics(self, evaluate: bool = False) -> dict:
        """Collective: log the steps since the last call (see StepTotals) and return the newest one's metrics; with
        `evaluate`, the eval metrics of the weights now (after the reduction, so that tokens/s leaves eval out)."""
        rows = self.totals.reduce()
        if evaluate:
            rows[-1].update(self.evaluator.run(self.model))
        for row in rows:
            self.log.step(row["step"], {k: v for k, v in row.items() if k not in ("step", "time")}, at=row["time"])
        return {k: v for k, v in rows[-1].items() if k not in ("step", "time")} if rows else {}
