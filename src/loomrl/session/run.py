"""One run's lifecycle: the run folder claimed and locked, the inputs checked, the executors
started (``assembly``), the controller driven with checkpoints to the final model, everything
let go of, and the job restarted from its checkpoint when the trainer is lost (``resume``)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

from loomrl.config import ConfigError, JobConfig
from loomrl.control import Controller
from loomrl.data import PromptStream
from loomrl.generation.engine_config import engine_install_error
from loomrl.run_folder import JobResult, claim_run_folder, default_run_dir, write_json_atomically
from loomrl.runtime.base import Runtime, peak_rss_mb
from loomrl.runtime.supervision import ExecutorLostError, FaultStats
from loomrl.sandbox.default import close_default_pool, configure_default_pool, default_pool_metrics
from loomrl.session.assembly import (
    JobExecutors,
    job_leases,
    make_runtime,
    open_transport_ends,
    start_executors,
    with_lease_metrics,
    with_runtime_transport,
)
from loomrl.session.inputs import RunInputs, read_inputs
from loomrl.session.paths import absolute_paths
from loomrl.session.resume import (
    ResumedController,
    already_finished,
    cut_record,
    lost_group_member,
    may_restart,
    restore,
    resume_state,
    write_failure_summary,
)
from loomrl.session.serving import serving
from loomrl.session.views import extra_sinks, run_views
from loomrl.stop_signals import raise_on_stop_signals, stop_after_step
from loomrl.telemetry.metrics import MetricsLogger
from loomrl.training.base import PublishAfterStepError
from loomrl.training.checkpoint import checkpoint_step, rng_state
from loomrl.training.precision import describe_policy

logger = logging.getLogger(__name__)

OnRecord = Callable[[dict[str, Any]], None] | None
# Every evaluation's completions, one JSON line each (docs/runs.md).
EVAL_SAMPLES_FILE = "eval_samples.jsonl"


def event_loop_factory(choice: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The controller's loop (``event_loop``): uvloop's, or None for asyncio's own.

    On the controller's loop every executor call's submission, its result's wake-up from
    another thread and the step's bookkeeping run in turns of the loop; uvloop's turns,
    ``call_soon_threadsafe`` and self-pipe reads are C, not Python (docs/benchmarks.md)."""
    if choice == "asyncio":
        return None
    try:
        # lazy: uvloop is optional (event_loop = 'auto' falls back to asyncio)
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise ConfigError(
                "event_loop = 'uvloop', but uvloop is not installed (pip install uvloop), "
                "or set event_loop = 'asyncio'"
            ) from None
        return None
    return uvloop.new_event_loop


def check_engine_installed(cfg: JobConfig) -> None:
    """The engine ``generation.engine.type`` names is importable here (``engine_install_error``)."""
    message = engine_install_error(cfg.generation.engine.type, cfg.runtime)
    if message is not None:
        from loomrl.config import ConfigError

        raise ConfigError(message)


def run_job(
    cfg: JobConfig,
    *,
    resume: bool = False,
    overwrite: bool = False,
    from_step: int | None = None,
    on_record: OnRecord = None,
) -> JobResult:
    """Run (or resume, from the newest checkpoint or that of ``from_step``) ``cfg`` in its
    run folder, which is checked and locked first."""
    # a missing uvloop or vLLM fails before the run folder is made
    event_loop_factory(cfg.event_loop)
    check_engine_installed(cfg)
    run_dir = default_run_dir(cfg)
    if cfg.runtime == "ray":  # actors run in other working folders, maybe on other nodes
        cfg = absolute_paths(cfg, run_dir)
        run_dir = Path(cfg.output_dir)
    # one count of executor restarts for the whole job, its own restarts included
    faults = FaultStats(cfg.faults.max_executor_restarts)
    with (
        raise_on_stop_signals(),
        claim_run_folder(run_dir, resume=resume, overwrite=overwrite),
        run_views(cfg, run_dir),
    ):
        while True:
            try:
                return _run_locked(
                    cfg,
                    run_dir,
                    resume=resume,
                    from_step=from_step,
                    on_record=on_record,
                    faults=faults,
                )
            except ExecutorLostError as err:
                if err.restarted or not may_restart(cfg, run_dir, faults, err):
                    raise
            faults.trainer_restarts += 1
            resume, from_step = True, None


def _run_locked(
    cfg: JobConfig,
    run_dir: Path,
    *,
    resume: bool,
    from_step: int | None,
    on_record: OnRecord,
    faults: FaultStats | None = None,
) -> JobResult:
    resume_from, state = (
        resume_state(run_dir / "checkpoints", from_step) if resume else (None, None)
    )
    if state is not None and (done := already_finished(cfg, run_dir, state)) is not None:
        return done
    inputs = read_inputs(cfg, resume_from, state)  # everything cheap, before any model loads
    if resume_from is not None:
        cut_record(run_dir, resume_from, checkpoint_step(resume_from))
    (run_dir / "config.json").write_text(cfg.to_json())
    logger.info("%s", describe_policy(inputs.precision))
    return _train(cfg, run_dir, inputs, on_record, faults or FaultStats())


async def _drive(
    cfg: JobConfig,
    controller: Controller,
    trainer,
    runtime: Runtime,
    run_dir: Path,
    trainer_state: dict[str, Any] | None,
) -> dict[str, Any]:
    """Wait for the executors, restore the trainer, run the controller with checkpoints,
    and save the final model; the run's summary."""
    checkpoint_root = run_dir / "checkpoints"

    async def checkpoint(step: int) -> None:
        controller.metrics.flush()  # the record up to here is on disk before the checkpoint is
        extra = {
            "controller": controller.state_dict(),
            "rng": rng_state(),
            "config": json.loads(cfg.to_json()),
        }
        await controller.on_device(
            "checkpoint",
            lambda: trainer.save_checkpoint(str(checkpoint_root), step, extra, cfg.checkpoint.keep),
        )

    await runtime.wait_ready()  # model loading is not training time
    if trainer_state is not None:
        await controller.on_device("checkpoint", lambda: trainer.load_state_dict(trainer_state))
    stopped_by: list[str] = []
    with stop_after_step(controller.request_stop, stopped_by):
        async with serving(cfg, controller, run_dir, controller.rollouts.prompts.tokenizer):
            summary = await controller.run(checkpoint=checkpoint)
    if stopped_by:
        summary["stopped_by"] = stopped_by[0]
    summary["first_failures"] = controller.scorer.first_failures()
    summary["failures_by_kind"] = dict(controller.scorer.failure_counts())
    # per executor; on the local runtime every executor shares the controller's process
    # uvloop or asyncio
    summary["event_loop"] = type(asyncio.get_running_loop()).__module__.split(".")[0]
    summary["peak_rss_mb"] = {
        "controller": peak_rss_mb(os.getpid()),
        **{h.name: peak_rss_mb(h.pid) for h in runtime.handles},
    }
    if not summary["interrupted"]:
        await controller.on_device(
            "checkpoint", lambda: trainer.save_pretrained(str(run_dir / "final"))
        )
    return summary


def _train(
    cfg: JobConfig, run_dir: Path, inputs: RunInputs, on_record: OnRecord, faults: FaultStats
) -> JobResult:
    """Start the executors and run the controller; a run that fails or is aborted still
    leaves a summary saying how far it got."""
    loop_factory = event_loop_factory(cfg.event_loop)
    torch.manual_seed(cfg.seed)
    # reward code that calls default_pool() gets the job's settings
    configure_default_pool(cfg.sandbox)
    controller: Controller | None = None
    try:
        runtime = make_runtime(cfg.runtime, cfg)
        cfg = with_runtime_transport(cfg, runtime)
        metrics = MetricsLogger(
            run_dir, purge_step=inputs.purge_step, sinks=extra_sinks(cfg, run_dir)
        )
        ends = leases = None
        try:
            ends = open_transport_ends(cfg, runtime, run_dir)
            executors = start_executors(cfg, runtime, ends, faults)
            inputs.scorer.attach(executors.scorers, faults)
            stream = PromptStream(len(inputs.train_rows), cfg.seed, cfg.data.shuffle)
            resumed = restore(inputs, stream) if inputs.resume_from is not None else None
            leases = job_leases(cfg, executors.trainer, executors.generators)
            controller = _make_controller(
                cfg, inputs, executors, stream, resumed, leases, metrics, on_record, faults
            )
            controller.evaluator.samples_path = run_dir / EVAL_SAMPLES_FILE
            trainer_state = resumed.trainer_state if resumed is not None else None
            with asyncio.Runner(loop_factory=loop_factory) as runner:
                summary = runner.run(
                    _drive(cfg, controller, executors.trainer, runtime, run_dir, trainer_state)
                )
            summary["run_dir"] = str(run_dir)
            summary["precision"] = inputs.precision
            write_json_atomically(run_dir / "summary.json", summary)
            return JobResult(run_dir, summary, controller.eval_history)
        except PublishAfterStepError as err:  # a torch_dist member died: lost as the trainer is
            lost = lost_group_member(cfg, faults, err, runtime.handles)
            if lost is None:
                raise
            raise lost from err
        finally:
            cleanup = ends.cleanup if ends is not None else lambda: None
            _release(leases, metrics, runtime, cleanup, close_default_pool)
    except BaseException as err:  # errors, and aborts (KeyboardInterrupt, StopSignal)
        write_failure_summary(run_dir, controller, err)
        raise


def _make_controller(
    cfg: JobConfig,
    inputs: RunInputs,
    executors: JobExecutors,
    stream: PromptStream,
    resumed: ResumedController | None,
    leases,
    metrics: MetricsLogger,
    on_record: OnRecord,
    faults: FaultStats,
) -> Controller:
    """The controller over the started executors, from where a resume restored it."""
    in_process = executors.in_process
    pool_metrics = default_pool_metrics if in_process else inputs.scorer.pool_metrics
    start = {} if resumed is None else resumed.controller_kwargs()
    return Controller(
        cfg,
        trainer=executors.trainer,
        generators=executors.generators,
        scorer=inputs.scorer,
        tokenizer=inputs.tokenizer,
        train_rows=inputs.train_rows,
        eval_rows=inputs.eval_rows,
        stream=stream,
        metrics=metrics,
        on_record=on_record,
        env_factory=inputs.env_factory,
        extra_metrics=with_lease_metrics(pool_metrics, leases),
        max_prompt_tokens=inputs.max_prompt_tokens,
        leases=leases,
        faults=faults,
        **start,
    )


def _release(leases, metrics: MetricsLogger, runtime: Runtime, *closers: Callable[[], Any]) -> None:
    """Let go of everything a run holds, each step even when one before it fails (a full
    disk fails the metrics log; the executors and the shm channel must still go)."""
    with ExitStack() as stack:  # exits run last to first
        for close in reversed(
            [
                *((leases.close,) if leases is not None else ()),
                metrics.close,
                runtime.shutdown,
                *closers,
            ]
        ):
            stack.callback(_logged, close)


def _logged(close: Callable[[], Any]) -> None:
    try:
        close()
    except Exception as err:  # noqa: BLE001 - logged; the run's own outcome is what is raised
        logger.error(
            "while releasing the run: %s failed: %s: %s",
            getattr(close, "__qualname__", close),
            type(err).__name__,
            err,
        )
