"""Group-relative advantages (GRPO): each reward minus its group's mean."""

from __future__ import annotations

from typing import Literal

import torch

EPS = 1e-6


def group_advantages(
    rewards: torch.Tensor, *, scale: Literal["none", "std"] = "none", eps: float = EPS
) -> torch.Tensor:
    """``rewards  # [num_groups, group_size]`` -> advantages of the same shape.

    Mean-centred within each group; with ``scale="std"`` divided by the group's population
    standard deviation plus ``eps`` (a group whose rewards are all equal gets zeros).
    """
    if rewards.dim() != 2:
        raise ValueError(
            f"rewards must be [num_groups, group_size], got shape {tuple(rewards.shape)}"
        )
    if scale not in ("none", "std"):
        raise ValueError(f"scale must be 'none' or 'std', got {scale!r}")
    rewards = rewards.to(torch.float32)
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if scale == "std":
        centred = centred / (rewards.std(dim=1, keepdim=True, correction=0) + eps)
    return centred
