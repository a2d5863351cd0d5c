"""AdamW with its weight-decay groups, a linear-warmup + cosine-decay learning-rate schedule, and the loss scaler
(fp16)."""

from __future__ import annotations

import math
import re

import torch
from torch import nn
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from raysft.config import ParallelConfig, TrainLoopConfig
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


def lr_factor(step: int, cfg: TrainLoopConfig) -> float:
    """Multiplier of cfg.lr for optimizer step `step` (0-based). Warmup gives step s (s + 1) / warmup_steps, so the
    first step learns and the last warmup step reaches lr; transformers' get_cosine_schedule_with_warmup gives it
    s / warmup_steps (its first step runs at 0)."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainLoopConfig) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, cfg))


def build_loss_scaler(cfg: ParallelConfig, device: torch.device) -> ShardedGradScaler:
    """Dynamic loss scaling for fp16 (its 5-bit exponent underflows small gradients); a pass-through otherwise.
    The sharded scaler all-reduces the overflow flag, so every rank skips the same steps."""
    return ShardedGradScaler(device=device.type, init_scale=cfg.fp16_init_scale,
                             enabled=cfg.mixed_precision == "fp16")
