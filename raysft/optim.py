"""AdamW and a linear-warmup + cosine-decay learning-rate schedule."""

from __future__ import annotations

import math

import torch
from torch import nn

from raysft.config import TrainLoopConfig


def build_optimizer(model: nn.Module, cfg: TrainLoopConfig) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapters only
    return torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)


def lr_factor(step: int, cfg: TrainLoopConfig) -> float:
    """Multiplier of cfg.lr for optimizer step `step` (0-based)."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainLoopConfig) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, cfg))
