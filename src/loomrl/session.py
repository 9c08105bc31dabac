"""Assembles one run: run folder, data, executors, controller, checkpoints, final model."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from loomrl.config import JobConfig
from loomrl.controller import Controller, Counters
from loomrl.data import PromptStream, load_rows
from loomrl.envs.scorer import Scorer
from loomrl.job import JobResult, default_run_dir
from loomrl.models import load_tokenizer
from loomrl.runtime.local import LocalRuntime
from loomrl.telemetry.metrics import MetricsLogger
from loomrl.training.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    load_checkpoint,
    restore_rng_state,
    rng_state,
)
from loomrl.training.executor import TrainerExecutor, build_generator
from loomrl.weights.transports import make_transport

logger = logging.getLogger(__name__)


def _transport_kwargs(cfg: JobConfig, run_dir: Path) -> dict[str, Any]:
    ws = cfg.weight_sync
    if ws.transport == "files":
        return {"path": ws.path or str(run_dir / "weight_updates"), "keep_fulls": ws.keep_fulls}
    if ws.transport == "torch_dist":
        raise ValueError(
            "weight_sync.transport='torch_dist' needs one process per executor; the local "
            "runtime runs executors as threads: use 'inproc' or 'shm' here"
        )
    return {}


def _environment_factory(cfg: JobConfig):
    if cfg.task.environment is None:
        return None
    from loomrl.envs.base import Environment
    from loomrl.envs.reward import load_object

    cls = load_object(cfg.task.environment)
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise TypeError(f"task.environment {cfg.task.environment!r} is not an Environment subclass")
    args = dict(cfg.task.environment_args)
    return lambda: cls(**args)


def _restore(path: Path, controller_kwargs: dict[str, Any], stream: PromptStream) -> dict[str, Any]:
    """Restore the controller side (data cursor, counters, RNG) from a verified checkpoint;
    returns the trainer's state for the trainer executor to load."""
    state = load_checkpoint(path)
    ctl = state["controller"]
    stream.load_state_dict(ctl["stream"])
    counters = Counters(**ctl["counters"])
    counters.generated -= ctl["in_flight"]  # lost in the crash; they will be regenerated
    counters.lost_on_resume += ctl["in_flight"]
    controller_kwargs.update(version=ctl["version"], counters=counters)
    restore_rng_state(state["rng"])
    logger.info("resumed from %s at version %d", path, ctl["version"])
    return state["trainer"]


def run_job(
    cfg: JobConfig,
    *,
    resume: bool = False,
    on_record: Callable[[dict[str, Any]], None] | None = None,
) -> JobResult:
    import torch

    run_dir = default_run_dir(cfg)
    checkpoint_root = run_dir / "checkpoints"
    resume_from = latest_checkpoint(checkpoint_root) if resume else None
    if resume and resume_from is None:
        raise CheckpointError(f"no checkpoint under {checkpoint_root}; nothing to resume")
    # Validate everything cheap before loading any model.
    train_rows = load_rows(cfg.data.train, cfg.data.prompt_key)
    eval_rows = load_rows(cfg.data.eval, cfg.data.prompt_key)[: cfg.data.max_eval_examples] if cfg.data.eval else []
    scorer = Scorer(cfg.task)
    env_factory = _environment_factory(cfg)
    tokenizer = load_tokenizer(cfg.model.path)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(cfg.to_json())
    torch.manual_seed(cfg.seed)

    from loomrl.sandbox.default import (
        close_default_pool,
        configure_default_pool,
        default_pool_metrics,
    )

    configure_default_pool(cfg.sandbox)  # reward code that calls default_pool() gets the job's settings
    runtime = LocalRuntime(torch_threads=1)
    transport = make_transport(cfg.weight_sync.transport, **_transport_kwargs(cfg, run_dir))
    metrics = MetricsLogger(run_dir)
    try:
        trainer = runtime.start("trainer", lambda: TrainerExecutor(cfg, transport.sender()))
        generators = [
            runtime.start(f"generator{i}", lambda i=i: build_generator(cfg, transport.receiver(i)))
            for i in range(cfg.generation.num_generators)
        ]
        stream = PromptStream(len(train_rows), cfg.seed, cfg.data.shuffle)
        kwargs: dict[str, Any] = {}
        trainer_state = _restore(resume_from, kwargs, stream) if resume_from is not None else None
        controller = Controller(
            cfg, trainer=trainer, generators=generators, scorer=scorer, tokenizer=tokenizer,
            train_rows=train_rows, eval_rows=eval_rows, stream=stream, metrics=metrics,
            on_record=on_record, env_factory=env_factory,
            extra_metrics=default_pool_metrics, **kwargs,
        )

        async def checkpoint(step: int) -> None:
            extra = {"controller": controller.state_dict(), "rng": rng_state(), "config": json.loads(cfg.to_json())}
            await trainer.call("save_checkpoint", str(checkpoint_root), step, extra, cfg.checkpoint.keep)

        async def main() -> dict[str, Any]:
            if trainer_state is not None:
                await trainer.call("load_state_dict", trainer_state)
            summary = await controller.run(checkpoint=checkpoint)
            await trainer.call("save_pretrained", str(run_dir / "final"))
            return summary

        summary = asyncio.run(main())
        summary["run_dir"] = str(run_dir)
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        return JobResult(run_dir, summary, controller.eval_history)
    finally:
        metrics.close()
        runtime.shutdown()
        transport.close()
        close_default_pool()
