"""The job's optimizer and schedule keys set on a restored optimizer and scheduler (a
resume with ``trainer.lr=...``; docs/runs.md, "What an override applies to")."""

from __future__ import annotations

import torch

from loomrl.training.config import TrainerConfig


def apply_optimizer_config(
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LambdaLR,
    cfg: TrainerConfig,
) -> None:
    """Set the job's optimizer and schedule keys on a restored optimizer and scheduler: a
    resumed run trains with ``trainer.lr``, ``betas``, ``weight_decay``, ``lr_schedule``,
    ``warmup_steps`` and ``num_steps`` as its config says now, not as the checkpoint saved
    them (their state, the AdamW moments and the step count, is kept). With the config the
    run was saved with, every value is what the checkpoint held, bit for bit."""
    scheduler.base_lrs = [cfg.lr for _ in optimizer.param_groups]
    lrs = [
        base * fn(scheduler.last_epoch)
        for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)
    ]
    for group, lr in zip(optimizer.param_groups, lrs):
        group["initial_lr"] = cfg.lr
        group["lr"] = lr
        group["betas"] = tuple(cfg.betas)
        group["weight_decay"] = cfg.weight_decay
    scheduler._last_lr = lrs
