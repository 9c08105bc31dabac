"""Policy-gradient losses over token log-probs, with off-policy corrections.

Shapes: ``logprobs``, ``behaviour_logprobs``, ``proximal_logprobs`` and ``mask`` are
``[batch, seq]``; ``advantages`` is ``[batch]`` (broadcast over tokens) or ``[batch, seq]``.

- ``pg``: plain policy gradient, loss = -log pi_theta * A, with no importance weight: the
  "no correction" baseline, which treats every rollout as if the current policy made it.
- ``grpo``: PPO-clip on the ratio r = pi_theta / mu (mu = behaviour policy).
- ``aipo``: LlamaRL's AIPO at token level, loss = -min(r, delta) * A. The gradient flows
  through r where r < delta and is zero where it is truncated.
- ``tis``: PPO-clip on pi_theta / pi_prox, times the truncated importance weight
  min(pi_prox / mu, delta), which carries no gradient. ``proximal_logprobs`` default to the
  detached current log-probs (one optimizer step per batch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

LossKind = Literal["pg", "grpo", "aipo", "tis"]


@dataclass
class LossStats:
    clip_fraction: float  # fraction of tokens whose ratio was clipped/truncated
    ratio_mean: float  # mean of pi_theta / mu over tokens
    ratio_max: float
    weight_mean: float  # mean of the importance weight actually applied


def _aggregate(per_token: torch.Tensor, mask: torch.Tensor, aggregation: str) -> torch.Tensor:
    if aggregation == "token":
        return (per_token * mask).sum() / mask.sum().clamp(min=1)
    if aggregation == "sequence":
        tokens = mask.sum(dim=1)
        keep = tokens > 0
        per_seq = (per_token * mask).sum(dim=1)[keep] / tokens[keep]
        return per_seq.mean() if per_seq.numel() else per_token.sum() * 0
    raise ValueError(f"aggregation must be 'token' or 'sequence', got {aggregation!r}")


def _ppo_clip(
    ratio: torch.Tensor, adv: torch.Tensor, clip_eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    unclipped = ratio * adv
    clipped = ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv
    return -torch.minimum(unclipped, clipped), (clipped < unclipped)


def policy_loss_with_stats(
    kind: LossKind,
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    proximal_logprobs: torch.Tensor | None = None,
    clip_eps: float = 0.2,
    delta: float = 2.0,
    aggregation: Literal["token", "sequence"] = "token",
) -> tuple[torch.Tensor, LossStats]:
    """The scalar loss and statistics over the unmasked tokens."""
    if logprobs.shape != behaviour_logprobs.shape or logprobs.shape != mask.shape:
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)}, behaviour_logprobs {tuple(behaviour_logprobs.shape)} "
            f"and mask {tuple(mask.shape)} must have the same [batch, seq] shape"
        )
    adv = advantages.unsqueeze(1).expand_as(logprobs) if advantages.dim() == 1 else advantages
    mask = mask.to(logprobs.dtype)
    ratio = torch.exp(logprobs - behaviour_logprobs)
    if kind == "pg":
        per_token, clipped = -logprobs * adv, torch.zeros_like(mask, dtype=torch.bool)
        weight = torch.ones_like(ratio)
    elif kind == "grpo":
        per_token, clipped = _ppo_clip(ratio, adv, clip_eps)
        weight = ratio.detach()
    elif kind == "aipo":
        weight = ratio.clamp(max=delta)
        per_token, clipped = -weight * adv, ratio.detach() > delta
        weight = weight.detach()
    elif kind == "tis":
        prox = logprobs.detach() if proximal_logprobs is None else proximal_logprobs
        weight = torch.exp(prox - behaviour_logprobs).clamp(max=delta).detach()
        ppo, clipped = _ppo_clip(torch.exp(logprobs - prox), adv, clip_eps)
        per_token = weight * ppo
    else:
        raise ValueError(f"unknown policy loss {kind!r}; expected 'pg', 'grpo', 'aipo' or 'tis'")
    loss = _aggregate(per_token, mask, aggregation)
    with torch.no_grad():
        n = mask.sum().clamp(min=1)
        r = ratio.detach()
        stats = LossStats(
            clip_fraction=float((clipped.to(mask.dtype) * mask).sum() / n),
            ratio_mean=float((r * mask).sum() / n),
            ratio_max=float(r.masked_fill(mask == 0, float("-inf")).max()) if mask.any() else 0.0,
            weight_mean=float((weight * mask).sum() / n),
        )
    return loss, stats


def policy_loss(
    kind: LossKind,
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    proximal_logprobs: torch.Tensor | None = None,
    clip_eps: float = 0.2,
    delta: float = 2.0,
    aggregation: Literal["token", "sequence"] = "token",
) -> torch.Tensor:
    """The scalar policy loss (see the module docstring for the kinds)."""
    loss, _ = policy_loss_with_stats(
        kind,
        logprobs,
        behaviour_logprobs,
        advantages,
        mask,
        proximal_logprobs=proximal_logprobs,
        clip_eps=clip_eps,
        delta=delta,
        aggregation=aggregation,
    )
    return loss
