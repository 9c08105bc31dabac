"""KL penalty to a reference policy (off by default)."""

from __future__ import annotations

import torch


def kl_penalty(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Mean over unmasked tokens of the k3 estimator exp(ref - lp) - (ref - lp) - 1 (>= 0)."""
    diff = ref_logprobs - logprobs
    per_token = torch.exp(diff) - diff - 1
    mask = mask.to(per_token.dtype)
    return (per_token * mask).sum() / mask.sum().clamp(min=1)
