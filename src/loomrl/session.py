"""Assembles one run: run folder, data, executors, controller, checkpoints, final model."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import socket
import uuid
from collections.abc import Callable
from contextlib import ExitStack
from functools import partial
from pathlib import Path
from typing import Any

from loomrl.chat import PromptEncoder
from loomrl.config import JobConfig
from loomrl.control import Controller, Counters
from loomrl.data import PromptStream, load_rows_with_places
from loomrl.envs.scorer import RewardEndpoints, Scorer
from loomrl.generation.base import Generator
from loomrl.generation.executor import start_generator
from loomrl.models import load_tokenizer
from loomrl.models.loading import model_context_length
from loomrl.prompt_fit import check_prompts, prompt_budget
from loomrl.run_folder import JobResult, claim_run_folder, default_run_dir, write_json_atomically
from loomrl.runtime.base import Runtime, peak_rss_mb
from loomrl.runtime.group import rank_name
from loomrl.runtime.local import LocalRuntime
from loomrl.runtime.supervision import Deadlines, ExecutorLostError, FaultStats, Supervised
from loomrl.scoring.executor import start_scorer_executor
from loomrl.stop_signals import StopSignal, raise_on_stop_signals, stop_after_step
from loomrl.telemetry.metrics import MetricsLogger
from loomrl.training.base import TrainerEndpoints
from loomrl.training.checkpoint import (
    CheckpointError,
    checkpoint_step,
    find_checkpoint,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    newest_verified,
    restore_rng_state,
    rng_state,
)
from loomrl.training.executor import start_trainer
from loomrl.weights.transports import make_transport

logger = logging.getLogger(__name__)


def _free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _transport_kwargs(cfg: JobConfig, run_dir: Path, host: str = "127.0.0.1") -> dict[str, Any]:
    """Arguments shared by every end of the job's transport (the config already checked
    that the transport fits the runtime); a torch_dist group meets at ``host``."""
    ws = cfg.weight_sync
    if ws.transport == "files":
        return {"path": ws.path or str(run_dir / "weight_updates"), "keep_fulls": ws.keep_fulls}
    if ws.transport == "shm":
        return {"name": uuid.uuid4().hex[:16]}
    if ws.forms_group:
        return {
            "init_method": f"tcp://{host}:{_free_loopback_port()}",  # free here; elsewhere, likely free
            "world_size": 1 + cfg.generation.num_generators,
            "bucket_bytes": ws.bucket_mb << 20,
            "backend": ws.dist_backend,
            "secret": secrets.token_hex(
                32
            ),  # hides and signs the group's store keys (docs/security.md)
        }
    return {}


def _start_executors(
    cfg: JobConfig, runtime: Runtime, run_dir: Path
) -> tuple[Any, list[Any], Callable[[], None]]:
    """The trainer and the generators, each holding its end of the weight transport, and
    what cleans the transport up after them. Threads of one process share one transport
    object; separate processes each build their own end from ``(kind, kwargs)``."""
    kind, kwargs = (
        cfg.weight_sync.transport,
        _transport_kwargs(cfg, run_dir, runtime.rendezvous_host),
    )
    if kind == "tensor":  # its mode (local, ipc, broadcast), or the byte lane where it cannot work
        from loomrl.weights.transports.tensor import choose_lane

        kind, mode = choose_lane(
            cfg.weight_sync.tensor_mode, in_process=runtime.in_process, device=cfg.model.device
        )
        kwargs = {**kwargs, **mode}
    if runtime.in_process:
        transport = make_transport(kind, **kwargs)
        trainer_end, generator_end, cleanup = transport, lambda rank: transport, transport.close
    else:
        with_rank = (
            (lambda rank: {**kwargs, "rank": rank})
            if "world_size" in kwargs
            else (lambda rank: kwargs)
        )
        trainer_end, generator_end = (kind, with_rank(0)), lambda rank: (kind, with_rank(rank))
        cleanup = (
            (lambda: make_transport(kind, **kwargs).unlink())
            if "name" in kwargs
            else (lambda: None)
        )
    if cfg.trainer.parallel.type == "fsdp2":  # dp_shard ranks behind one handle
        from loomrl.training.fsdp import start_trainer_group

        trainer = start_trainer_group(runtime, cfg, trainer_end)
    else:
        trainer = runtime.start(
            "trainer", partial(start_trainer, cfg, trainer_end), TrainerEndpoints
        )
    generators = [
        runtime.start(
            f"generator{i}", partial(start_generator, cfg, generator_end(i + 1), i), Generator
        )
        for i in range(cfg.generation.num_generators)
    ]
    return trainer, generators, cleanup


def _start_scorers(cfg: JobConfig, runtime: Runtime) -> list[Any]:
    """Scorer executors for a reward function, a reward model or a judge (environment tasks
    score inside their episodes).
    Executors in this process share its default sandbox pool, configured by the job;
    executors elsewhere configure their own."""
    if cfg.task.environment is not None:
        return []
    sandbox = None if runtime.in_process else cfg.sandbox
    return [
        runtime.start(
            f"scorer{i}", partial(start_scorer_executor, cfg.task, sandbox), RewardEndpoints
        )
        for i in range(cfg.task.num_scorers)
    ]


def _supervise(
    cfg: JobConfig, runtime: Runtime, trainer, generators: list, scorers: list, faults: FaultStats
):
    """Every executor behind a ``Supervised`` slot (loomrl.runtime.supervision): deadlines,
    and restarts for generators and scorers (on runtimes whose executors are processes or
    actors; on ``local`` the slots only count). The trainer, and generators in a torch_dist
    group (a fresh process cannot join it), are not restarted in place: losing one restarts
    the job from its last checkpoint."""
    if runtime.in_process:  # threads: a hung one cannot be killed, and none dies alone; the
        slot = partial(Supervised, None, deadlines=None, stats=faults)  # stall watchdog warns
        return (
            slot(trainer, restart=False),
            [slot(g) for g in generators],
            [slot(s) for s in scorers],
        )
    deadlines = Deadlines.from_config(cfg.faults)
    in_group = cfg.weight_sync.forms_group
    slot = partial(Supervised, runtime, deadlines=deadlines, stats=faults)
    return (
        slot(trainer, restart=False),
        [slot(g, restart=not in_group) for g in generators],
        [slot(s) for s in scorers],
    )


def _job_leases(cfg: JobConfig, handles: list[Any]):
    """With ``scheduler.url`` set, the job's device phases run in leases; otherwise None
    (and nothing of ``loomrl.scheduler`` is imported)."""
    if cfg.scheduler.url is None:
        return None
    from loomrl.scheduler.jobside import JobLeases

    return JobLeases(cfg.scheduler, cfg.name, handles)


def _with_lease_metrics(
    extra: Callable[[], dict[str, float]], leases
) -> Callable[[], dict[str, float]]:
    if leases is None:
        return extra
    return lambda: {**extra(), **leases.metrics()}


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


def _resume_state(root: Path, from_step: int | None) -> tuple[Path, dict[str, Any]]:
    """The checkpoint to resume from (the newest, or that of ``from_step``), loaded and
    verified before any model loads; a bad one names the newest one that verifies."""
    path = find_checkpoint(root, from_step) if from_step is not None else latest_checkpoint(root)
    if path is None:
        raise CheckpointError(
            f"no checkpoint under {root}; nothing to resume (start it again with `loomrl run ... "
            f"--output-dir {root.parent} --overwrite`)"
        )
    try:
        return path, load_checkpoint(path)
    except CheckpointError as err:
        good = newest_verified(root, below=path)
        hint = (
            f"; the newest checkpoint that verifies is {good.name}: "
            f"`loomrl resume {root.parent} --from {checkpoint_step(good)}`"
            if good is not None
            else "; no older checkpoint verifies either"
        )
        raise CheckpointError(f"{err}{hint}") from None


def _restore(
    state: dict[str, Any], path: Path, controller_kwargs: dict[str, Any], stream: PromptStream
) -> dict[str, Any]:
    """Restore the controller side (data cursor, counters, RNG) from a verified checkpoint;
    returns the trainer's state for the trainer executor to load."""
    ctl = state["controller"]
    stream.load_state_dict(ctl["stream"])
    counters = Counters(**ctl["counters"])
    counters.generated -= ctl["in_flight"]  # lost in the crash; they will be regenerated
    counters.lost_on_resume += ctl["in_flight"]
    controller_kwargs.update(
        version=ctl["version"], counters=counters, history=ctl.get("history", {})
    )
    restore_rng_state(state["rng"])
    logger.info("resumed from %s at version %d", path, ctl["version"])
    return state["trainer"]


def event_loop_factory(choice: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The controller's loop (``event_loop``): uvloop's, or None for asyncio's own.

    On the controller's loop every executor call's submission, its result's wake-up from
    another thread and the step's bookkeeping run in turns of the loop; uvloop's turns,
    ``call_soon_threadsafe`` and self-pipe reads are C, not Python (docs/benchmarks.md)."""
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            from loomrl.config import ConfigError

            raise ConfigError(
                "event_loop = 'uvloop', but uvloop is not installed (pip install uvloop), "
                "or set event_loop = 'asyncio'"
            ) from None
        return None
    return uvloop.new_event_loop


def _executor_names(cfg: JobConfig) -> list[str]:
    """The executors a job starts, by name (a runtime may reserve resources for them)."""
    scorers = (
        cfg.task.num_scorers if cfg.task.environment is None else 0
    )  # as _start_scorers starts them
    par = cfg.trainer.parallel  # a sharded trainer's ranks: trainer.rank0 ...
    trainers = (
        [rank_name("trainer", r) for r in range(par.dp_shard)]
        if par.type == "fsdp2"
        else ["trainer"]
    )
    return [
        *trainers,
        *(f"generator{i}" for i in range(cfg.generation.num_generators)),
        *(f"scorer{i}" for i in range(scorers)),
    ]


def _make_runtime(kind: str, cfg: JobConfig | None = None) -> Runtime:
    if kind == "ray":
        from loomrl.runtime.ray import RayRuntime

        assert cfg is not None, "the ray runtime needs the job's config"
        return RayRuntime(
            cfg.ray,
            torch_threads=1,
            executor_names=_executor_names(cfg),
            transport=cfg.weight_sync.transport,
        )
    if kind == "process":
        from loomrl.runtime.process import ProcessRuntime

        return ProcessRuntime(torch_threads=1)
    return LocalRuntime(torch_threads=1)


def run_job(
    cfg: JobConfig,
    *,
    resume: bool = False,
    overwrite: bool = False,
    from_step: int | None = None,
    on_record: Callable[[dict[str, Any]], None] | None = None,
) -> JobResult:
    """Run (or resume, from the newest checkpoint or that of ``from_step``) ``cfg`` in its
    run folder, which is checked and locked first."""
    event_loop_factory(cfg.event_loop)  # a missing uvloop fails before the run folder is made
    run_dir = default_run_dir(cfg)
    faults = FaultStats(
        cfg.faults.max_executor_restarts
    )  # counts carry over the job's own restarts
    with raise_on_stop_signals(), claim_run_folder(run_dir, resume=resume, overwrite=overwrite):
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
                if err.restarted or not _may_restart(cfg, run_dir, faults, err):
                    raise
            faults.trainer_restarts += 1
            resume, from_step = True, None


def _may_restart(cfg: JobConfig, run_dir: Path, faults: FaultStats, err: ExecutorLostError) -> bool:
    """After the trainer (or a torch_dist generator) was lost: may the job restart itself
    from its newest checkpoint? Logs the cause and the decision."""
    limit = cfg.faults.max_restarts
    checkpoint = latest_checkpoint(run_dir / "checkpoints")
    if faults.trainer_restarts >= limit:
        logger.error(
            "%s; the job has restarted %d times (faults.max_restarts=%d) and stops",
            err,
            faults.trainer_restarts,
            limit,
        )
        return False
    if checkpoint is None:
        logger.error(
            "%s; no checkpoint to restart from yet (checkpoint.every_steps=%d): the job stops",
            err,
            cfg.checkpoint.every_steps,
        )
        return False
    logger.warning(
        "%s; restarting the job from %s (restart %d of faults.max_restarts=%d)",
        err,
        checkpoint.name,
        faults.trainer_restarts + 1,
        limit,
    )
    return True


Rows = tuple[list[dict[str, Any]], list[str]]  # rows, and where each one is (file:line)


def _load_datasets(cfg: JobConfig) -> tuple[Rows, Rows]:
    train = load_rows_with_places(cfg.data.train, cfg.data.prompt_key)
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
    rows, places = load_rows_with_places(cfg.data.eval, cfg.data.prompt_key)
    return train, (rows[: cfg.data.max_eval_examples], places[: cfg.data.max_eval_examples])


def _check_prompt_lengths(cfg: JobConfig, tokenizer, datasets: tuple[Rows, Rows]) -> int | None:
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


def _already_finished(cfg: JobConfig, run_dir: Path, state: dict[str, Any]) -> JobResult | None:
    """A resume of a run that reached ``num_steps`` and saved its final model changes
    nothing: its summary stays as it was, marked ``already_finished`` for the caller. A run
    that failed or was stopped while saving its final model (its summary says so) is not
    finished: the resume trains no step and saves the final model again."""
    version = state["controller"]["version"]
    summary_path = run_dir / "summary.json"
    if (
        version < cfg.trainer.num_steps
        or not (run_dir / "final").is_dir()
        or not summary_path.is_file()
    ):
        return None
    try:
        summary = {**json.loads(summary_path.read_text()), "already_finished": True}
    except (
        json.JSONDecodeError,
        UnicodeDecodeError,
        TypeError,
    ):  # a summary cut short: not finished
        return None
    if summary.get("job_failed") or summary.get(
        "interrupted"
    ):  # stopped while saving the final model
        return None
    logger.info(
        "%s already finished (%d of %d steps); nothing to resume",
        run_dir,
        version,
        cfg.trainer.num_steps,
    )
    return JobResult(run_dir, summary, [])


def _cut_record(run_dir: Path, resume_from: Path, step: int) -> None:
    """Resuming from ``step``: drop the metrics written after it (those steps run again),
    mark the resume in the record, and set checkpoints newer than it aside."""
    records = []
    path = run_dir / "metrics.jsonl"
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut short by a kill -9
            continue
    kept = [r for r in records if int(r.get("step", 0)) <= step]
    lines = [json.dumps(r, sort_keys=True) for r in kept]
    lines.append(
        json.dumps(
            {
                "step": step,
                "event": "resume",
                "resume/from_step": step,
                "resume/dropped_records": len(records) - len(kept),
            },
            sort_keys=True,
        )
    )
    tmp = run_dir / "metrics.jsonl.tmp"
    tmp.write_text("".join(line + "\n" for line in lines))
    os.replace(tmp, run_dir / "metrics.jsonl")
    for newer in list_checkpoints(resume_from.parent):
        if newer.name > resume_from.name:
            newer.rename(newer.with_name(f"abandoned-{newer.name}"))
            logger.warning(
                "resuming from %s: set the newer %s aside as abandoned-%s",
                resume_from.name,
                newer.name,
                newer.name,
            )


def _write_failure_summary(
    run_dir: Path, controller: Controller | None, err: BaseException
) -> None:
    """A job that stops with an error, or is aborted (a second Ctrl-C, SIGTERM before or
    after training), still leaves a summary.json saying how far it got, whose accounting
    adds up: rollouts taken for a step that did not finish are counted ``in_step``."""
    interrupted = isinstance(err, KeyboardInterrupt)
    summary: dict[str, Any] = {
        "job_failed": not interrupted,
        "interrupted": interrupted,
        "error": f"{type(err).__name__}: {err}",
        "run_dir": str(run_dir),
    }
    if isinstance(err, StopSignal):
        summary["stopped_by"] = err.name
    if controller is not None:  # ("failed" below counts failed rollouts, as in every summary)
        summary["steps"] = controller.version
        counts = {k.split("/")[1]: v for k, v in controller.accounting().items()}
        accounted = sum(counts[k] for k in ("trained", "dropped_stale", "failed", "in_flight"))
        summary.update(counts, in_step=counts["generated"] - accounted)
        summary["first_failures"] = dict(controller.scorer.first_errors)
    write_json_atomically(run_dir / "summary.json", summary)


def _run_locked(
    cfg: JobConfig,
    run_dir: Path,
    *,
    resume: bool,
    from_step: int | None,
    on_record: Callable[[dict[str, Any]], None] | None,
    faults: FaultStats | None = None,
) -> JobResult:
    checkpoint_root = run_dir / "checkpoints"
    resume_from, resume_state = (
        _resume_state(checkpoint_root, from_step) if resume else (None, None)
    )
    if (
        resume_state is not None
        and (done := _already_finished(cfg, run_dir, resume_state)) is not None
    ):
        return done
    # Validate everything cheap before loading any model.
    datasets = _load_datasets(cfg)
    (train_rows, _), (eval_rows, _) = datasets
    scorer = Scorer(cfg.task)
    env_factory = _environment_factory(cfg)
    tokenizer = load_tokenizer(cfg.model.path)
    budget = _check_prompt_lengths(cfg, tokenizer, datasets)
    if resume_from is not None:
        _cut_record(run_dir, resume_from, checkpoint_step(resume_from))
    (run_dir / "config.json").write_text(cfg.to_json())
    holder: dict[str, Controller] = {}
    try:
        return _train(
            cfg,
            run_dir,
            (train_rows, eval_rows),
            scorer,
            env_factory,
            tokenizer,
            (resume_from, resume_state),
            on_record,
            holder,
            budget,
            faults or FaultStats(),
        )
    except BaseException as err:  # errors, and aborts (KeyboardInterrupt, StopSignal)
        _write_failure_summary(run_dir, holder.get("controller"), err)
        raise


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
        summary = await controller.run(checkpoint=checkpoint)
    if stopped_by:
        summary["stopped_by"] = stopped_by[0]
    summary["first_failures"] = dict(
        controller.scorer.first_errors
    )  # each reason's first message, traceback and all
    # per executor; on the local runtime every executor shares the controller's process
    summary["event_loop"] = type(asyncio.get_running_loop()).__module__.split(".")[
        0
    ]  # uvloop or asyncio
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
    cfg, run_dir, rows, scorer, env_factory, tokenizer, resume, on_record, holder, budget, faults
) -> JobResult:
    """Start the executors and run the controller; ``holder`` gets the controller."""
    import torch

    from loomrl.sandbox.default import (
        close_default_pool,
        configure_default_pool,
        default_pool_metrics,
    )

    (train_rows, eval_rows), (resume_from, resume_state) = rows, resume
    loop_factory = event_loop_factory(cfg.event_loop)
    torch.manual_seed(cfg.seed)
    configure_default_pool(
        cfg.sandbox
    )  # reward code that calls default_pool() gets the job's settings
    runtime = _make_runtime(cfg.runtime, cfg)
    metrics = MetricsLogger(
        run_dir, purge_step=checkpoint_step(resume_from) + 1 if resume_from else None
    )
    cleanup_transport = leases = None
    try:
        trainer, generators, cleanup_transport = _start_executors(cfg, runtime, run_dir)
        trainer, generators, scorers = _supervise(
            cfg, runtime, trainer, generators, _start_scorers(cfg, runtime), faults
        )
        scorer.attach(scorers, faults)
        pool_metrics = default_pool_metrics if runtime.in_process else scorer.pool_metrics
        stream = PromptStream(len(train_rows), cfg.seed, cfg.data.shuffle)
        kwargs: dict[str, Any] = {}
        trainer_state = (
            _restore(resume_state, resume_from, kwargs, stream) if resume_from is not None else None
        )
        leases = _job_leases(cfg, [trainer, *generators])
        controller = holder["controller"] = Controller(
            cfg,
            trainer=trainer,
            generators=generators,
            scorer=scorer,
            tokenizer=tokenizer,
            train_rows=train_rows,
            eval_rows=eval_rows,
            stream=stream,
            metrics=metrics,
            on_record=on_record,
            env_factory=env_factory,
            extra_metrics=_with_lease_metrics(pool_metrics, leases),
            max_prompt_tokens=budget,
            leases=leases,
            faults=faults,
            **kwargs,
        )
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            summary = runner.run(_drive(cfg, controller, trainer, runtime, run_dir, trainer_state))
        summary["run_dir"] = str(run_dir)
        write_json_atomically(run_dir / "summary.json", summary)
        return JobResult(run_dir, summary, controller.eval_history)
    finally:
        _release(
            leases,
            metrics,
            runtime,
            lambda: cleanup_transport and cleanup_transport(),
            close_default_pool,
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
