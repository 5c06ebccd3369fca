"""The optimizer and learning-rate schedule of a trained model: AdamW, warmup then constant,
cosine or linear decay, stepped once per optimizer step."""

from __future__ import annotations

import math
import warnings

import torch
from torch import nn

__all__ = ["LR_SCHEDULES", "build_optimizer", "build_scheduler", "lr_factor", "resume_schedule", "step_scheduler"]

LR_SCHEDULES = ("constant", "cosine", "linear")


def build_optimizer(model: nn.Module, *, lr: float, weight_decay: float,
                    betas: tuple[float, float]) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices only (biases and norm scales are not decayed)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=tuple(betas))


def lr_factor(step: int, *, warmup_steps: int, total_steps: int | None, lr_schedule: str,
              min_lr_ratio: float) -> float:
    """Multiplier of the peak lr at scheduler step `step` (0-based).

    Linear warmup `(step + 1) / warmup_steps` (the first step already learns), then
    constant, or a cosine / linear decay from 1 to `min_lr_ratio` at `total_steps`.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if lr_schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    decay = 0.5 * (1.0 + math.cos(math.pi * progress)) if lr_schedule == "cosine" else 1.0 - progress
    return min_lr_ratio + (1.0 - min_lr_ratio) * decay


def step_scheduler(scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
    """Advance the schedule by one optimizer step (skipped steps count too: the schedule
    follows training progress, and `total_steps` stays aligned with the trainer)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*lr_scheduler.step.*before.*optimizer.step", category=UserWarning)
        scheduler.step()


def build_scheduler(optimizer: torch.optim.Optimizer, *, warmup_steps: int, total_steps: int | None,
                    lr_schedule: str, min_lr_ratio: float) -> torch.optim.lr_scheduler.LambdaLR:
    if lr_schedule not in LR_SCHEDULES:
        raise ValueError(f"unknown lr_schedule {lr_schedule!r}; valid: {', '.join(LR_SCHEDULES)}")
    if lr_schedule != "constant" and not total_steps:
        raise ValueError(f"lr_schedule={lr_schedule!r} needs total_steps")

    def factor(step: int) -> float:
        return lr_factor(step, warmup_steps=warmup_steps, total_steps=total_steps,
                         lr_schedule=lr_schedule, min_lr_ratio=min_lr_ratio)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def resume_schedule(optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LambdaLR) -> None:
    """After loading a checkpoint: set each group's lr to this schedule's value at the loaded step.

    The optimizer's state holds the lr the checkpoint's schedule set for the next step; a resume
    with another `total_steps` (docs/guarantees.md, resume policy) must take the next step's lr
    from the stretched schedule, as every later step does.
    """
    for group, base_lr, factor in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base_lr * factor(scheduler.last_epoch)
