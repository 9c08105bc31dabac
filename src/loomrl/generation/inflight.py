"""In-flight weight updates for the hf engine (``generation.inflight_updates``).

A request no longer holds one version from its first token to its last. Every ``every``
decode steps the sampling loop asks the weight receiver for a newer committed version and,
when there is one, applies it there: after the step's token was picked and before the
forward that computes the next token's logits. The receiver verifies and commits an update
into its mirror and loads it into the model on the sampling thread itself, so no forward
ever runs on a half-applied update: each one reads the weights of exactly one version.

What happens to the tokens already decoded is the policy:

- kept (default; PipelineRL's choice): the KV cache of the earlier tokens, computed by the
  old weights, stays; the new weights attend over it. Nothing is recomputed.
- recomputed (``generation.partial_rollouts``; AReaL / verl partial rollouts): the request
  is cut and continued as a new one, its prompt followed by its tokens so far, prefilled by
  the new weights; sampling goes on with the same per-sequence noise. One rollout still,
  however many cuts.

Each token records the version whose forward produced its logits (and its log-prob is that
version's), so the loss's per-token ratios are exact; a rollout's ``version`` (what the
staleness gate and the buffer read) is its oldest token's.
"""

from __future__ import annotations

import time

import torch

from loomrl.weights.receiver import WeightReceiver


class InflightUpdates:
    """When a sampling loop looks for a newer version, and what the looks applied."""

    def __init__(self, every: int, recompute: bool = False) -> None:
        if every < 1:
            raise ValueError(f"inflight_every_tokens must be >= 1, got {every}")
        self.every, self.recompute = every, recompute
        self.num_applied = 0  # versions applied in the middle of a request (totals)
        self.apply_s = 0.0
        self.call_apply_s = 0.0  # of the call in progress (reset by the engine per call)

    @classmethod
    def every_tokens(cls, every: int | None, recompute: bool = False) -> InflightUpdates | None:
        """Looks every ``every`` decode steps; None (updates between calls only) for None."""
        return None if every is None else cls(every, recompute)

    def due(self, step: int) -> bool:
        """Whether to look after decode step ``step`` (0-based): every ``every`` tokens."""
        return (step + 1) % self.every == 0

    def look(self, receiver: WeightReceiver) -> bool:
        """Apply the newest committed version the transport holds, if it is newer; whether
        the weights changed. Runs between two decode steps, on the sampling thread."""
        before, t0 = receiver.version, time.perf_counter()
        receiver.poll()
        if receiver.version == before:
            return False
        seconds = time.perf_counter() - t0
        self.num_applied += 1
        self.apply_s += seconds
        self.call_apply_s += seconds
        return True

    def metrics(self, prefix: str) -> dict[str, float]:
        return {
            f"{prefix}/inflight_updates": float(self.num_applied),
            f"{prefix}/inflight_apply_s": self.apply_s,
        }


def prompts_so_far(
    prompts: list[list[int]], step_tokens: list[torch.Tensor], step_live: list[torch.Tensor]
) -> list[list[int]]:
    """Each sequence's prompt followed by the tokens it sampled so far (those sampled while
    it was live: up to and including its EOS): the prompts of the continued requests."""
    tokens = torch.stack(step_tokens, dim=1).tolist()
    lengths = torch.stack(step_live, dim=1).sum(dim=1).tolist()
    return [p + row[:n] for p, row, n in zip(prompts, tokens, lengths)]


def token_versions(step_versions: list[int], ids: list[list[int]]) -> list[list[int]]:
    """Per sequence, the version that sampled each of its kept tokens (the first ones)."""
    return [step_versions[: len(row)] for row in ids]
