"""The scorer executor's interface, and the data its calls carry.

Every kind of scorer executor (a reward function's ``FunctionScorer``, a reward model's, a
judge's, a weighted list's) answers ``ScorerEndpoints`` with the same outcomes, so the
controller's ``Scorer`` (``scoring/client.py``), supervision (restart when killed,
deadlines) and failure accounting see one kind of scorer executor.
"""

from __future__ import annotations

import operator
from abc import ABC, abstractmethod
from itertools import repeat
from typing import Any

from loomrl.runtime.endpoints import endpoint
from loomrl.types import Group, Rollout

# (prompt, completion, row)
ScoreItem = tuple[str, str, dict[str, Any]]
# ("ok", reward, seconds) or (failure reason, message, seconds)
ScoreOutcome = tuple[str, Any, float]
# one group's (prompt, completions, row)
GroupItems = tuple[str, list[str], dict[str, Any]]
# ("ok", rewards) or ("outcomes", one ScoreOutcome per completion)
GroupOutcome = tuple[str, list]
# How a rollout's error starts when no scorer could score it.
SCORER_LOST = "scorer lost twice"

_first, _second = operator.itemgetter(0), operator.itemgetter(1)


def lost_by_scorer(rollout: Rollout) -> bool:
    """No scorer could score ``rollout`` (the executors' failure, not the reward's)."""
    return rollout.failure == "scorer_lost"


class ScorerEndpoints(ABC):
    """A scorer executor's interface."""

    @endpoint(concurrent=True)
    @abstractmethod
    def score(self, items: list[ScoreItem]) -> tuple[list[ScoreOutcome], dict[str, float]]:
        """Each item's outcome, and this executor's ``sandbox/*`` metrics."""

    @endpoint(concurrent=True)
    def score_groups(self, groups: list[GroupItems]) -> tuple[list[GroupOutcome], dict[str, float]]:
        """``score`` for groups given as ``(prompt, completions, row)``: per group
        ``("ok", rewards)`` when every completion scored, else ``("outcomes", outcomes)``.
        The controller's loop then builds no item and reads no outcome per completion;
        the work is done here."""
        items: list[ScoreItem] = []
        for prompt, texts, row in groups:
            items += zip(repeat(prompt), texts, repeat(row))
        outcomes, metrics = self.score(items)
        return per_group_outcomes(outcomes, [len(texts) for _, texts, _ in groups]), metrics


def group_payload(
    groups: list[Group],
) -> tuple[list[tuple[str, list[str], dict]], list[int]] | None:
    """What a scorer executor's ``score_groups`` takes for ``groups`` (each one's prompt,
    completion texts and row) and their sizes; None when a group's rollouts have prompts of
    their own (those are scored per rollout). It reads only the groups (the controller
    builds it off its loop, with the groups)."""
    items = []
    for group in groups:
        prompts = group.prompts
        # text, or a list of messages (unhashable)
        first = prompts[0] if prompts else None
        if any(p is not first and p != first for p in prompts):
            return None
        items.append((prompts[0] if prompts else "", group.texts, group.row))
    return items, [group.size for group in groups]


def per_group_outcomes(outcomes: list[ScoreOutcome], sizes: list[int]) -> list[GroupOutcome]:
    """Consecutive outcomes, ``sizes[i]`` per group, as ``ScorerEndpoints.score_groups``
    returns them."""
    grouped: list[GroupOutcome] = []
    start = 0
    for size in sizes:
        mine, start = outcomes[start : start + size], start + size
        grouped.append(
            ("ok", list(map(_second, mine)))
            if set(map(_first, mine)) <= {"ok"}
            else ("outcomes", mine)
        )
    return grouped
