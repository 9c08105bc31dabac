"""What a step trained on, for a person to read: a few (prompt, completion, reward) samples
per step for ``samples.jsonl``, and a warning when most groups had nothing to learn from.

A GRPO group whose completions all got the same reward has zero advantage everywhere: it
moves no weight. A step where most groups are like that (a random model that never gets an
exact-match answer right, a reward that always returns 1) is a run learning nothing, and
says so in the log instead of training on silently.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from loomrl.types import PartedReward

logger = logging.getLogger(__name__)


def step_samples(
    groups: list[Any], count: int, prompt_text: Callable[[list[int]], str] | None = None
) -> list[dict[str, Any]]:
    """The first completion of each of the first ``count`` groups, as
    ``{"prompt_index", "prompt", "rendered_prompt", "completion", "reward", "rewards"}``: the
    prompt as the dataset holds it, the text the model saw (``prompt_text`` of its token ids:
    after the chat template, special tokens and any cut included), the completion as text,
    the reward, and a reward list's value of each part (None where a part did not apply),
    read from the group's columns (no rollout built)."""
    samples = []
    for group in groups[:count]:
        prompt, completion, reward = group.prompts[0], group.texts[0], group.rewards[0]
        sample = {"prompt_index": group.prompt_index, "prompt": prompt}
        if prompt_text is not None:
            sample["rendered_prompt"] = prompt_text(group.prompt_ids[0])
        sample.update(completion=completion, reward=reward)
        if isinstance(reward, PartedReward):
            sample.update(reward=float(reward), rewards=dict(reward.parts))
        samples.append(sample)
    return samples


class _EverySteps:
    """A warning said at most once every ``every_steps`` steps, and how many were said."""

    def __init__(self, every_steps: int) -> None:
        self.every_steps = every_steps
        self.last_warned: int | None = None
        self.warnings = 0

    def due(self, step: int) -> bool:
        """Whether a warning may be said at ``step``; counts it when so."""
        if self.last_warned is not None and step - self.last_warned < self.every_steps:
            return False
        self.last_warned, self.warnings = step, self.warnings + 1
        return True


class ZeroVarianceWatch:
    """Counts the groups of each step whose rewards are all equal; warns when more than
    ``threshold`` of a step's groups are, at most once every ``every_steps`` steps."""

    def __init__(self, every_steps: int, threshold: float = 0.5) -> None:
        self.every_steps, self.threshold = every_steps, threshold
        self.said = _EverySteps(every_steps)

    def observe(self, step: int, rewards: list[list[float]]) -> float:
        """The fraction of groups (each a list of rewards) with zero variance at ``step``."""
        if not rewards:
            return 0.0
        flat = sum(1 for group in rewards if len(set(group)) <= 1)
        fraction = flat / len(rewards)
        if fraction > self.threshold and self.said.due(step):
            logger.warning(
                "step %d: %d of %d groups had the same reward for every completion (mean %.3g): zero advantage, "
                "nothing to learn from them. A random or untrained model on an exact-match reward does this; "
                "warm-start it with supervised steps first (loomrl.training.sft, as examples/arithmetic does), use a "
                "reward with partial credit, or raise group_size "
                "(said at most every %d steps; rollout/zero_variance_frac has each step's fraction)",
                step,
                flat,
                len(rewards),
                sum(map(sum, rewards)) / max(sum(map(len, rewards)), 1),
                self.every_steps,
            )
        return fraction


class MismatchWatch:
    """Warns when a step's ``train/logprob_mismatch_same_version`` (mean |trainer -
    behaviour| log-prob on tokens sampled at the trainer's own version) passes
    ``threshold``, at most once every ``every_steps`` steps; counts the warnings."""

    def __init__(self, threshold: float, every_steps: int) -> None:
        self.threshold, self.every_steps = threshold, every_steps
        self.said = _EverySteps(every_steps)

    def observe(self, step: int, train_metrics: dict) -> dict[str, float]:
        """``train/logprob_mismatch_warnings`` so far, after looking at this step's."""
        gap = train_metrics.get("train/logprob_mismatch_same_version")
        if gap is not None and gap > self.threshold and self.said.due(step):
            logger.warning(
                "step %d: the trainer's and the generators' log-probs of the same tokens at the same "
                "policy version differ by %.3g nats on average (max %.3g, KL %.3g; warning above %.3g): "
                "the engine does not compute the trainer's policy. Look for a precision or kernel "
                "difference (weight_sync.publish_dtype, generation.engine.quantize, model.dtype, the engine), "
                "or weights that did not arrive (said at most every %d steps; "
                "logging.logprob_mismatch_warning sets the threshold)",
                step,
                gap,
                train_metrics.get("train/logprob_mismatch_same_version_max", float("nan")),
                train_metrics.get("train/logprob_mismatch_kl", float("nan")),
                self.threshold,
                self.every_steps,
            )
        return {"train/logprob_mismatch_warnings": float(self.said.warnings)}
