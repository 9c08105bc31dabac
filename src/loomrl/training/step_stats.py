"""The trainer step's numbers: weighted means of per-micro-batch statistics, the loss
statistics of one micro-batch, and the optimizer step that measures the update it made."""

from __future__ import annotations

import math
from typing import Any

import torch

from loomrl.algorithms.losses import LossStats

# parameters copied at a time to measure the update (128 MiB in fp32)
UPDATE_BUCKET_NUMEL = 32 * 2**20


def step_and_measure(optimizer: torch.optim.Optimizer) -> tuple[float, float]:
    """``optimizer.step()``, and the root-mean-square of the parameter change it made and
    of the weights after it, without a second copy of all the weights: the step runs on
    buckets of about ``UPDATE_BUCKET_NUMEL`` parameters (the others' gradients hidden), each
    copied just before its step. AdamW's update is elementwise with per-parameter state,
    so the weights are those of one step bit for bit (a model under one bucket, such as
    the demo's, takes exactly one step)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    grads = [p.grad for p in params]
    buckets: list[list[int]] = [[]]
    size = 0
    for i, p in enumerate(params):
        if size >= UPDATE_BUCKET_NUMEL:
            buckets.append([])
            size = 0
        buckets[-1].append(i)
        size += p.numel()
    hide = len(buckets) > 1
    update_sq = 0.0
    with torch.no_grad():
        try:
            for bucket in buckets:
                if hide:
                    members = set(bucket)
                    for i, p in enumerate(params):
                        p.grad = grads[i] if i in members else None
                stepped = [params[i] for i in bucket]
                before = torch._foreach_mul(stepped, 1.0)  # this bucket's copy
                optimizer.step()
                torch._foreach_sub_(before, stepped)
                update_sq += sum(float(n) ** 2 for n in torch._foreach_norm(before))
                del before
        finally:
            for p, g in zip(params, grads):
                p.grad = g
        weight_sq = sum(float(n) ** 2 for n in torch._foreach_norm(params))
    count = max(sum(p.numel() for p in params), 1)
    return math.sqrt(update_sq / count), math.sqrt(weight_sq / count)


class _Accumulator:
    """Weighted means (and maxima) of per-micro-batch statistics."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.weights: dict[str, float] = {}
        self.maxima: dict[str, float] = {}
        self.plain_sums: set[str] = set()

    def add(self, key: str, value: float, weight: float, weighted_sum: bool = False) -> None:
        self.sums[key] = self.sums.get(key, 0.0) + value * weight
        self.weights[key] = self.weights.get(key, 0.0) + weight
        if weighted_sum:
            self.plain_sums.add(key)

    def max(self, key: str, value: float) -> None:
        self.maxima[key] = max(self.maxima.get(key, float("-inf")), value)

    def finish(self) -> dict[str, float]:
        out = {}
        for key, total in self.sums.items():
            out[key] = total if key in self.plain_sums else total / max(self.weights[key], 1e-12)
        out.update(self.maxima)
        return out


def add_micro_batch_stats(
    acc: _Accumulator,
    batch: Any,
    logp: torch.Tensor,
    entropy: torch.Tensor,
    loss: torch.Tensor,
    stats: LossStats,
    weight: float,
    delta: float,
) -> None:
    """One micro-batch's ``train/*`` statistics, weighted by its target tokens (the loss
    by its share of the step). ``batch``: a ``TokenBatch`` or ``PrefixBatch``; ``logp``,
    ``entropy``: ``[batch, targets]``; ``stats``: the policy loss's."""
    mask = batch.target_mask
    n_tokens = float(mask.sum())
    with torch.no_grad():
        acc.add("train/loss", float(loss), weight, weighted_sum=True)
        acc.add("train/entropy", float((entropy * mask).sum() / mask.sum().clamp(min=1)), n_tokens)
        acc.add("train/clip_fraction", stats.clip_fraction, n_tokens)
        acc.add("train/importance_ratio_mean", stats.ratio_mean, n_tokens)
        acc.add("train/importance_weight_mean", stats.weight_mean, n_tokens)
        acc.max("train/importance_ratio_max", stats.ratio_max)
        # tokens whose ratio pi_theta / mu is past algorithm.delta (aipo and tis cap them)
        over = (torch.exp(logp.detach() - batch.behaviour) > delta).float() * mask
        acc.add(
            "train/importance_ratio_truncated_frac",
            float(over.sum()) / max(n_tokens, 1.0),
            n_tokens,
        )
        same = batch.same_version  # per rollout, or per token (weights changed mid-request)
        same = (same if same.dim() == 2 else same.unsqueeze(1)).float() * mask
        add_current_version_stats(acc, same, n_tokens)
        if same.sum() > 0:
            add_mismatch_stats(acc, logp.detach() - batch.behaviour, same)
        add_offpolicy_stats(acc, logp.detach() - batch.behaviour, mask)


def add_current_version_stats(acc: _Accumulator, same: torch.Tensor, n_tokens: float) -> None:
    """``train/current_version_token_frac``: the share of trained tokens the trainer's own
    version sampled (``same``: 1 there), what in-flight weight updates raise."""
    acc.add("train/current_version_token_frac", float(same.sum()) / max(n_tokens, 1.0), n_tokens)


def add_mismatch_stats(acc: _Accumulator, log_ratio: torch.Tensor, same: torch.Tensor) -> None:
    """The training-inference mismatch on tokens sampled at the trainer's own version
    (``same``: 1 there), where the log-probs differ only by engine, kernels and precision:
    mean and max of |trainer - behaviour| and the k3 estimate of KL(behaviour || trainer),
    ``E[r - 1 - log r]`` with ``r = exp(trainer - behaviour)`` over tokens the behaviour
    policy sampled (unbiased, never negative)."""
    gap = log_ratio.abs() * same
    acc.add("train/logprob_mismatch_same_version", float(gap.sum() / same.sum()), float(same.sum()))
    acc.max("train/logprob_mismatch_same_version_max", float(gap.max()))
    k3 = (torch.expm1(log_ratio) - log_ratio) * same
    acc.add("train/logprob_mismatch_kl", float(k3.sum() / same.sum()), float(same.sum()))


def add_offpolicy_stats(acc: _Accumulator, log_ratio: torch.Tensor, mask: torch.Tensor) -> None:
    """How far the policy that sampled is from the one that trains, on every target token:
    staleness and the engine/precision gap together (``add_mismatch_stats`` has the second
    alone). Mean |trainer - behaviour| log-prob and the k3 estimate of KL(behaviour ||
    trainer); one host sync for both."""
    n = float(mask.sum())
    if n == 0:
        return
    log_ratio = torch.where(mask > 0, log_ratio, torch.zeros_like(log_ratio))
    sums = torch.stack([log_ratio.abs().sum(), (torch.expm1(log_ratio) - log_ratio).sum()])
    gap, k3 = sums.tolist()
    acc.add("train/offpolicy_logprob_gap", gap / n, n)
    acc.add("train/offpolicy_kl", k3 / n, n)
