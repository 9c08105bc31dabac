"""A weighted reward list with a reward-model or judge part, as one scorer executor.

``[[task.rewards]]`` entries are functions (``path``) or models (a ``scorer`` table:
``type = "model"`` or ``"judge"``). A list that holds a model is scored whole here, in the
scorer executor: each function part runs in its own ``FunctionScorer`` (its timeouts and
sandbox pool, as a lone reward function), each model part in its own ``RewardModelScorer``
or ``JudgeScorer`` (batched by tokens). The function parts score on their worker threads
while the models score on this one. An item's reward is ``sum(weight * value)``; a part
that fails fails the item with that part's reason, its message naming the part (never a
silent 0). Each part's raw values go to ``reward/<name>_mean`` as a function list's do.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

from loomrl.config_common import DataConfig
from loomrl.runtime.endpoints import endpoint
from loomrl.sandbox.config import SandboxConfig
from loomrl.scoring.base import GroupItems, GroupOutcome, ScoreItem, ScoreOutcome, ScorerEndpoints
from loomrl.scoring.config import JudgeScorerConfig, ModelScorerConfig, TaskConfig
from loomrl.scoring.function import FunctionScorer
from loomrl.scoring.judge import JudgeScorer
from loomrl.scoring.model import RewardModelScorer
from loomrl.scoring.reward_list import RewardStats, total_of
from loomrl.types import PartedReward

logger = logging.getLogger(__name__)


def start_model_part(cfg: ModelScorerConfig | JudgeScorerConfig) -> ScorerEndpoints:
    """The scorer of a list's model part: a reward model's or a judge's."""
    if cfg.type == "model":
        return RewardModelScorer(cfg)

    return JudgeScorer(cfg)


def combine_outcomes(
    labels: list[str], weights: list[float], row: tuple[ScoreOutcome, ...], stats: RewardStats
) -> ScoreOutcome:
    """One item's outcome from its parts' outcomes (in list order): the weighted sum of the
    parts that answered when every part scored (their values into ``stats``; a function
    part that returned None did not answer), else the first failed part's reason, with the
    part named in the message."""
    seconds = sum(outcome[2] for outcome in row)
    for label, (status, value, _) in zip(labels, row):
        if status != "ok":
            message = str(value)
            named = message if repr(label) in message else f"reward {label!r}: {message}"
            return status, named, seconds
    # (a function part is a list of one: its PartedReward holds what the function returned)
    values = [
        outcome[1].parts[label] if isinstance(outcome[1], PartedReward) else outcome[1]
        for label, outcome in zip(labels, row)
    ]
    return "ok", total_of(labels, weights, values, stats), seconds


class WeightedScorer(ScorerEndpoints):
    """Scores a ``[[task.rewards]]`` list that holds at least one model or judge part."""

    def __init__(
        self,
        task: TaskConfig,
        sandbox: SandboxConfig | None = None,
        data: DataConfig | None = None,
    ) -> None:
        self.labels = [spec.label for spec in task.rewards]
        self.weights = [spec.weight for spec in task.rewards]
        self.functions: dict[int, ScorerEndpoints] = {}
        self.models: dict[int, ScorerEndpoints] = {}
        for i, spec in enumerate(task.rewards):
            if spec.scorer is None:  # a one-function list: its own name in its messages
                alone = spec.model_copy(update={"weight": 1.0})
                self.functions[i] = FunctionScorer(
                    task.model_copy(update={"rewards": [alone]}), sandbox, data
                )
            else:
                self.models[i] = start_model_part(spec.scorer)
        self.stats = RewardStats(self.labels)
        self._threads = ThreadPoolExecutor(
            max(len(self.functions), 1), thread_name_prefix="loomrl-reward-part"
        )
        logger.info(
            "reward list %s: %d function and %d model parts",
            self.labels,
            len(self.functions),
            len(self.models),
        )

    @endpoint  # one call at a time, in order, as a model scorer's (its batches are the parallelism)
    def score(self, items: list[ScoreItem]) -> tuple[list[ScoreOutcome], dict[str, float]]:
        pending = {i: self._threads.submit(part.score, items) for i, part in self.functions.items()}
        replies = {i: part.score(items) for i, part in self.models.items()}
        replies.update({i: future.result() for i, future in pending.items()})
        metrics: dict[str, float] = {}
        for _, part_metrics in replies.values():  # (each part's own reward/* sums are ours to keep)
            metrics.update({k: v for k, v in part_metrics.items() if not k.startswith("reward/")})
        per_part = [replies[i][0] for i in range(len(self.labels))]
        outcomes = [
            combine_outcomes(self.labels, self.weights, row, self.stats) for row in zip(*per_part)
        ]
        return outcomes, {**metrics, **self.stats.drain()}

    @endpoint
    def score_groups(self, groups: list[GroupItems]) -> tuple[list[GroupOutcome], dict[str, float]]:
        return super().score_groups(groups)

    def close(self) -> None:
        """Close the function parts' executors (their event loops) and the part threads."""
        for part in self.functions.values():
            part.close()
        self._threads.shutdown(wait=False, cancel_futures=True)
