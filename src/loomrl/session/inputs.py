"""What a run reads before any model loads: its datasets, checked against the model's
context, the task's environment class and the scorer; a bad one fails here, in seconds."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loomrl.chat import PromptEncoder
from loomrl.config import JobConfig
from loomrl.data import load_rows_with_places
from loomrl.device import resolve_device
from loomrl.envs.base import Environment
from loomrl.models import load_tokenizer
from loomrl.models.loading import model_context_length
from loomrl.prompt_fit import check_prompts, prompt_budget
from loomrl.scoring.calls import load_object
from loomrl.scoring.client import Scorer
from loomrl.session.reward_columns import check_reward_columns
from loomrl.training.checkpoint import checkpoint_step
from loomrl.training.precision import precision_policy

logger = logging.getLogger(__name__)

Rows = tuple[list[dict[str, Any]], list[str]]  # rows, and where each one is (file:line)


@dataclass(frozen=True)
class RunInputs:
    """What a run starts from, every part checked before any model loads."""

    train_rows: list[dict[str, Any]]
    eval_rows: list[dict[str, Any]]
    scorer: Scorer  # the controller's side of scoring; its executors attach at start
    env_factory: Callable[[], Any] | None  # one Environment per episode, for environment tasks
    tokenizer: Any
    max_prompt_tokens: int | None  # None when the model does not say its context
    resume_from: Path | None = None  # the checkpoint a resume starts from
    resume_state: dict[str, Any] | None = None  # and its state, loaded and verified
    # what the job computes in and why (loomrl.training.precision.precision_policy)
    precision: dict[str, str] = field(default_factory=dict)

    @property
    def purge_step(self) -> int | None:
        """The first step whose records a resume writes again (None: a fresh run)."""
        return checkpoint_step(self.resume_from) + 1 if self.resume_from is not None else None


def read_inputs(
    cfg: JobConfig, resume_from: Path | None, resume_state: dict[str, Any] | None
) -> RunInputs:
    """Load and check the datasets, the scorer, the environment class and the tokenizer."""
    datasets = load_datasets(cfg)
    (train_rows, _), (eval_rows, _) = datasets
    scorer = Scorer(cfg.task, cfg.data)
    check_reward_columns(cfg, list(datasets))
    env_factory = environment_factory(cfg)
    tokenizer = load_tokenizer(cfg.model.path)
    budget = check_prompt_lengths(cfg, tokenizer, datasets)
    precision = precision_policy(cfg.model, cfg.trainer, resolve_device(cfg.model.device))
    return RunInputs(
        train_rows,
        eval_rows,
        scorer,
        env_factory,
        tokenizer,
        budget,
        resume_from,
        resume_state,
        precision,
    )


def environment_factory(cfg: JobConfig):
    if cfg.task.environment is None:
        return None
    from loomrl.envs.chat import ChatEnvironment
    from loomrl.envs.tool_parsers import get_parser

    cls = load_object(cfg.task.environment)
    if not (isinstance(cls, type) and issubclass(cls, Environment | ChatEnvironment)):
        raise TypeError(
            f"task.environment {cfg.task.environment!r} is neither an Environment nor a "
            "ChatEnvironment subclass"
        )
    get_parser(cfg.task.chat.tool_parser)  # an unknown name fails here, in seconds
    args = dict(cfg.task.environment_args)
    return lambda: cls(**args)


def load_datasets(cfg: JobConfig) -> tuple[Rows, Rows]:
    train = load_rows_with_places(
        cfg.data.train, cfg.data.prompt_key, cfg.data.train_split, cfg.data.dataset_config
    )
    groups = cfg.algorithm.groups_per_step
    if len(train[0]) < groups:
        logger.warning(
            "%s has %d rows, fewer than algorithm.groups_per_step=%d: each step trains some prompts more than "
            "once; add rows or lower groups_per_step",
            cfg.data.train,
            len(train[0]),
            groups,
        )
    if not cfg.data.eval:
        return train, ([], [])
    rows, places = load_rows_with_places(
        cfg.data.eval, cfg.data.prompt_key, cfg.data.eval_split, cfg.data.dataset_config
    )
    return train, (rows[: cfg.data.max_eval_examples], places[: cfg.data.max_eval_examples])


def check_prompt_lengths(cfg: JobConfig, tokenizer, datasets: tuple[Rows, Rows]) -> int | None:
    """Every prompt plus max_new_tokens fits the model's context (or will be cut to fit);
    returns the prompt budget in tokens (None when the model does not say its context)."""
    budget = prompt_budget(model_context_length(cfg.model.path), cfg.generation.max_new_tokens)
    encode = PromptEncoder(
        tokenizer, cfg.data, cfg.model.path
    ).encode_one  # (templated as the controller does)
    for rows, places in datasets:
        check_prompts(
            rows,
            places,
            encode,
            cfg.data.prompt_key,
            budget,
            cfg.data.truncate_prompts,
            cfg.data.max_prompt_bytes,
        )
    return budget
