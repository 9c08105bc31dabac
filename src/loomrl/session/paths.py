"""A job's local paths made absolute on the controller, before any executor starts.

A Ray actor runs in its raylet's working folder, not the controller's: a relative
``model.path``, data file or run folder would name another folder there (or none), and the
run folder would split (the controller's metrics here, the trainer's checkpoints there).
``absolute_paths`` resolves each one from the controller's working folder, so every
executor reads and writes the same paths (they must still be on storage its node sees:
docs/cluster.md). Specs that are not local paths are kept: ``tiny:`` models, ``hf:``
datasets, fsspec URLs (``s3://...``).
"""

from __future__ import annotations

import os
from pathlib import Path

from loomrl.config import JobConfig


def is_local_path(spec: str) -> bool:
    """Whether ``spec`` names a local file or folder (not ``tiny:``, ``hf:`` or a URL)."""
    return not (spec.startswith(("tiny:", "hf:")) or "://" in spec)


def absolute(spec: str | None) -> str | None:
    """``spec`` absolute from this process's working folder, where it is a local path."""
    if spec is None or not is_local_path(spec):
        return spec
    return os.path.abspath(os.path.expanduser(spec))


def absolute_paths(cfg: JobConfig, run_dir: Path) -> JobConfig:
    """``cfg`` with ``output_dir`` = ``run_dir`` and ``model.path``, ``data.train``,
    ``data.eval``, a ``files`` transport's ``path`` and the ``path`` of each reward model or
    judge (``task.scorer``, ``[[task.rewards]]``) absolute (a copy; ``cfg`` is unchanged)."""
    model = cfg.model.model_copy(update={"path": absolute(cfg.model.path)})
    data = cfg.data.model_copy(
        update={"train": absolute(cfg.data.train), "eval": absolute(cfg.data.eval)}
    )
    update = {"output_dir": absolute(str(run_dir)), "model": model, "data": data}
    transport = cfg.weight_sync.transport
    if transport.type == "files" and transport.path is not None:
        moved = transport.model_copy(update={"path": absolute(transport.path)})
        update["weight_sync"] = cfg.weight_sync.model_copy(update={"transport": moved})
    update["task"] = _task_paths(cfg.task)
    return cfg.model_copy(update=update)


def _scorer_paths(scorer):
    """A model or judge scorer with its folder absolute (a function's path is an import path)."""
    if scorer is None or scorer.type not in ("model", "judge"):
        return scorer
    return scorer.model_copy(update={"path": absolute(scorer.path)})


def _task_paths(task):
    rewards = [r.model_copy(update={"scorer": _scorer_paths(r.scorer)}) for r in task.rewards]
    return task.model_copy(update={"scorer": _scorer_paths(task.scorer), "rewards": rewards})
