"""AdamW with its weight-decay groups, a linear-warmup + cosine-decay learning-rate schedule, and the loss scaler
(fp16).

The schedule's length is train.schedule_steps, by default train.max_steps. Training a finished run further means
continuing it, not starting it over: Megatron-LM keeps a checkpoint's schedule settings and refuses a resume whose
arguments disagree unless told which to use, and the Hugging Face Trainer lays a new schedule out when
num_train_epochs grows, so its LR jumps. raysft records the schedule's length in the checkpoint (WarmupCosine's
state) and refuses a resume whose length changed only because max_steps (or num_epochs) did: the LR would jump at
once (check_lr_continues). The user says which they mean: schedule_steps at the old length goes on from the
schedule's end at its final LR, min_lr_ratio × lr, which the LR had nearly reached (a cosine ends flat), so the
continued steps take small steps from where the run ended, as a decayed run should; schedule_steps at the new length
lays the schedule out again, knowingly. A new warmup and schedule from the weights is a new run with model.path the
run's export (docs/RUNS.md, "Train further").
"""

from __future__ import annotations

import math
import re

import torch
from torch import nn
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from raysft.config import ConfigError, ParallelConfig, TrainLoopConfig
from raysft.model.seeded_init import clean_name


def build_optimizer(model: nn.Module, cfg: TrainLoopConfig) -> torch.optim.Optimizer:
    """AdamW over param_groups; on a GPU its fused kernel (one launch for all parameters, elementwise like the
    others, so still deterministic): the default foreach kernels launch many small kernels per step (their cost:
    docs/BENCHMARKS.md)."""
    groups = param_groups(model, cfg)
    fused = bool(groups) and groups[0]["params"][0].device.type == "cuda"
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay,
                             fused=fused or None)


def param_groups(model: nn.Module, cfg: TrainLoopConfig) -> list[dict]:
    """The trained parameters (LoRA: the adapters only) in two groups, those decayed and those that
    train.weight_decay_exclude leaves out (weight decay 0), in the order of model.parameters(); an empty group is
    left out. Whatever the groups, a checkpoint's optimizer state is by parameter name, so a resume regroups it."""
    excluded = [re.compile(pattern) for pattern in cfg.weight_decay_exclude]
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            skip = any(p.search(clean_name(name).lower()) for p in excluded)
            (no_decay if skip else decay).append(param)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def schedule_length(cfg: TrainLoopConfig) -> int:
    """The step at which the cosine reaches min_lr_ratio × lr: train.schedule_steps, else train.max_steps."""
    return cfg.schedule_steps or cfg.max_steps


def lr_factor(step: int, cfg: TrainLoopConfig, length: int | None = None) -> float:
    """Multiplier of cfg.lr for optimizer step `step` (0-based), on a schedule of `length` steps (default:
    schedule_length), after which it stays at min_lr_ratio. Warmup gives step s (s + 1) / warmup_steps, so the
    first step learns and the last warmup step reaches lr; transformers' get_cosine_schedule_with_warmup gives it
    s / warmup_steps (its first step runs at 0)."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, (length or schedule_length(cfg)) - cfg.warmup_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine


class WarmupCosine(torch.optim.lr_scheduler.LambdaLR):
    """lr_factor as a scheduler whose state (a checkpoint's trainer_state.json) records the schedule's length; a
    restored one keeps this launch's length and tells the one it was saved on (`resumed_length`: None for a
    checkpoint that recorded none) to check_lr_continues."""

    def __init__(self, optimizer: torch.optim.Optimizer, cfg: TrainLoopConfig):
        self.length, self.resumed_length = schedule_length(cfg), None
        super().__init__(optimizer, lambda step: lr_factor(step, cfg))

    def state_dict(self) -> dict:
        return {k: v for k, v in super().state_dict().items() if k != "resumed_length"}

    def load_state_dict(self, state_dict: dict) -> None:
        length, saved = self.length, state_dict.get("length")
        super().load_state_dict(state_dict)
        self.length, self.resumed_length = length, saved if isinstance(saved, int) else None


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainLoopConfig) -> WarmupCosine:
    return WarmupCosine(optimizer, cfg)


def check_lr_continues(scheduler: WarmupCosine, cfg: TrainLoopConfig, step: int) -> None:
    """Refuse (ConfigError) a resume at `step` that would make the LR jump because the schedule's length changed
    with train.max_steps or train.num_epochs: raising max_steps to train a finished run on lays the cosine out
    again, and the LR jumps back up towards its peak. A set train.schedule_steps is the user's choice of length
    and passes; so does a launch with nothing left to train, or a change the LR at `step` does not see (warmup)."""
    old, new = scheduler.resumed_length, scheduler.length
    if old is None or old == new or cfg.schedule_steps or step >= cfg.max_steps:
        return
    was, now = cfg.lr * lr_factor(step, cfg, old), cfg.lr * lr_factor(step, cfg, new)
    if math.isclose(was, now, rel_tol=1e-9):
        return
    raise ConfigError(
        f"config key 'train.max_steps': this launch lays the LR schedule out over {new} steps, but the run's "
        f"checkpoint of step {step} is on one of {old}: the LR would jump from {was:.3g} to {now:.3g} at step "
        f"{step + 1}. To train on from the end of the run's schedule at its final LR, set train.schedule_steps="
        f"{old}; to lay the schedule out again over {new} steps, set train.schedule_steps={new} "
        "(docs/RUNS.md, \"Train further\")")


def build_loss_scaler(cfg: ParallelConfig, device: torch.device) -> ShardedGradScaler:
    """Dynamic loss scaling for fp16 (its 5-bit exponent underflows small gradients); a pass-through otherwise.
    The sharded scaler all-reduces the overflow flag, so every rank skips the same steps."""
    return ShardedGradScaler(device=device.type, init_scale=cfg.fp16_init_scale,
                             enabled=cfg.mixed_precision == "fp16")
