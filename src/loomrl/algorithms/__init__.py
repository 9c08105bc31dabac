"""Advantages and policy losses as pure functions over tensors."""

from loomrl.algorithms.advantages import group_advantages
from loomrl.algorithms.kl import kl_penalty
from loomrl.algorithms.losses import LossStats, policy_loss, policy_loss_with_stats

__all__ = ["LossStats", "group_advantages", "kl_penalty", "policy_loss", "policy_loss_with_stats"]
