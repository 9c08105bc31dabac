"""The Generator interface: batched sampling that reports behaviour log-probs and version."""

from __future__ import annotations

from abc import ABC, abstractmethod

from loomrl.types import GenerationRequest, GenerationResult


class Generator(ABC):
    """A generation engine holding one copy of the policy.

    ``generate`` samples completions and reports, per token, the log-prob of the sampled
    token under ``log_softmax(logits / temperature)`` (top-p truncation is not folded in),
    and the policy version of the weights used. ``update_weights`` is only ever called
    between requests.
    """

    version: int = 0

    @abstractmethod
    def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        """One result per request, each with ``request.num_samples`` completions."""

    @abstractmethod
    def update_weights(self, update: object) -> int:
        """Apply a ``loomrl.weights.WeightUpdate``; returns the new version."""

    def sleep(self) -> None:  # noqa: B027 - optional hook for time-slicing
        """Release accelerator memory until ``wake`` (no-op by default)."""

    def wake(self) -> None:  # noqa: B027
        """Reacquire what ``sleep`` released (no-op by default)."""
