"""The dataset columns a reward function takes, checked against every row before any model
loads: a reward ``fn(prompt, completion, answer)`` on rows without ``answer`` is an error
naming the row, the reward and the row's columns in a second, not a failed rollout after the
model has loaded."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from loomrl.config import JobConfig
from loomrl.data import DatasetError
from loomrl.scoring.function import function_task
from loomrl.scoring.reward_list import is_trl_signature, resolve

# What a TRL-signature reward is given besides the row's columns (TRL's own arguments; one
# loomrl does not pass fails in the call, where the reward's error says so).
TRL_ARGUMENTS = frozenset(
    {"prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric"}
)
# What a loomrl reward is never given from the row (the prompt and completion come first).
NOT_COLUMNS = frozenset({"prompt", "completion"})


def reward_paths(cfg: JobConfig) -> list[tuple[str, str]]:
    """The import paths of the task's reward functions (not its model or judge scorers),
    each with its ``signature`` ('auto', 'loomrl' or 'trl')."""
    task = function_task(cfg.task)
    paths = [(task.reward, "auto")] if task.reward is not None else []
    return paths + [(spec.path, spec.signature) for spec in task.rewards if spec.path is not None]


def needed_columns(fn: Callable[..., Any], signature: str = "auto") -> list[str]:
    """The parameters of ``fn`` that only a row's columns can fill (no default), in order."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin or C callable: nothing to read
        return []
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    if signature == "trl" or (signature == "auto" and is_trl_signature(fn)):
        given = TRL_ARGUMENTS
    else:
        positional = [p for p in params if p.kind != inspect.Parameter.KEYWORD_ONLY]
        given = NOT_COLUMNS | {p.name for p in positional[:2]}
    return [
        p.name
        for p in params
        if p.kind in named and p.default is inspect.Parameter.empty and p.name not in given
    ]


def check_reward_columns(
    cfg: JobConfig, datasets: list[tuple[list[dict[str, Any]], list[str]]]
) -> None:
    """Every row of ``datasets`` (rows and their places) has the columns each reward takes."""
    for path, signature in reward_paths(cfg):
        needed = needed_columns(resolve(path), signature)
        if not needed:
            continue
        for rows, places in datasets:
            for row, place in zip(rows, places):
                missing = [name for name in needed if name not in row]
                if missing:
                    raise DatasetError(
                        f"{place}: the reward {path!r} takes {', '.join(map(repr, missing))}, "
                        f"which this row has no column for (its columns: {sorted(row)}); add the "
                        "column, or give the parameter a default (or take **kwargs) in the reward"
                    )
