"""AdamW, a linear-warmup + cosine-decay learning-rate schedule, and the loss scaler (fp16)."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from raysft.config import ParallelConfig, TrainLoopConfig


def build_optimizer(model: nn.Module, cfg: TrainLoopConfig) -> torch.optim.Optimizer:
    """AdamW; on a GPU its fused kernel (one launch for all parameters, elementwise like the others, so still
    deterministic): the default foreach kernels launch many small kernels per step (their cost: docs/BENCHMARKS.md)."""
    params = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapters only
    fused = bool(params) and params[0].device.type == "cuda"
    return torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay,
                             fused=fused or None)


def lr_factor(step: int, cfg: TrainLoopConfig) -> float:
    """Multiplier of cfg.lr for optimizer step `step` (0-based)."""
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
