"""Optimizers and learning-rate schedules from the ``optim`` section."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch.optim.lr_scheduler import LambdaLR

from vatra.config import OptimConfig


def build_optimizer(params: Iterable[torch.nn.Parameter], cfg: OptimConfig) -> torch.optim.Optimizer:
    """The section's optimizer. Adam and AdamW use torch's fused kernels when every parameter is a
    plain CUDA tensor (one kernel per step instead of several per parameter group); otherwise, and
    for sharded (DTensor) parameters, torch's default implementation."""
    params = list(params)
    if cfg.name == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    fused = bool(params) and all(p.is_cuda and type(p) is torch.nn.Parameter for p in params)
    if cfg.name == "adam":
        return torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=fused or None)
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=fused or None)


def lr_factor(step: int, total_steps: int, cfg: OptimConfig) -> float:
    """Multiplier of ``cfg.lr`` at ``step`` (0-based): linear warm-up, then constant or cosine."""
    if step < cfg.warmup_steps:
        return (step + 1) / (cfg.warmup_steps + 1)
    if cfg.schedule == "constant":
        return 1.0
    decay_steps = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine


def build_scheduler(opt: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int) -> LambdaLR:
    return LambdaLR(opt, lambda step: lr_factor(step, total_steps, cfg))
