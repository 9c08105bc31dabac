"""``loomrl eval JOB.toml [--checkpoint DIR]``: the job's held-out prompts completed greedily
and scored, on the job's model or a checkpoint's weights, with no training step. The same
executors and evaluation as a training run's (``Evaluator``); what it writes to its folder:
``config.json``, ``eval.json`` (the results) and ``eval_samples.jsonl`` (one line a prompt:
prompt, completion, reward, status, error)."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loomrl.config import ConfigError, JobConfig
from loomrl.data import PromptStream
from loomrl.run_folder import claim_run_folder, write_json_atomically
from loomrl.runtime.supervision import FaultStats
from loomrl.session.assembly import (
    job_leases,
    make_runtime,
    open_transport_ends,
    start_executors,
    with_runtime_transport,
)
from loomrl.session.inputs import read_inputs
from loomrl.session.paths import absolute_paths
from loomrl.session.run import (
    EVAL_SAMPLES_FILE,
    _make_controller,
    _release,
    check_engine_installed,
    event_loop_factory,
)
from loomrl.stop_signals import raise_on_stop_signals
from loomrl.telemetry.metrics import MetricsLogger
from loomrl.training.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint

logger = logging.getLogger(__name__)

EVAL_FILE = "eval.json"


@dataclass
class EvalResult:
    """Where an evaluation wrote, and what it found (``eval.json``'s content)."""

    run_dir: Path
    results: dict[str, Any]
    samples: list[dict[str, Any]]


def weights_source(cfg: JobConfig, checkpoint: str | Path | None) -> tuple[JobConfig, Path | None]:
    """The config to evaluate and the training checkpoint whose trainer state to load (None:
    the model's own weights). ``checkpoint`` is a checkpoint folder (``step_N``, verified), a
    run folder (its newest checkpoint), or a model folder (``final/``, any save_pretrained
    folder: it becomes ``model.path``)."""
    if checkpoint is None:
        return cfg, None
    path = Path(checkpoint)
    if (path / "manifest.json").is_file():
        return cfg, path
    if (path / "checkpoints").is_dir():
        newest = latest_checkpoint(path / "checkpoints")
        if newest is None:
            raise CheckpointError(f"--checkpoint {path}: a run folder with no checkpoint")
        return cfg, newest
    if (path / "config.json").is_file():
        model = cfg.model.model_copy(update={"path": str(path)})
        return cfg.model_copy(update={"model": model}), None
    raise CheckpointError(
        f"--checkpoint {path}: not a checkpoint (no manifest.json), a run folder (no "
        "checkpoints/) or a model folder (no config.json)"
    )


def default_eval_dir(cfg: JobConfig) -> Path:
    """``output_dir``, or ``runs/<name>-eval-<date>-<time>``."""
    if cfg.output_dir:
        return Path(cfg.output_dir)
    return Path("runs") / f"{cfg.name}-eval-{time.strftime('%Y%m%d-%H%M%S')}"


def evaluate_job(
    cfg: JobConfig, checkpoint: str | Path | None = None, *, overwrite: bool = False
) -> EvalResult:
    """Evaluate ``cfg``'s policy (or ``checkpoint``'s) on ``data.eval``; no training."""
    if not cfg.data.eval:
        raise ConfigError(
            "nothing to evaluate: data.eval is not set; set it in the job file or "
            "`loomrl eval JOB.toml data.eval=PATH`"
        )
    event_loop_factory(cfg.event_loop)
    check_engine_installed(cfg)
    cfg, source = weights_source(cfg, checkpoint)
    state = load_checkpoint(source) if source is not None else None
    run_dir = default_eval_dir(cfg)
    if cfg.runtime == "ray":  # actors run in other working folders, maybe on other nodes
        cfg = absolute_paths(cfg, run_dir)
        run_dir = Path(cfg.output_dir)
    with raise_on_stop_signals(), claim_run_folder(run_dir, resume=False, overwrite=overwrite):
        inputs = read_inputs(cfg, None, None)
        (run_dir / "config.json").write_text(cfg.to_json())
        results, samples = _evaluate(cfg, run_dir, inputs, state)
        results.update(
            checkpoint=str(source) if source is not None else None,
            model=cfg.model.path,
            data=cfg.data.eval,
            num_prompts=len(inputs.eval_rows),
        )
        write_json_atomically(run_dir / EVAL_FILE, results)
    return EvalResult(run_dir, results, samples)


def _evaluate(cfg: JobConfig, run_dir: Path, inputs, state: dict[str, Any] | None) -> tuple:
    """Start the executors as a run does, load the checkpoint's trainer state, evaluate once."""
    import torch

    from loomrl.sandbox.default import close_default_pool, configure_default_pool

    torch.manual_seed(cfg.seed)
    configure_default_pool(cfg.sandbox)
    faults = FaultStats(cfg.faults.max_executor_restarts)
    runtime = make_runtime(cfg.runtime, cfg)
    cfg = with_runtime_transport(cfg, runtime)
    metrics = MetricsLogger(run_dir)
    ends = leases = None
    try:
        ends = open_transport_ends(cfg, runtime, run_dir)
        executors = start_executors(cfg, runtime, ends, faults)
        inputs.scorer.attach(executors.scorers, faults)
        stream = PromptStream(len(inputs.train_rows), cfg.seed, cfg.data.shuffle)
        leases = job_leases(cfg, executors.trainer, executors.generators)
        controller = _make_controller(
            cfg, inputs, executors, stream, None, leases, metrics, None, faults
        )
        controller.evaluator.samples_path = run_dir / EVAL_SAMPLES_FILE

        async def evaluate() -> dict[str, Any]:
            await runtime.wait_ready()
            if state is not None:
                trainer_state = state["trainer"]
                await controller.on_device(
                    "checkpoint", lambda: executors.trainer.load_state_dict(trainer_state)
                )
            # the trainer's weights (the checkpoint's) to the generators, then no step
            await controller.on_device("weight_sync", controller.trainer.publish)
            return await controller.evaluator.evaluate()

        with asyncio.Runner(loop_factory=event_loop_factory(cfg.event_loop)) as runner:
            record = runner.run(evaluate())
        metrics.log(dict(record), int(record.get("eval/version", 0)))
        return dict(record), controller.evaluator.samples()
    finally:
        cleanup = ends.cleanup if ends is not None else lambda: None
        _release(leases, metrics, runtime, cleanup, close_default_pool)
