"""Plain data that passes between executors: no live objects, only lists, numbers, dicts.

Everything here is picklable, so the same controller drives threads (``local``) and Ray
actors without a rewrite.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, Literal


def _pickled_by_fields(cls: type) -> type:
    """Pickle instances as (class, fields in order), rebuilt by the positional __init__.

    A slotted dataclass otherwise pickles through dataclasses' Python-level
    ``__getstate__``/``__setstate__``: 128 rollouts took 0.43 ms to pickle and 0.44 ms to
    unpickle, against 0.24 and 0.18 ms this way, once on the controller and once in the
    trainer (on its critical path) every step of the ``process`` and ``ray`` runtimes."""
    get = operator.attrgetter(*(f.name for f in fields(cls)))

    def __reduce__(self):  # noqa: N807 - the pickle protocol's name
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
@dataclass(slots=True)  # one per completion: cheaper to build and to read
class Completion:
    token_ids: list[int]  # generated tokens, EOS included when sampled
    logprobs: list[float]  # behaviour log-prob of each sampled token at the sampling temperature
    finish_reason: Literal["stop", "length"]
    text: str | None = None  # the detokenized completion, when the engine made it (as vLLM does)


_token_ids, _logprobs_of, _finish_reason_of, _text_of = (
    operator.attrgetter(a) for a in ("token_ids", "logprobs", "finish_reason", "text")
)


class GenerationResult:
    """One request's completions, made by the weights of policy ``version``.

    An engine gives them as ``Completion`` objects (``GenerationResult(completions,
    version)``) or as columns, one list per field (``from_columns``: what the HF generator
    builds, with no object per completion to build, pickle, read and free on the
    controller's loop); ``completions`` and ``columns()`` read either form."""

    __slots__ = (
        "version",
        "weight_apply_s",
        "weight_metrics",
        "engine_metrics",
        "_completions",
        "_columns",
    )

    def __init__(
        self,
        completions: list[Completion] | None = None,
        version: int = 0,
        weight_apply_s: float = 0.0,
        weight_metrics: dict[str, float] | None = None,
        engine_metrics: dict[str, float] | None = None,
        *,
        _columns: tuple | None = None,
    ) -> None:
        self.version = version  # the policy version of the weights that produced every completion
        self.weight_apply_s = (
            weight_apply_s  # seconds the generator paused to apply updates before this call
        )
        self.weight_metrics = (
            {} if weight_metrics is None else weight_metrics
        )  # the generator's weight_sync/*
        self.engine_metrics = (
            {} if engine_metrics is None else engine_metrics
        )  # the engine's generation/* totals
        self._completions = [] if completions is None and _columns is None else completions
        self._columns = _columns

    @classmethod
    def from_columns(
        cls,
        token_ids: list[list[int]],
        logprobs: list[list[float]],
        finish_reasons: list[str],
        texts: list[str] | None,
        version: int,
    ) -> GenerationResult:
        """The completions as parallel lists (``texts`` None when the engine does not
        detokenize)."""
        if (
            not len(token_ids)
            == len(logprobs)
            == len(finish_reasons)
            == (len(texts) if texts is not None else len(token_ids))
        ):
            raise ValueError("GenerationResult.from_columns: the columns differ in length")
        return cls(version=version, _columns=(token_ids, logprobs, finish_reasons, texts))

    @property
    def completions(self) -> list[Completion]:
        """As ``Completion`` objects (built once from columns; from then on they are the result)."""
        if self._completions is None:
            ids, logprobs, finish, texts = self._columns
            self._completions = list(
                map(Completion, ids, logprobs, finish, texts or [None] * len(ids))
            )
            self._columns = None
        return self._completions

    @completions.setter
    def completions(self, completions: list[Completion]) -> None:
        self._completions, self._columns = completions, None

    def columns(self) -> tuple[list[list[int]], list[list[float]], list[str], list[str | None]]:
        """``(token_ids, logprobs, finish_reasons, texts)``, one entry per completion (a
        text is None where the engine did not detokenize)."""
        if self._columns is not None:
            ids, logprobs, finish, texts = self._columns
            return ids, logprobs, finish, texts if texts is not None else [None] * len(ids)
        cs = self._completions
        return (
            list(map(_token_ids, cs)),
            list(map(_logprobs_of, cs)),
            list(map(_finish_reason_of, cs)),
            list(map(_text_of, cs)),
        )

    @property
    def has_texts(self) -> bool:
        """Every completion carries its text (the engine detokenized them)."""
        if self._columns is not None:
            texts = self._columns[3]
            return texts is not None and None not in texts
        return None not in map(_text_of, self._completions)

    def __len__(self) -> int:
        """How many completions."""
        return len(self._columns[0]) if self._columns is not None else len(self._completions)

    def _key(self) -> tuple:
        return (
            self.columns(),
            self.version,
            self.weight_apply_s,
            self.weight_metrics,
            self.engine_metrics,
        )

    def __eq__(self, other: object) -> bool:
        return (
            self._key() == other._key() if isinstance(other, GenerationResult) else NotImplemented
        )

    __hash__ = None  # mutable, as the dataclass it was

    def __repr__(self) -> str:
        form = (
            f"columns={self._columns!r}"
            if self._columns is not None
            else f"completions={self._completions!r}"
        )
        return f"GenerationResult(version={self.version}, {form})"

    def __reduce__(self):
        return _generation_result, (
            self._completions,
            self.version,
            self.weight_apply_s,
            self.weight_metrics,
            self.engine_metrics,
            self._columns,
        )


def _generation_result(
    completions, version, weight_apply_s, weight_metrics, engine_metrics, columns
):
    return GenerationResult(
        completions, version, weight_apply_s, weight_metrics, engine_metrics, _columns=columns
    )


@dataclass
class WeightsApplied:
    """What a generator's ``apply_weights`` did: the version it holds after it, and the
    seconds it paused for (0.0 when nothing was applied)."""

    version: int
    apply_s: float = 0.0
    num_updates: int = 0
    weight_metrics: dict[str, float] = field(default_factory=dict)  # the subscriber's weight_sync/*


RolloutStatus = Literal["ok", "failed"]
# Why a rollout failed: its reward raised, returned no number or timed out (``RewardFailure``'s
# reasons), every scorer executor was lost while scoring it, or its environment failed the episode.
FailureKind = Literal["raised", "invalid", "timeout", "scorer_lost", "environment"]


@_pickled_by_fields
@dataclass(slots=True)  # one per completion: cheaper to build and to read
class Rollout:
    """One completion (or multi-turn episode) for one prompt, with everything training needs.

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


@_pickled_by_fields
@dataclass(slots=True)
class Completions:
    """One prompt's completions from one generate call, as columns: what a ``Group`` holds
    until something asks for its ``rollouts``. The controller's loop then builds one
    object per group, not one per completion (nor frees one per completion once it is
    trained): the trainer builds the rollouts it trains on, on its own thread."""

    prompt_ids: list[int]
    version: int  # of the weights that generated every one of them
    prompt: str
    row: dict[str, Any]
    completion_ids: list[list[int]]
    behaviour_logprobs: list[list[float]]
    texts: list[str]
    finish_reasons: list[str]
    rewards: list[float | None]  # set by the scorer
    num_tokens: int | None = (
        None  # sum of the completions' lengths, counted where they were made (None: count them)
    )

    def build(self, prompt_index: int) -> list[Rollout]:
        """The rollouts, as the controller built them from the completions (a loss mask of
        ones: every token was generated)."""
        return [
            Rollout(
                prompt_index,
                self.prompt_ids,
                ids,
                logprobs,
                [1] * len(ids),
                self.version,
                self.prompt,
                text,
                self.row,
                reward,
                "ok",
                None,
                finish,
            )
            for ids, logprobs, text, reward, finish in zip(
                self.completion_ids,
                self.behaviour_logprobs,
                self.texts,
                self.rewards,
                self.finish_reasons,
            )
        ]


_version, _reward, _loss_mask = (operator.attrgetter(a) for a in ("version", "reward", "loss_mask"))


class Group:
    """The G rollouts of one prompt. Advantages are computed within a group.

    Built from a generate call's completions (``from_results``), a group keeps them as
    columns (``Completions``) until ``rollouts`` is read; reading it builds the rollouts
    once and from then on they are the group (a scorer failure, a filter and any code that
    changes a rollout work on them). What the loop needs every step (``size``,
    ``min_version``, ``rewards``, ``completion_tokens``, ``all_ok``) reads either form
    without building anything; ``ok_rollouts()`` gives a trainer fresh rollouts without
    keeping them in the group."""

    __slots__ = ("prompt_index", "epoch", "_rollouts", "_columns")

    def __init__(
        self,
        prompt_index: int,
        epoch: int,
        rollouts: list[Rollout] | None = None,
        columns: Completions | None = None,
    ) -> None:
        if (rollouts is None) == (columns is None):
            raise TypeError("a Group holds either rollouts or columns")
        self.prompt_index, self.epoch = prompt_index, epoch
        self._rollouts, self._columns = rollouts, columns

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
        text ``rows[index][prompt_key]``). Each keeps its completions as columns, as the
        result holds them (or taken at C speed), with the engine's own texts or, where it
        gave none, ``decode(token_ids)``: a caller that may not decode (off the loop, where
        the tokenizer is not to be used) passes None and builds only results that all
        ``has_texts``; else this raises. One call a request, with no frame of its own per
        group; it reads nothing but its arguments (the controller runs it off its loop)."""
        groups = []
        for (epoch, index), ids_of_prompt, result in zip(picks, prompt_ids, results):
            columns = result._columns
            if columns is None or columns[3] is None:
                ids, logprobs, finish, texts = result.columns()
            else:
                ids, logprobs, finish, texts = columns
            if None in texts:  # (identity first: no Python frame per completion)
                if decode is None:
                    raise ValueError(
                        f"Group.from_results: the result for row {index} has completions "
                        "without text and no decode was given (check has_texts first)"
                    )
                texts = decode(ids)
            row = rows[index]
            groups.append(
                cls(
                    index,
                    epoch,
                    None,
                    Completions(
                        ids_of_prompt,
                        result.version,
                        row[prompt_key],
                        row,
                        ids,
                        logprobs,
                        texts,
                        finish,
                        [None] * len(ids),
                        sum(map(len, ids)),
                    ),
                )
            )
        return groups

    @property
    def columns(self) -> Completions | None:
        """The completions as columns, until the rollouts were built (then None)."""
        return self._columns

    @property
    def rollouts(self) -> list[Rollout]:
        if self._rollouts is None:
            self._rollouts, self._columns = self._columns.build(self.prompt_index), None
        return self._rollouts

    @rollouts.setter
    def rollouts(self, rollouts: list[Rollout]) -> None:
        self._rollouts, self._columns = rollouts, None

    def ok_rollouts(self) -> list[Rollout]:
        """The successfully scored rollouts; built afresh from columns (and not kept: the
        caller owns them), else the group's own."""
        if self._columns is not None:
            return self._columns.build(self.prompt_index)
        return [r for r in self._rollouts if r.status == "ok"]

    @property
    def size(self) -> int:
        return len(self._columns.texts) if self._columns is not None else len(self._rollouts)

    @property
    def min_version(self) -> int:
        if self._columns is not None:
            return self._columns.version
        return min(map(_version, self._rollouts))

    @property
    def rewards(self) -> list[float | None]:
        return (
            self._columns.rewards
            if self._columns is not None
            else list(map(_reward, self._rollouts))
        )

    @property
    def completion_tokens(self) -> int:
        """Tokens to train on (the loss mask's ones)."""
        columns = self._columns
        if columns is not None:
            return (
                columns.num_tokens
                if columns.num_tokens is not None
                else sum(map(len, columns.completion_ids))
            )
        return sum(map(sum, map(_loss_mask, self._rollouts)))

    @property
    def all_ok(self) -> bool:
        """No rollout failed (columns never hold a failure: failing one builds the rollouts)."""
        return self._columns is not None or all(r.status == "ok" for r in self._rollouts)

    @property
    def num_failed(self) -> int:
        return 0 if self._columns is not None else sum(r.status == "failed" for r in self._rollouts)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Group):
            return NotImplemented
        return (self.prompt_index, self.epoch, self._view()) == (
            other.prompt_index,
            other.epoch,
            other._view(),
        )

    def _view(self) -> list[Rollout]:
        """The rollouts, without building them into the group."""
        return (
            self._columns.build(self.prompt_index) if self._columns is not None else self._rollouts
        )

    __hash__ = None  # mutable, as the dataclass it was

    def __repr__(self) -> str:
        form = (
            f"columns={self._columns!r}"
            if self._columns is not None
            else f"rollouts={self._rollouts!r}"
        )
        return f"Group(prompt_index={self.prompt_index}, epoch={self.epoch}, {form})"

    def __reduce__(self):
        return Group, (self.prompt_index, self.epoch, self._rollouts, self._columns)
