"""Policy-gradient losses over token log-probs, with off-policy corrections.

Shapes: ``logprobs``, ``behaviour_logprobs``, ``proximal_logprobs`` and ``mask`` are
``[batch, seq]``; ``advantages`` is ``[batch]`` (broadcast over tokens) or ``[batch, seq]``.
Below ``r_t = pi_theta(y_t) / mu(y_t)`` is the token ratio to the behaviour policy ``mu``
(each token's own: a rollout whose weights changed mid-sequence carries, per token, the
log-prob of the weights that sampled it), ``A`` the advantage, and ``clip(r) = clamp(r,
1 - eps_low, 1 + eps_high)`` with ``eps_low``/``eps_high`` the decoupled clip range of DAPO
(arXiv 2503.14476, "clip-higher"); both default to ``clip_eps``, which is the symmetric
PPO clip bit for bit.

- ``pg``: plain policy gradient, loss = -log pi_theta * A, with no importance weight: the
  "no correction" baseline, which treats every rollout as if the current policy made it.
- ``grpo``: PPO-clip on the ratio, per token -min(r_t A, clip(r_t) A).
- ``aipo``: LlamaRL's AIPO at token level, loss = -min(r, delta) * A. The gradient flows
  through r where r < delta and is zero where it is truncated.
- ``tis``: PPO-clip on pi_theta / pi_prox, times the truncated importance weight
  min(pi_prox / mu, delta), which carries no gradient. ``proximal_logprobs`` default to the
  detached current log-probs (one optimizer step per batch).
- ``dr_grpo``: Dr. GRPO (arXiv 2503.20783): ``grpo``'s per-token term, summed over each
  sequence's tokens and divided by a constant ``length_divisor`` (the maximum completion
  length) instead of the sequence's own length, then averaged over sequences:
  loss = -1/(G L) sum_i sum_t min(r_it A_i, clip(r_it) A_i). With advantages that are not
  divided by the group's std (the other half of the paper), no term favours short wrong
  answers or long right ones.
- ``gspo``: GSPO (arXiv 2507.18071): one importance ratio per sequence, the geometric mean
  of its token ratios, s_i = exp(1/|y_i| sum_t log r_it), clipped per sequence:
  loss_i = -min(s_i A_i, clip(s_i) A_i), on every token of sequence i (``aggregation =
  "sequence"`` is the paper's 1/G sum_i; ``"token"`` weighs sequences by length). Its
  gradient is s_i A_i / |y_i| sum_t grad log pi(y_it) where unclipped. The paper's clip
  range is far narrower than a token ratio's (eps_low 3e-4, eps_high 4e-4).
- ``cispo``: CISPO (MiniMax-M1, arXiv 2506.13585): REINFORCE with a clipped importance
  weight that carries no gradient, loss = -sg(min(r_t, delta)) A log pi_theta(y_t). Where
  ``grpo`` and ``aipo`` drop a clipped token's gradient altogether, here every token keeps
  its gradient sg(w) A grad log pi; only its weight is capped (the paper leaves the lower
  bound open and caps at 1 + eps_high^IS: ``delta`` here, as for ``aipo`` and ``tis``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

LossKind = Literal["pg", "grpo", "aipo", "tis", "dr_grpo", "gspo", "cispo"]
LOSS_KINDS: tuple[str, ...] = ("pg", "grpo", "aipo", "tis", "dr_grpo", "gspo", "cispo")


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
    ratio: torch.Tensor, adv: torch.Tensor, clip: tuple[float, float]
) -> tuple[torch.Tensor, torch.Tensor]:
    """-min(r A, clamp(r, 1 - low, 1 + high) A), and where the clipped term won."""
    unclipped = ratio * adv
    clipped = ratio.clamp(1 - clip[0], 1 + clip[1]) * adv
    return -torch.minimum(unclipped, clipped), (clipped < unclipped)


def sequence_ratio(
    logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """GSPO's length-normalised sequence ratio ``exp(mean_t log r_t)`` over each row's
    unmasked tokens, ``[batch, 1]`` (1 for a row with none)."""
    log_ratio = ((logprobs - behaviour_logprobs) * mask).sum(dim=1)
    return torch.exp(log_ratio / mask.sum(dim=1).clamp(min=1)).unsqueeze(1)


def _per_token(
    kind: str,
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    ratio: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    proximal_logprobs: torch.Tensor | None,
    clip: tuple[float, float],
    delta: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each token's loss term, where it was clipped or truncated, and the (detached)
    importance weight applied to it (the module docstring has the formulas)."""
    if kind == "pg":
        per_token, clipped = -logprobs * adv, torch.zeros_like(mask, dtype=torch.bool)
        weight = torch.ones_like(ratio)
    elif kind in ("grpo", "dr_grpo"):
        per_token, clipped = _ppo_clip(ratio, adv, clip)
        weight = ratio.detach()
    elif kind == "aipo":
        weight = ratio.clamp(max=delta)
        per_token, clipped = -weight * adv, ratio.detach() > delta
        weight = weight.detach()
    elif kind == "tis":
        prox = logprobs.detach() if proximal_logprobs is None else proximal_logprobs
        weight = torch.exp(prox - behaviour_logprobs).clamp(max=delta).detach()
        ppo, clipped = _ppo_clip(torch.exp(logprobs - prox), adv, clip)
        per_token = weight * ppo
    elif kind == "gspo":
        seq = sequence_ratio(logprobs, behaviour_logprobs, mask).expand_as(logprobs)
        per_token, clipped = _ppo_clip(seq, adv, clip)
        weight = seq.detach()
    elif kind == "cispo":
        weight = ratio.detach().clamp(max=delta)
        per_token, clipped = -weight * adv * logprobs, ratio.detach() > delta
    else:
        kinds = ", ".join(repr(k) for k in LOSS_KINDS)
        raise ValueError(f"unknown policy loss {kind!r}; expected one of {kinds}")
    return per_token, clipped, weight


def policy_loss_with_stats(
    kind: LossKind,
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    proximal_logprobs: torch.Tensor | None = None,
    clip_eps: float = 0.2,
    clip_eps_low: float | None = None,
    clip_eps_high: float | None = None,
    delta: float = 2.0,
    aggregation: Literal["token", "sequence"] = "token",
    length_divisor: float | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """The scalar loss and statistics over the unmasked tokens. ``clip_eps_low`` and
    ``clip_eps_high`` default to ``clip_eps``; ``length_divisor`` is ``dr_grpo``'s constant
    (which replaces ``aggregation``: the sum over tokens / (rows x length_divisor))."""
    if logprobs.shape != behaviour_logprobs.shape or logprobs.shape != mask.shape:
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)}, behaviour_logprobs {tuple(behaviour_logprobs.shape)} "
            f"and mask {tuple(mask.shape)} must have the same [batch, seq] shape"
        )
    if kind == "dr_grpo" and not (length_divisor and length_divisor > 0):
        raise ValueError(f"dr_grpo needs a positive length_divisor, got {length_divisor!r}")
    adv = advantages.unsqueeze(1).expand_as(logprobs) if advantages.dim() == 1 else advantages
    mask = mask.to(logprobs.dtype)
    ratio = torch.exp(logprobs - behaviour_logprobs)
    clip = (
        clip_eps if clip_eps_low is None else clip_eps_low,
        clip_eps if clip_eps_high is None else clip_eps_high,
    )
    per_token, clipped, weight = _per_token(
        kind, logprobs, behaviour_logprobs, ratio, adv, mask, proximal_logprobs, clip, delta
    )
    if kind == "dr_grpo":
        loss = (per_token * mask).sum() / (mask.shape[0] * length_divisor)
    else:
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
    clip_eps_low: float | None = None,
    clip_eps_high: float | None = None,
    delta: float = 2.0,
    aggregation: Literal["token", "sequence"] = "token",
    length_divisor: float | None = None,
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
        clip_eps_low=clip_eps_low,
        clip_eps_high=clip_eps_high,
        delta=delta,
        aggregation=aggregation,
        length_divisor=length_divisor,
    )
    return loss
