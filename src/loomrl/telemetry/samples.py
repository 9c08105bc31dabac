"""What a step trained on, for a person to read: a few (prompt, completion, reward) samples
per step for ``samples.jsonl``, and a warning when most groups had nothing to learn from.

A GRPO group whose completions all got the same reward has zero advantage everywhere: it
moves no weight. A step where most groups are like that (a random model that never gets an
exact-match answer right, a reward that always returns 1) is a run learning nothing, and
says so in the log instead of training on silently.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)


def step_samples(groups: list[Any], count: int) -> list[dict[str, Any]]:
    """The first completion of each of the first ``count`` groups, as
    ``{"prompt_index", "prompt", "completion", "reward"}``: the prompt as the dataset holds it
    and the completion as text, read from the group's columns (no rollout built)."""
    samples = []
    for group in groups[:count]:
        prompt, completion, reward = group.prompts[0], group.texts[0], group.rewards[0]
        samples.append(
            {
                "prompt_index": group.prompt_index,
                "prompt": prompt,
                "completion": completion,
                "reward": reward,
            }
        )
    return samples


class ZeroVarianceWatch:
    """Counts the groups of each step whose rewards are all equal; warns when more than
    ``threshold`` of a step's groups are, at most once every ``every_steps`` steps."""

    def __init__(self, every_steps: int, threshold: float = 0.5) -> None:
        self.every_steps, self.threshold = every_steps, threshold
        self.last_warned: int | None = None
        self.warnings = 0

    def observe(self, step: int, rewards: list[list[float]]) -> float:
        """The fraction of groups (each a list of rewards) with zero variance at ``step``."""
        if not rewards:
            return 0.0
        flat = sum(1 for group in rewards if len(set(group)) <= 1)
        fraction = flat / len(rewards)
        due = self.last_warned is None or step - self.last_warned >= self.every_steps
        if fraction > self.threshold and due:
            self.last_warned, self.warnings = step, self.warnings + 1
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
