"""Job: the public one-call API. Built from keyword arguments or a TOML file.

import loomrl
job = loomrl.Job(model="tiny:llama", dataset="examples/arithmetic/train.jsonl",
                 reward="examples.arithmetic.reward:exact_match", group_size=8, max_staleness=2)
result = job.run()

Any config key is a keyword, in loomrl's spelling or TRL's (``learning_rate=1e-6``,
``num_generations=8``, ``reward_funcs=[f, g]``, ``reward_weights=[1, 0.2]``): see
``loomrl.job_args`` and docs/python.md.
"""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from loomrl.config import JobConfig, apply_overrides, build_config, load_config, parse_override
from loomrl.job_args import apply_keywords, base_raw, translated
from loomrl.run_folder import JobResult, default_run_dir
from loomrl.scoring.calls import is_registered

__all__ = ["Job", "JobResult", "default_run_dir", "load_run_config", "resume_job"]

logger = logging.getLogger(__name__)


class Job:
    """One RL training run: ``Job(config)``, ``Job(**keywords)``, ``Job(config, **keywords)``
    or ``Job.from_toml(path)``."""

    def __init__(
        self,
        config: JobConfig | str | Path | dict | None = None,
        *,
        overrides: list[str] | None = None,
        **kwargs: Any,
    ) -> None:
        """``config``: the job to start from (a ``JobConfig``, a job file's path or a dict;
        none: the defaults); ``kwargs``: keys to set on it, by loomrl's or TRL's names
        (``loomrl.job_args``); ``overrides``: ``key.path=value`` strings, applied last."""
        if isinstance(config, JobConfig) and not kwargs and not overrides:
            self.config = config
            return
        raw, source = base_raw(config)
        raw = apply_overrides(apply_keywords(raw, kwargs), overrides or [])
        self.config = build_config(raw, source + translated(kwargs))
        check_reward_reachable(self.config)

    @classmethod
    def from_toml(cls, path: str | Path, overrides: list[str] | None = None) -> Job:
        return cls(load_config(path, overrides))

    def run(
        self,
        *,
        resume: bool = False,
        overwrite: bool = False,
        from_step: int | None = None,
        on_record: Callable[[dict[str, Any]], None] | None = None,
        progress: bool = True,
    ) -> JobResult:
        """Train; with ``resume=True`` continue from the run folder's latest checkpoint.

        A run folder that already holds a run is refused unless ``overwrite=True``
        (``--overwrite``), which replaces it; see docs/runs.md. ``on_record(record)`` is
        called on the controller's loop with each record metrics.jsonl gets, as a read-only
        mapping (copy it to keep a changed one). ``progress``: draw a step progress bar (in
        a terminal or a notebook, ``loomrl.progress``)."""
        from loomrl.progress import StepProgress
        from loomrl.session import run_job

        if not progress:
            return run_job(
                self.config,
                resume=resume,
                overwrite=overwrite,
                from_step=from_step,
                on_record=on_record,
            )
        with StepProgress(self.config.trainer.num_steps, then=on_record) as bar:
            return run_job(
                self.config,
                resume=resume,
                overwrite=overwrite,
                from_step=from_step,
                on_record=bar.on_record,
            )


def check_reward_reachable(config: JobConfig) -> None:
    """Functions registered in this process (``Job(reward=fn)`` with a lambda, a closure or
    a function of ``__main__``) reach scorers on the local runtime only."""
    if config.runtime == "local":
        return
    paths = [config.task.reward, *(spec.path for spec in config.task.rewards)]
    for path in paths:
        if path is not None and is_registered(path):
            raise ValueError(
                f"Job(reward=...) got a function that is not importable by path ({path}): runtime="
                f"{config.runtime!r} scores in other processes, which import the reward by 'module:function'; "
                "define it at the top level of an importable module and pass that, or use runtime='local'"
            )


# Keys a resume cannot change: the checkpoint holds weights of this model (and adapter), in
# this sharding, in this run folder. Compared as parsed key paths and as resulting values.
RESUME_FIXED = (("model",), ("trainer", "parallel"), ("name",), ("output_dir",), ("seed",))
# Keys a resume may change without changing what the run computes.
RESUME_NEUTRAL = (
    "trainer.num_steps",
    "checkpoint.",
    "eval.",
    "logging.",
    "faults.",
    "runtime",
    "ray.",
    "scheduler.",
    "event_loop",
)
_MISSING = object()


def _value_at(raw: Any, path: tuple[str, ...]) -> Any:
    for part in path:
        if not isinstance(raw, dict) or part not in raw:
            return _MISSING
        raw = raw[part]
    return raw


def _check_fixed_keys(before: dict[str, Any], after: dict[str, Any], overrides: list[str]) -> None:
    """Refuse overrides that change a ``RESUME_FIXED`` value, however they are spelt
    (``.seed=7``, ``model={...}``, ``trainer={parallel=...}``): the values before and after
    are compared, as written and, where they differ, as validated (``parallel = "single"``
    is the table it stands for)."""
    moved = [p for p in RESUME_FIXED if _value_at(before, p) != _value_at(after, p)]
    if not moved:
        return
    try:
        old, new = build_config(before).model_dump(), build_config(after).model_dump()
    except ValueError:  # the override does not even validate: it changed the value
        old = new = None
    moved = [p for p in moved if old is None or _value_at(old, p) != _value_at(new, p)]
    if not moved:
        return
    fixed = moved[0]
    for text in overrides:
        path = tuple(parse_override(text)[0])
        if path[: len(fixed)] == fixed or fixed[: len(path)] == path:
            key = ".".join(path if len(path) > len(fixed) else fixed)
            raise ValueError(
                f"resume override {text!r}: {key} cannot change on resume (the checkpoints hold "
                "this run's model, sharding and folder); start a new run instead"
            )
    raise AssertionError(f"{fixed} changed without an override naming it")


def load_run_config(run_dir: str | Path, overrides: list[str] | None = None) -> JobConfig:
    """The resolved config a run folder was started with, with ``overrides`` (``key=value``)
    applied: those that would make its checkpoints unusable are refused; those that change
    what the run computes (a learning rate, a loss) are allowed with a warning."""
    path = Path(run_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir} is not a loomrl run folder (no config.json)")
    raw = json.loads(path.read_text())
    raw["output_dir"] = str(run_dir)
    overrides = list(overrides or [])
    changed = apply_overrides(copy.deepcopy(raw), overrides)
    _check_fixed_keys(raw, changed, overrides)
    for text in overrides:
        key = ".".join(parse_override(text)[0])
        if not key.startswith(RESUME_NEUTRAL):
            logger.warning(
                "resume override %s changes what the run computes: the steps after the checkpoint "
                "are not those the run would have taken",
                text,
            )
    return build_config(changed, str(path))


def resume_job(
    run_dir: str | Path,
    on_record: Callable[[dict[str, Any]], None] | None = None,
    from_step: int | None = None,
    overrides: list[str] | None = None,
    progress: bool = True,
) -> JobResult:
    """Continue the run in ``run_dir`` from its newest checkpoint, or that of ``from_step``,
    with ``overrides`` (e.g. ``["trainer.num_steps=400"]`` to train on past the end)."""
    cfg = load_run_config(run_dir, overrides)
    return Job(cfg).run(resume=True, from_step=from_step, on_record=on_record, progress=progress)
