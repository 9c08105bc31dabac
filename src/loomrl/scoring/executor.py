"""Scorer executors by kind: what ``start_scorer_executor`` builds for a task.

``task.reward`` (or ``[task.scorer] type = "function"``) runs a Python function in a
``FunctionScorer`` (``scoring/function.py``); ``type = "model"`` a frozen reward model
(``scoring/model.py``) and ``type = "judge"`` a frozen generative judge
(``scoring/judge.py``); a ``[[task.rewards]]`` list with a model or judge part is scored
whole by a ``WeightedScorer`` (``scoring/weighted.py``). Every kind answers the same
``ScorerEndpoints`` (``scoring/base.py``) with the same outcomes, so the controller's ``Scorer``, supervision
(restart when killed, deadlines) and failure accounting see one kind of scorer executor.
"""

from __future__ import annotations

from loomrl.config_common import DataConfig
from loomrl.sandbox.config import SandboxConfig
from loomrl.scoring.base import ScorerEndpoints
from loomrl.scoring.config import TaskConfig
from loomrl.scoring.function import start_function_scorer
from loomrl.scoring.judge import JudgeScorer
from loomrl.scoring.model import RewardModelScorer
from loomrl.scoring.weighted import WeightedScorer


def start_scorer_executor(
    task: TaskConfig, sandbox: SandboxConfig | None, data: DataConfig | None = None
) -> ScorerEndpoints:
    """The scorer executor ``task`` asks for (module-level, so a ``functools.partial`` of it
    pickles to a process or an actor): a reward function's, a reward model's, a judge's, or a
    weighted list's that holds a model or judge. ``data``: how prompts are rendered (a
    TRL-signature reward gets templated ones as messages)."""
    if any(spec.scorer is not None for spec in task.rewards):
        return WeightedScorer(task, sandbox, data)
    kind = task.scorer.type if task.scorer is not None else "function"
    if kind == "model":
        return RewardModelScorer(task.scorer)
    if kind == "judge":
        return JudgeScorer(task.scorer)
    return start_function_scorer(task, sandbox, data)
