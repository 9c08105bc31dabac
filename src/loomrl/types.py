"""Plain data that passes between executors: no live objects, only lists, numbers, dicts.

Everything here is picklable, so the same controller drives threads (``local``) and Ray
actors without a rewrite.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields
from itertools import repeat
from typing import Any, Literal


def _pickled_by_fields(cls: type) -> type:
    """Pickle instances as (class, fields in order), rebuilt by the positional __init__.

    A slotted dataclass otherwise pickles through dataclasses' Python-level
    ``__getstate__``/``__setstate__``, slower both ways; rollouts are pickled on the
    controller and unpickled in the trainer (on its critical path) every step of the
    ``process`` and ``ray`` runtimes (docs/benchmarks.md has the times)."""
    get = operator.attrgetter(*(f.name for f in fields(cls)))

    def __reduce__(self):  # the pickle protocol's name
        return type(self), get(self)

    cls.__reduce__ = __reduce__
    return cls


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 16
    greedy: bool = False


@_pickled_by_fields
@dataclass(slots=True)  # 16 a step, built on the controller's loop and pickled to the generator
class GenerationRequest:
    """One prompt to complete ``num_samples`` times."""

    prompt_ids: list[int]
    num_samples: int
    sampling: SamplingParams
    seed: int  # sampling is a pure function of (weights, prompt_ids, sampling, seed)
    min_version: int = 0  # the generator waits until it holds at least this policy version


@_pickled_by_fields
@dataclass(slots=True)  # one per request, built where the engine ran and pickled to the controller
class GenerationResult:
    """One request's completions as columns, one entry per completion (no object per
    completion to build, pickle, read and free on the controller's loop), made by the
    weights of policy ``version``; the report fields are set on one result of a call."""

    # Generated tokens, EOS included when sampled.
    token_ids: list[list[int]]
    # The behaviour log-prob of each sampled token, at the sampling temperature.
    logprobs: list[list[float]]
    # "stop" or "length".
    finish_reasons: list[str]
    # The detokenized completions; None when the engine did not make them.
    texts: list[str] | None
    # The policy version of the oldest weights behind any of its tokens (the call's first).
    version: int = 0
    # Seconds the generator paused to apply updates before this call.
    weight_apply_s: float = 0.0
    # The generator's weight_sync/* and the engine's generation/* totals.
    weight_metrics: dict[str, float] = field(default_factory=dict)
    engine_metrics: dict[str, float] = field(default_factory=dict)
    # The version that sampled each token, per completion, where weights changed during the
    # request (generation.inflight_updates); None: every token was sampled at ``version``.
    token_versions: list[list[int]] | None = None

    @classmethod
    def from_columns(
        cls,
        token_ids: list[list[int]],
        logprobs: list[list[float]],
        finish_reasons: list[str],
        texts: list[str] | None,
        version: int,
        token_versions: list[list[int]] | None = None,
    ) -> GenerationResult:
        """The result of these columns, checked to be one entry per completion. With
        ``token_versions`` (per completion, the version that sampled each token) its
        ``version`` is their oldest, and the column is kept only where some token's differs."""
        if (
            not len(token_ids)
            == len(logprobs)
            == len(finish_reasons)
            == (len(texts) if texts is not None else len(token_ids))
        ):
            raise ValueError(
                f"GenerationResult.from_columns: the columns differ in length ({len(token_ids)} "
                f"token_ids, {len(logprobs)} logprobs, {len(finish_reasons)} finish_reasons, "
                f"{'no' if texts is None else len(texts)} texts)"
            )
        if token_versions is not None:  # the oldest version behind a token, if any
            version = min((min(row) for row in token_versions if row), default=version)
        result = cls(token_ids, logprobs, finish_reasons, texts, version)
        if token_versions is not None and any(v != version for row in token_versions for v in row):
            if list(map(len, token_versions)) != list(map(len, token_ids)):
                raise ValueError(
                    "GenerationResult.from_columns: token_versions differ in length from token_ids"
                )
            result.token_versions = token_versions
        return result

    @property
    def newest_version(self) -> int:
        """The newest version behind any of its tokens (``version`` when they all share it)."""
        if self.token_versions is None:
            return self.version
        return max((max(row) for row in self.token_versions if row), default=self.version)

    @property
    def has_texts(self) -> bool:
        """Every completion carries its text (the engine detokenized them)."""
        return self.texts is not None and None not in self.texts

    def __len__(self) -> int:
        """How many completions."""
        return len(self.token_ids)


def sampled_versions(result: GenerationResult, i: int = 0) -> list[int]:
    """The version that sampled each token of ``result``'s completion ``i``."""
    if result.token_versions is not None:
        return list(result.token_versions[i])
    return [result.version] * len(result.token_ids[i])


def versions_column(per_token: list[int], version: int) -> list[int] | None:
    """A rollout's ``token_versions``: ``per_token``, or None where every token is at
    ``version`` (the rollout's own: nothing to carry)."""
    return per_token if any(v != version for v in per_token) else None


class PartedReward(float):
    """The total of a weighted reward list (``[[task.rewards]]``) that keeps each part's
    value: ``parts`` maps a part's name to what it returned (None: the part did not apply to
    this sample, TRL's rule). It is the float it totals to everywhere a reward is read;
    ``samples.jsonl`` writes its parts."""

    __slots__ = ("parts",)

    def __new__(cls, total: float, parts: dict[str, float | None]) -> PartedReward:
        reward = super().__new__(cls, total)
        reward.parts = parts
        return reward

    def __reduce__(self):  # the pickle protocol's name
        return PartedReward, (float(self), self.parts)


RolloutStatus = Literal["ok", "failed"]
# Why a rollout failed: its reward raised, returned no number or timed out (``RewardFailure``'s
# reasons), every scorer executor was lost while scoring it, or its environment failed the episode.
FailureKind = Literal["raised", "invalid", "timeout", "scorer_lost", "environment"]


@_pickled_by_fields
@dataclass(slots=True)  # one per completion: cheaper to build and to read
class Rollout:
    """One completion (or multi-turn episode) for one prompt, with everything training needs:
    a row of a ``Group``, built where a row is needed (a group holds columns, not these).

    ``completion_ids`` holds every token after the prompt; ``loss_mask`` is 1 for tokens the
    model generated and 0 for tokens an environment inserted (tool output, feedback), which
    are never trained on. ``behaviour_logprobs`` has the same length (0.0 where masked).
    """

    prompt_index: int  # the row's index in the training dataset (the epoch-unique key)
    prompt_ids: list[int]
    completion_ids: list[int]
    behaviour_logprobs: list[float]
    loss_mask: list[int]
    version: int  # policy version of the oldest weights that produced any of its tokens
    prompt: str = ""
    completion: str = ""
    row: dict[str, Any] = field(default_factory=dict)
    reward: float | None = None
    status: RolloutStatus = "ok"
    error: str | None = None
    finish_reason: str = "stop"
    num_turns: int = 1
    timings: dict[str, float] = field(default_factory=dict)
    failure: FailureKind | None = None  # set with status "failed", where the failure is made
    # The version that sampled each completion token (None: all at ``version``)
    token_versions: list[int] | None = None


@_pickled_by_fields
@dataclass(slots=True)
class Group:
    """The G rollouts of one prompt, as columns: one list per field, one entry per rollout.
    Advantages are computed within a group.

    A ``Rollout`` is a row view, built where a row is needed (iterating the group,
    ``ok_rollouts()``: the trainer's batch, a failed score) and never stored back: a change
    goes into the columns (``rewards``, ``fail``, ``without_failed``). A column that holds
    its default for every rollout is None, so a generated group carries nothing for it:
    ``loss_masks`` (every token generated: ones), ``statuses``, ``failures`` and ``errors``
    (none failed), ``num_turns`` (one turn each) and ``timings`` (none)."""

    prompt_index: int  # the row's index in the training dataset (the epoch-unique key)
    epoch: int
    row: dict[str, Any]  # the dataset row
    prompt_ids: list[list[int]]  # per rollout (a generated group repeats one list)
    prompts: list[str]  # per rollout, as the dataset (or the environment) gave it
    completion_ids: list[list[int]]  # every token after the prompt
    behaviour_logprobs: list[list[float]]  # same lengths (0.0 where masked)
    texts: list[str]  # the completions' text
    finish_reasons: list[str]
    versions: list[int]  # policy version of the oldest weights behind each rollout
    rewards: list[float | None]  # set by the scorer (None: not scored, or failed)
    loss_masks: list[list[int]] | None = None  # 0 where an environment inserted the token
    statuses: list[RolloutStatus] | None = None
    failures: list[FailureKind | None] | None = None
    errors: list[str | None] | None = None
    num_turns: list[int] | None = None
    timings: list[dict[str, float]] | None = None
    # per rollout, the version that sampled each token (None: all at the rollout's version)
    token_versions: list[list[int] | None] | None = None
    # Tokens to train on, counted where they were made (None: count them).
    num_tokens: int | None = field(default=None, compare=False)

    @classmethod
    def from_results(
        cls,
        picks: list[tuple[int, int]],
        prompt_ids: list[list[int]],
        rows: list[dict[str, Any]],
        prompt_key: str,
        results: list[GenerationResult],
        decode: Callable[[list[list[int]]], list[str]] | None,
    ) -> list[Group]:
        """The groups of one generate call's results, one per result: ``picks[i]`` is the
        ``(epoch, row index)`` of ``results[i]``, whose prompt is ``prompt_ids[i]`` (and its
        text ``rows[index][prompt_key]``). Each takes its completions' columns as the result
        holds them, with the engine's own texts or, where it gave none,
        ``decode(token_ids)``: a caller that may not decode (off the loop, where the
        tokenizer is not to be used) passes None and builds only results that all
        ``has_texts``; else this raises. One call a request, with no frame of its own per
        group; it reads nothing but its arguments (the controller runs it off its loop)."""
        groups = []
        for (epoch, index), ids_of_prompt, result in zip(picks, prompt_ids, results):
            ids, texts = result.token_ids, result.texts
            # (identity first: no Python frame per completion)
            if texts is None or None in texts:
                if decode is None:
                    raise ValueError(
                        f"Group.from_results: the result for row {index} has completions "
                        "without text and no decode was given (check has_texts first)"
                    )
                texts = decode(ids)
            row, n = rows[index], len(ids)
            groups.append(
                cls(
                    index,
                    epoch,
                    row,
                    [ids_of_prompt] * n,
                    [row[prompt_key]] * n,
                    ids,
                    result.logprobs,
                    texts,
                    result.finish_reasons,
                    [result.version] * n,
                    [None] * n,
                    token_versions=result.token_versions,
                    num_tokens=sum(map(len, ids)),
                )
            )
        return groups

    @classmethod
    def of_rollouts(cls, prompt_index: int, epoch: int, rollouts: list[Rollout]) -> Group:
        """The group of ``rollouts`` (an environment's episodes, a test's rows), its row
        the first rollout's; a column that holds its default for every rollout is None."""
        if not rollouts:
            raise ValueError(f"Group.of_rollouts: no rollouts for prompt {prompt_index}")

        def column(name: str, default: Callable[[Rollout], Any]) -> list | None:
            values = [getattr(r, name) for r in rollouts]
            return None if all(v == default(r) for v, r in zip(values, rollouts)) else values

        return cls(
            prompt_index,
            epoch,
            rollouts[0].row,
            [r.prompt_ids for r in rollouts],
            [r.prompt for r in rollouts],
            [r.completion_ids for r in rollouts],
            [r.behaviour_logprobs for r in rollouts],
            [r.completion for r in rollouts],
            [r.finish_reason for r in rollouts],
            [r.version for r in rollouts],
            [r.reward for r in rollouts],
            column("loss_mask", lambda r: [1] * len(r.completion_ids)),
            column("status", lambda r: "ok"),
            column("failure", lambda r: None),
            column("error", lambda r: None),
            column("num_turns", lambda r: 1),
            column("timings", lambda r: {}),
            column("token_versions", lambda r: None),
        )

    def __iter__(self) -> Iterator[Rollout]:
        """The rollouts, as row views built now (a change to one stays in it)."""
        return iter(self._rows())

    def ok_rollouts(self) -> list[Rollout]:
        """The successfully scored rollouts, as fresh row views (the caller owns them)."""
        rows = self._rows()
        return rows if self.statuses is None else [r for r in rows if r.status == "ok"]

    def _rows(self) -> list[Rollout]:
        """One comprehension, with each default column's value made inline (the trainer
        builds its batch this way every step: no Python call per row)."""
        index, row = self.prompt_index, self.row
        return [
            Rollout(
                index,
                prompt_ids,
                ids,
                logprobs,
                [1] * len(ids) if mask is None else mask,
                version,
                prompt,
                text,
                row,
                reward,
                "ok" if status is None else status,
                error,
                finish,
                1 if turns is None else turns,
                {} if timings is None else timings,
                failure,
                token_versions,
            )
            for (
                prompt_ids,
                ids,
                logprobs,
                mask,
                version,
                prompt,
                text,
                reward,
                status,
                error,
                finish,
                turns,
                timings,
                failure,
                token_versions,
            ) in zip(*self._row_columns())
        ]

    def _row_columns(self) -> tuple:
        """Every column in ``Rollout``'s field order (from its ``prompt_ids``), a default
        one as None for each row."""
        return (
            self.prompt_ids,
            self.completion_ids,
            self.behaviour_logprobs,
            self.loss_masks or repeat(None),
            self.versions,
            self.prompts,
            self.texts,
            self.rewards,
            self.statuses or repeat(None),
            self.errors or repeat(None),
            self.finish_reasons,
            self.num_turns or repeat(None),
            self.timings or repeat(None),
            self.failures or repeat(None),
            self.token_versions or repeat(None),
        )

    def fail(self, i: int, kind: FailureKind, error: str) -> None:
        """Mark rollout ``i`` failed (``kind``, with its ``error``); it keeps no reward."""
        n = len(self.texts)
        if self.statuses is None:
            self.statuses = ["ok"] * n
        if self.failures is None:
            self.failures = [None] * n
        if self.errors is None:
            self.errors = [None] * n
        self.statuses[i], self.failures[i], self.errors[i] = "failed", kind, error
        self.rewards[i] = None

    def without_failed(self) -> Group:
        """A new group of this one's successful rollouts (all of them when none failed)."""
        if self.statuses is None:
            return self
        return Group.of_rollouts(self.prompt_index, self.epoch, self.ok_rollouts())

    @property
    def size(self) -> int:
        return len(self.texts)

    @property
    def min_version(self) -> int:
        return min(self.versions)

    @property
    def completion_tokens(self) -> int:
        """Tokens to train on (the loss mask's ones)."""
        if self.loss_masks is not None:
            return sum(map(sum, self.loss_masks))
        if self.num_tokens is not None:
            return self.num_tokens
        return sum(map(len, self.completion_ids))

    @property
    def all_ok(self) -> bool:
        """No rollout failed."""
        return self.statuses is None or "failed" not in self.statuses

    @property
    def num_failed(self) -> int:
        return 0 if self.statuses is None else self.statuses.count("failed")
