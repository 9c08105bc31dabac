"""The task's reward as one callable: a single function, TRL's batched signature through an
adapter, or a weighted list of functions (``[[task.rewards]]``) with each one's values kept
for its own metric. A list with a reward-model or judge part is scored whole in the scorer
executors (``loomrl.scoring.weighted``); here it is only ``scores_in_executors``' stand-in.

Whatever the form, the scorer calls one ``fn(prompt, completion, **row) -> float`` (sync or
async), so timeouts, failure counting and the batch paths in ``loomrl.scoring.calls`` apply
unchanged. A list's total is ``sum(weight * value)``; a part that raises or returns what is
not a number fails the rollout with that part's name in the message.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from loomrl.scoring.calls import RewardFailure, UserCodeError, check_value, load_object
from loomrl.scoring.config import RewardSpec, TaskConfig


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


def trl_adapter(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    """``fn(prompts, completions, **columns) -> list[float]`` as loomrl's one-completion
    ``fn(prompt, completion, **row) -> float``: every argument a list of one, as TRL's
    trainer passes them (a completion as ``[{"role": "assistant", "content": text}]`` when
    the prompt is a list of messages, as TRL does for conversational data)."""

    def arguments(prompt: Any, completion: str, row: dict[str, Any]) -> dict[str, Any]:
        wrapped = (
            [{"role": "assistant", "content": completion}]
            if isinstance(prompt, list)
            else completion
        )
        return {"prompts": [prompt], "completions": [wrapped], **{k: [v] for k, v in row.items()}}

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
    """Per-part sums and counts since the last ``drain``, thread-safe (reward calls run on
    worker threads)."""

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self._lock = threading.Lock()
        self._sums = [0.0] * len(names)
        self._count = 0

    def add(self, values: list[float]) -> None:
        with self._lock:
            self._count += 1
            for i, value in enumerate(values):
                self._sums[i] += value

    def drain(self) -> dict[str, float]:
        """``reward/<name>_sum`` and ``reward/<name>_count`` since the last drain (empty when none)."""
        with self._lock:
            sums, count, self._sums, self._count = (
                self._sums,
                self._count,
                [0.0] * len(self.names),
                0,
            )
        if not count:
            return {}
        return {
            **{f"reward/{n}_sum": s for n, s in zip(self.names, sums)},
            **{f"reward/{n}_count": float(count) for n in self.names},
        }


def _part(spec: RewardSpec) -> Callable[..., Any]:
    fn = resolve(spec.path)
    trl = spec.signature == "trl" or (spec.signature == "auto" and is_trl_signature(fn))
    return trl_adapter(fn, spec.label) if trl else fn


def resolve(path: str) -> Callable[..., Any]:
    fn = load_object(path)
    if not callable(fn):
        raise TypeError(f"reward {path!r} is not callable")
    return fn


def combine(specs: list[RewardSpec]) -> Callable[..., Any]:
    """The weighted sum of ``specs`` as one reward function (async when any part is), with
    ``reward_stats`` (a ``RewardStats``) attached."""
    parts = [(spec.label, spec.weight, _part(spec)) for spec in specs]
    stats = RewardStats([name for name, _, _ in parts])

    def finish(values: list[float]) -> float:
        stats.add(values)
        return sum(weight * value for (_, weight, _), value in zip(parts, values))

    if any(inspect.iscoroutinefunction(fn) for _, _, fn in parts):

        async def total_async(prompt: Any, completion: str, **row: Any) -> float:
            values = []
            for name, _, fn in parts:
                with _named_part(name):
                    value = fn(prompt, completion, **row)
                    value = await value if inspect.isawaitable(value) else value
                values.append(_checked(name, value))
            return finish(values)

        total_async.reward_stats = stats  # type: ignore[attr-defined]
        return total_async

    def total(prompt: Any, completion: str, **row: Any) -> float:
        values = []
        for name, _, fn in parts:
            with _named_part(name):
                value = fn(prompt, completion, **row)
            values.append(_checked(name, value))
        return finish(values)

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


def _checked(name: str, value: Any) -> float:
    try:
        return check_value(value)
    except RewardFailure as failure:
        raise RewardFailure(failure.reason, f"reward {name!r}: {failure}") from None


def scores_in_executors(specs: list[RewardSpec]) -> Callable[..., Any]:
    """The controller's stand-in for a list with a reward-model or judge part: such a list
    is scored whole in the scorer executors (``loomrl.scoring.weighted``), so the controller
    loads no model. Its function parts are loaded here all the same (a bad path fails at
    start-up), and its ``reward_stats`` tells the controller's ``Scorer`` to add up the
    per-part sums the executors send."""
    for spec in specs:
        if spec.scorer is None:
            _part(spec)

    def only_in_executors(prompt: Any, completion: str, **row: Any) -> float:
        raise RuntimeError(
            "a task.rewards list with a model or judge part is scored in scorer executors "
            "(loomrl.scoring.executor.start_scorer_executor); attach them with Scorer.attach"
        )

    only_in_executors.reward_stats = RewardStats([spec.label for spec in specs])  # type: ignore[attr-defined]
    return only_in_executors


def load_reward(task: TaskConfig) -> Callable[..., Any] | None:
    """The task's reward as one ``fn(prompt, completion, **row)``, or None for an
    environment task."""
    if any(spec.scorer is not None for spec in task.rewards):
        return scores_in_executors(task.rewards)
    if task.rewards:
        return combine(task.rewards)
    if task.reward is None:
        return None
    fn = resolve(task.reward)
    return trl_adapter(fn, task.reward) if is_trl_signature(fn) else fn


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
    "trl_adapter",
]
