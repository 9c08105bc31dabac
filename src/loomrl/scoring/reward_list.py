"""The task's reward as one callable: a single function, TRL's batched signature through an
adapter, or a weighted list of functions (``[[task.rewards]]``) with each one's values kept
for its own metric. A list with a reward-model or judge part is scored whole in the scorer
executors (``loomrl.scoring.weighted``); here it is only ``scores_in_executors``' stand-in.

Whatever the form, the scorer calls one ``fn(prompt, completion, **row) -> float`` (sync or
async), so timeouts, failure counting and the batch paths in ``loomrl.scoring.calls`` apply
unchanged. A list's total is ``sum(weight * value)`` over the parts that answered: a part
that returns None does not apply to that sample (TRL's rule: its ``nansum``), and a sample no
part answered gets 0.0, as TRL gives it, counted in ``reward/unanswered`` and warned about. A
part that raises or returns what is not a number (nor None) fails the rollout with that
part's name in the message. The total is a ``PartedReward``: it keeps each part's value for
``samples.jsonl``.

A TRL-signature reward gets its arguments as TRL's trainer passes them: lists of one, the
prompt and completion as messages when the prompt goes through the chat template (a message
list, or a text with ``data.system_prompt``), else as text.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from loomrl.config_common import DataConfig
from loomrl.scoring.calls import RewardFailure, UserCodeError, check_value, load_object
from loomrl.scoring.config import RewardSpec, TaskConfig
from loomrl.types import PartedReward


class RewardPartError(Exception):
    """A part of a reward list raised (the user's error is the cause)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


def is_trl_signature(fn: Callable[..., Any]) -> bool:
    """TRL's reward functions take ``completions`` (plural) by keyword; loomrl's take
    ``completion``. A parameter named ``completions`` is unambiguous."""
    try:
        return "completions" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin or C callable without a signature
        return False


def trl_adapter(
    fn: Callable[..., Any], name: str, data: DataConfig | None = None
) -> Callable[..., Any]:
    """``fn(prompts, completions, **columns) -> list[float]`` as loomrl's one-completion
    ``fn(prompt, completion, **row) -> float``: every argument a list of one, as TRL's
    trainer passes them. A prompt that goes through the chat template (``data``'s rule; a
    message list when no ``data`` is given) is passed as its messages (with
    ``data.system_prompt``) and the completion as ``[{"role": "assistant", "content":
    text}]``, as TRL does for conversational data; a plain text prompt and its completion as
    text."""

    def arguments(prompt: Any, completion: str, row: dict[str, Any]) -> dict[str, Any]:
        chat = data.templated(prompt) if data is not None else isinstance(prompt, list)
        if chat:
            prompt = data.messages(prompt) if data is not None else prompt
            completion = [{"role": "assistant", "content": completion}]
        return {
            "prompts": [prompt],
            "completions": [completion],
            **{k: [v] for k, v in row.items()},
        }

    def only(values: Any) -> Any:
        if not isinstance(values, (list, tuple)) or len(values) != 1:
            raise RewardFailure(
                "invalid",
                f"TRL-signature reward {name!r} returned {_short(values)}, expected a "
                "list of one float per completion (it was given one)",
            )
        return values[0]

    if inspect.iscoroutinefunction(fn):

        async def call_async(prompt: Any, completion: str, **row: Any) -> Any:
            return only(await fn(**arguments(prompt, completion, row)))

        return call_async

    def call(prompt: Any, completion: str, **row: Any) -> Any:
        return only(fn(**arguments(prompt, completion, row)))

    return call


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 100 else text[:100] + "..."


class RewardStats:
    """Per-part sums, answers and Nones since the last ``drain``, and the samples no part
    answered; thread-safe (reward calls run on worker threads)."""

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self._lock = threading.Lock()
        self._reset()

    def _reset(self) -> None:
        n = len(self.names)
        self._sums, self._answers, self._nones = [0.0] * n, [0] * n, [0] * n
        self._scored = self._unanswered = 0

    def add(self, values: list[float | None]) -> None:
        """One sample's part values (None: the part did not apply)."""
        with self._lock:
            self._scored += 1
            for i, value in enumerate(values):
                if value is None:
                    self._nones[i] += 1
                else:
                    self._sums[i] += value
                    self._answers[i] += 1
            if all(value is None for value in values):
                self._unanswered += 1

    def drain(self) -> dict[str, float]:
        """Since the last drain (empty when nothing was scored): per part
        ``reward/<name>_sum`` and ``_count`` over the samples it answered and ``_none`` over
        those it did not; ``reward/unanswered`` when some sample had no answer at all."""
        with self._lock:
            sums, answers, nones = self._sums, self._answers, self._nones
            scored, unanswered = self._scored, self._unanswered
            self._reset()
        if not scored:
            return {}
        out: dict[str, float] = {}
        for name, total, count, none in zip(self.names, sums, answers, nones):
            out[f"reward/{name}_sum"], out[f"reward/{name}_count"] = total, float(count)
            out[f"reward/{name}_none"] = float(none)
        if unanswered:
            out["reward/unanswered"] = float(unanswered)
        return out


def _part(spec: RewardSpec, data: DataConfig | None) -> Callable[..., Any]:
    fn = resolve(spec.path)
    trl = spec.signature == "trl" or (spec.signature == "auto" and is_trl_signature(fn))
    return trl_adapter(fn, spec.label, data) if trl else fn


def resolve(path: str) -> Callable[..., Any]:
    fn = load_object(path)
    if not callable(fn):
        raise TypeError(f"reward {path!r} is not callable")
    return fn


def total_of(
    names: list[str], weights: list[float], values: list[float | None], stats: RewardStats
) -> PartedReward:
    """The weighted sum of the parts that answered (0.0 when none did, as TRL's ``nansum``),
    with each part's value kept; ``values`` go into ``stats``."""
    stats.add(values)
    total = sum(w * v for w, v in zip(weights, values) if v is not None)
    return PartedReward(total, dict(zip(names, values)))


def combine(specs: list[RewardSpec], data: DataConfig | None = None) -> Callable[..., Any]:
    """The weighted sum of ``specs`` as one reward function (async when any part is), with
    ``reward_stats`` (a ``RewardStats``) attached."""
    parts = [(spec.label, _part(spec, data)) for spec in specs]
    names, weights = [spec.label for spec in specs], [spec.weight for spec in specs]
    stats = RewardStats(names)

    if any(inspect.iscoroutinefunction(fn) for _, fn in parts):

        async def total_async(prompt: Any, completion: str, **row: Any) -> float:
            values = []
            for name, fn in parts:
                with _named_part(name):
                    value = fn(prompt, completion, **row)
                    value = await value if inspect.isawaitable(value) else value
                values.append(_checked(name, value))
            return total_of(names, weights, values, stats)

        total_async.reward_stats = stats  # type: ignore[attr-defined]
        return total_async

    def total(prompt: Any, completion: str, **row: Any) -> float:
        values = []
        for name, fn in parts:
            with _named_part(name):
                value = fn(prompt, completion, **row)
            values.append(_checked(name, value))
        return total_of(names, weights, values, stats)

    total.reward_stats = stats  # type: ignore[attr-defined]
    return total


@contextmanager
def _named_part(name: str) -> Iterator[None]:
    """A part's own error becomes a ``RewardPartError`` naming it; a ``RewardFailure``
    (a timeout, a value that is not a number) passes unchanged."""
    try:
        yield
    except RewardFailure:
        raise
    except Exception as err:  # noqa: BLE001 - user code: reported with the part's name
        raise RewardPartError(name) from err


def _checked(name: str, value: Any) -> float | None:
    if value is None:
        return None
    try:
        return check_value(value)
    except RewardFailure as failure:
        raise RewardFailure(failure.reason, f"reward {name!r}: {failure}") from None


def single(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A lone reward (``task.reward``) whose None means, as in a list, that it did not
    apply: the sample gets 0.0 (TRL's rule for a sample no reward answered), counted in
    ``reward/unanswered``; any other value is checked as before. ``.reward``: ``fn``."""
    stats = RewardStats([])

    def answered(value: Any) -> Any:
        if value is None:
            stats.add([])
            return 0.0
        return value

    if inspect.iscoroutinefunction(fn):

        async def one_async(prompt: Any, completion: str, **row: Any) -> Any:
            return answered(await fn(prompt, completion, **row))

        one_async.reward_stats, one_async.reward = stats, fn  # type: ignore[attr-defined]
        return one_async

    def one(prompt: Any, completion: str, **row: Any) -> Any:
        return answered(fn(prompt, completion, **row))

    one.reward_stats, one.reward = stats, fn  # type: ignore[attr-defined]
    return one


def scores_in_executors(specs: list[RewardSpec]) -> Callable[..., Any]:
    """The controller's stand-in for a list with a reward-model or judge part: such a list
    is scored whole in the scorer executors (``loomrl.scoring.weighted``), so the controller
    loads no model. Its function parts are loaded here all the same (a bad path fails at
    start-up), and its ``reward_stats`` tells the controller's ``Scorer`` to add up the
    per-part sums the executors send."""
    for spec in specs:
        if spec.scorer is None:
            _part(spec, None)

    def only_in_executors(prompt: Any, completion: str, **row: Any) -> float:
        raise RuntimeError(
            "a task.rewards list with a model or judge part is scored in scorer executors "
            "(loomrl.scoring.executor.start_scorer_executor); attach them with Scorer.attach"
        )

    only_in_executors.reward_stats = RewardStats([spec.label for spec in specs])  # type: ignore[attr-defined]
    return only_in_executors


def load_reward(task: TaskConfig, data: DataConfig | None = None) -> Callable[..., Any] | None:
    """The task's reward as one ``fn(prompt, completion, **row)``, or None for an
    environment task; ``data`` says which prompts a TRL-signature reward gets as messages."""
    if any(spec.scorer is not None for spec in task.rewards):
        return scores_in_executors(task.rewards)
    if task.rewards:
        return combine(task.rewards, data)
    if task.reward is None:
        return None
    fn = resolve(task.reward)
    return single(trl_adapter(fn, task.reward, data) if is_trl_signature(fn) else fn)


def drain_stats(fn: Any) -> dict[str, float]:
    """A reward list's per-part sums since the last call (empty for a single reward)."""
    stats = getattr(fn, "reward_stats", None)
    return stats.drain() if stats is not None else {}


__all__ = [
    "UserCodeError",
    "combine",
    "drain_stats",
    "is_trl_signature",
    "load_reward",
    "scores_in_executors",
    "single",
    "total_of",
    "trl_adapter",
]
