"""What a step trained on, for a person to read: a few (prompt, completion, reward) samples
per step for ``samples.jsonl``, and a warning when most groups had nothing to learn from.

A GRPO group whose completions all got the same reward has zero advantage everywhere: it
moves no weight. A step where most groups are like that (a random model that never gets an
exact-match answer right, a model that has learnt the task, a reward that always returns 1)
is a run learning nothing, and says so in the log, with which of these it is, instead of
training on silently.
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
    """Counts the groups of each step whose rewards are all equal, and which kind they are;
    warns when more than ``threshold`` of a step's groups are, at most once every
    ``every_steps`` steps.

    A flat group is *all-wrong* when its reward is the lowest seen in the run so far, and
    *all-right* when it is the highest (until two different rewards have been seen, a
    reward above 0 counts as right, 0 or below as wrong); other flat groups are neither.
    The two need opposite advice: all-wrong groups want a model that can solve some of the
    prompts (a warm-start, partial credit, larger groups), all-right ones harder prompts
    (dynamic sampling, harder data, a curriculum)."""

    def __init__(
        self, every_steps: int, threshold: float = 0.5, dynamic_sampling: bool = False
    ) -> None:
        self.every_steps, self.threshold = every_steps, threshold
        self.dynamic_sampling = dynamic_sampling
        self.said = _EverySteps(every_steps)
        self.lowest, self.highest = float("inf"), float("-inf")

    def observe(
        self, step: int, rewards: list[list[float]], dropped: list[list[float]] = ()
    ) -> dict[str, float]:
        """``rollout/zero_variance_frac`` (and its ``_wrong`` and ``_right`` parts) over the
        step's groups (each a list of rewards): those trained, and those ``dropped`` by
        dynamic sampling since the last step; ``_trained_frac`` over the trained ones."""
        groups = [*rewards, *dropped]
        if not groups:
            return {"rollout/zero_variance_frac": 0.0}
        for group in groups:
            self.lowest, self.highest = min(self.lowest, *group), max(self.highest, *group)
        flat = [group[0] for group in groups if len(set(group)) <= 1]
        wrong = sum(1 for r in flat if self._is_wrong(r))
        right = sum(1 for r in flat if not self._is_wrong(r) and self._is_right(r))
        n = len(groups)
        if len(flat) / n > self.threshold and self.said.due(step):
            self._warn(step, n, flat, wrong, right)
        trained_flat = sum(1 for group in rewards if len(set(group)) <= 1)
        return {
            "rollout/zero_variance_frac": len(flat) / n,
            "rollout/zero_variance_trained_frac": trained_flat / max(len(rewards), 1),
            "rollout/zero_variance_wrong_frac": wrong / n,
            "rollout/zero_variance_right_frac": right / n,
        }

    def _is_wrong(self, reward: float) -> bool:
        return reward <= self.lowest if self.lowest < self.highest else reward <= 0

    def _is_right(self, reward: float) -> bool:
        return reward >= self.highest if self.lowest < self.highest else reward > 0

    def _warn(self, step: int, n: int, flat: list[float], wrong: int, right: int) -> None:
        advice = {
            "wrong": f"{wrong} all wrong ({wrong / n:.0%}: all at the lowest reward seen, "
            f"{self.lowest:.3g}): the model cannot solve these prompts yet; warm-start it with "
            "supervised steps first (loomrl.training.sft, as examples/arithmetic does), use a reward "
            "with partial credit, or raise group_size",
            "right": f"{right} all right ({right / n:.0%}: all at the highest reward seen, "
            f"{self.highest:.3g}): these prompts are too easy for the model now; "
            + (
                "algorithm.dynamic_sampling drops them (rollout/dropped_zero_variance), harder "
                "data or a curriculum would waste less generation"
                if self.dynamic_sampling
                else "turn on algorithm.dynamic_sampling, use harder data, or a curriculum"
            ),
        }
        counts = {"wrong": wrong, "right": right}
        parts = [advice[k] for k in sorted(counts, key=counts.get, reverse=True) if counts[k]]
        if len(flat) - wrong - right:
            parts.append(f"{len(flat) - wrong - right} at a reward in between")
        logger.warning(
            "step %d: %d of %d groups had the same reward for every completion (their mean %.3g): zero "
            "advantage, nothing to learn from them. %s (said at most every %d steps; "
            "rollout/zero_variance_frac, _wrong_frac and _right_frac have each step's fractions)",
            step,
            len(flat),
            n,
            sum(flat) / len(flat),
            "; ".join(parts),
            self.every_steps,
        )


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
