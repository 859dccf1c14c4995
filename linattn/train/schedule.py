"""Learning-rate schedule: linear warmup then cosine decay."""

from __future__ import annotations

import math

import torch


def warmup_cosine(step: int, warmup_steps: int, max_steps: int, min_ratio: float) -> float:
    """Multiplier of the base lr at ``step``: (step+1)/warmup during warmup, then
    min_ratio + (1 - min_ratio) * (1 + cos(pi * p)) / 2 with p the fraction of the decay done."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    decay = max(1, max_steps - warmup_steps)
    p = min(1.0, (step - warmup_steps) / decay)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * p))


def make_scheduler(optimizer: torch.optim.Optimizer, warmup_steps: int, max_steps: int,
                   min_ratio: float, start_step: int = 0) -> torch.optim.lr_scheduler.LambdaLR:
    """The warmup + cosine schedule of ``optimizer``, positioned at ``start_step`` (a resumed run whose
    schedule changed restarts it there; the groups' ``initial_lr`` must then be set)."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: warmup_cosine(s, warmup_steps, max_steps, min_ratio), last_epoch=start_step - 1)
