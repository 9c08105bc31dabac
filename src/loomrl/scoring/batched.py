"""What the model-based scorer executors share (``scoring/model.py``, ``scoring/judge.py``).

``BatchedModelScorer`` is the model kinds' shared loop: encode each item (a failure, such as
a text too long for the model, is that item's outcome), pack the rest into batches by a
token budget, run each batch through the model, and turn each value into an outcome.
"""

from __future__ import annotations

import logging
import math
import time
from abc import abstractmethod
from typing import Any

from loomrl.runtime.endpoints import endpoint
from loomrl.scoring.base import GroupItems, GroupOutcome, ScoreItem, ScoreOutcome, ScorerEndpoints
from loomrl.scoring.calls import RewardFailure, check_value

logger = logging.getLogger(__name__)


def token_budget_batches(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Indices of ``lengths`` in batches whose padded size (rows x longest row) stays
    within ``max_tokens``; a row longer than the budget goes alone. Rows are sorted by
    length first, so a batch pads little."""
    batches: list[list[int]] = []
    batch: list[int] = []
    longest = 0
    for i in sorted(range(len(lengths)), key=lengths.__getitem__):
        grown = max(longest, lengths[i])
        if batch and grown * (len(batch) + 1) > max_tokens:
            batches.append(batch)
            batch, grown = [], lengths[i]
        batch.append(i)
        longest = grown
    if batch:
        batches.append(batch)
    return batches


class RunningNorm:
    """Running mean and standard deviation (Welford's), over every score seen."""

    def __init__(self) -> None:
        self.count, self.mean, self.m2 = 0, 0.0, 0.0

    def update(self, values: list[float]) -> None:
        for value in values:
            self.count += 1
            delta = value - self.mean
            self.mean += delta / self.count
            self.m2 += delta * (value - self.mean)

    def __call__(self, value: float) -> float:
        std = math.sqrt(self.m2 / self.count) if self.count > 1 else 0.0
        return (value - self.mean) / max(std, 1e-6) if self.count > 1 else 0.0


class BatchedModelScorer(ScorerEndpoints):
    """A scorer executor that runs a frozen model over token-budget batches.

    Unlike a reward function's, its calls run one at a time (their batches are the
    parallelism; overlapping forwards would only compete for the device and its memory).
    A subclass says how an item becomes tokens (``encode``) and what a batch of them
    scores (``score_batch``: a float, or a ``RewardFailure`` for that item). ``normalize``
    and ``clip`` apply to every score that came out a float."""

    max_tokens_per_batch: int
    normalize: bool = False
    clip: float | None = None

    def __init__(self) -> None:
        self._norm = RunningNorm()
        self._num_items = self._num_batches = 0
        self._model_s = 0.0

    @abstractmethod
    def encode(self, item: ScoreItem) -> list[int]:
        """The item's token ids; raises ``RewardFailure`` for one that cannot be scored."""

    @abstractmethod
    def score_batch(
        self, ids: list[list[int]], items: list[ScoreItem]
    ) -> list[float | RewardFailure]:
        """Each row's score (or ``RewardFailure``), in the order given."""

    @endpoint  # one call at a time, in order: one model, one batch on its device at a time
    def score(self, items: list[ScoreItem]) -> tuple[list[ScoreOutcome], dict[str, float]]:
        t0 = time.perf_counter()
        values: list[Any] = [None] * len(items)
        encoded: dict[int, list[int]] = {}
        for i, item in enumerate(items):
            try:
                encoded[i] = self.encode(item)
            except RewardFailure as failure:
                values[i] = failure
        order = list(encoded)
        for batch in token_budget_batches(
            [len(encoded[i]) for i in order], self.max_tokens_per_batch
        ):
            rows = [order[k] for k in batch]
            for i, value in zip(
                rows, self.score_batch([encoded[i] for i in rows], [items[i] for i in rows])
            ):
                values[i] = value
            self._num_batches += 1
        seconds = (time.perf_counter() - t0) / max(len(items), 1)
        self._model_s += time.perf_counter() - t0
        self._num_items += len(items)
        return self._outcomes(values, seconds), self.metrics()

    @endpoint
    def score_groups(self, groups: list[GroupItems]) -> tuple[list[GroupOutcome], dict[str, float]]:
        return super().score_groups(groups)

    def _outcomes(self, values: list[Any], seconds: float) -> list[ScoreOutcome]:
        checked: list[Any] = []
        for value in values:
            if not isinstance(value, RewardFailure):
                try:
                    value = check_value(value)
                except RewardFailure as failure:
                    value = failure
            checked.append(value)
        if self.normalize:
            self._norm.update([v for v in checked if not isinstance(v, RewardFailure)])
        outcomes: list[ScoreOutcome] = []
        for value in checked:
            if isinstance(value, RewardFailure):
                outcomes.append((value.reason, str(value), seconds))
                continue
            value = self._norm(value) if self.normalize else value
            if self.clip is not None:
                value = min(max(value, -self.clip), self.clip)
            outcomes.append(("ok", value, seconds))
        return outcomes

    def metrics(self) -> dict[str, float]:
        """This executor's counts so far (they add up over executors in the job's metrics)."""
        return {
            "scorer/model_items": float(self._num_items),
            "scorer/model_batches": float(self._num_batches),
            "scorer/model_busy_s": self._model_s,
        }


def load_frozen(model, device, dtype):
    """``model`` in ``dtype`` on ``device``, in eval mode, every parameter frozen: a scorer
    model never receives a weight update and keeps no gradient."""
    model = model.to(device=device, dtype=dtype)
    model.eval()
    model.requires_grad_(False)
    return model


def resolve_placement(cfg: Any):
    """``(device, dtype)`` of a model scorer's ``device`` and ``dtype`` settings ('auto':
    CUDA when present; bfloat16 there, float32 on the CPU)."""
    # lazy: torch and transformers load in the scorer executor, not with the scorer's config
    from loomrl.device import resolve_device
    from loomrl.models.loading import resolve_dtype

    device = resolve_device(cfg.device)
    return device, resolve_dtype(cfg, device)
