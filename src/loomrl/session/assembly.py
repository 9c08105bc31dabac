"""The job's executors in one place: the runtime they live in, the weight transport's ends,
the trainer, generators and scorers, each built from its own sections of the config, and the
supervision slots and scheduler leases around them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from loomrl.config import JobConfig
from loomrl.device.colocate import ColocatedPhases
from loomrl.generation.base import Generator
from loomrl.generation.executor import GeneratorSetup, start_generator
from loomrl.runtime.base import Runtime
from loomrl.runtime.group import rank_name
from loomrl.runtime.local import LocalRuntime
from loomrl.runtime.process import ProcessRuntime
from loomrl.runtime.supervision import Deadlines, FaultStats, Supervised, was_replaced
from loomrl.scoring.base import ScorerEndpoints
from loomrl.scoring.executor import start_scorer_executor
from loomrl.training.base import TrainerEndpoints
from loomrl.training.executor import TrainerSetup, start_trainer
from loomrl.training.fsdp import start_trainer_group
from loomrl.weights.config import WeightSyncConfig
from loomrl.weights.transports.setup import TransportEnds, transport_args, transport_ends


def executor_names(cfg: JobConfig) -> list[str]:
    """The executors a job starts, by name (a runtime may reserve resources for them)."""
    scorers = cfg.task.num_scorers if cfg.task.has_reward else 0  # as start_scorers
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


def make_runtime(kind: str, cfg: JobConfig | None = None) -> Runtime:
    if kind == "ray":
        # lazy: ray is optional (the ray extra): its runtime loads only when asked for
        from loomrl.runtime.ray import RayRuntime

        assert cfg is not None, "the ray runtime needs the job's config"
        return RayRuntime(
            cfg.ray,
            torch_threads=1,
            executor_names=executor_names(cfg),
            transport=cfg.weight_sync.kind,
            transport_defaulted=cfg.transport_defaulted,
            trainer_group=cfg.trainer.parallel.type == "fsdp2",
            run_dir=cfg.output_dir,
        )
    if kind == "process":
        return ProcessRuntime(torch_threads=1)
    return LocalRuntime(torch_threads=1)


def with_runtime_transport(cfg: JobConfig, runtime: Runtime) -> JobConfig:
    """``cfg`` with the weight transport its runtime chose: the ray runtime picks one that
    crosses machines where the job named none and its executors may sit on several nodes."""
    chosen = getattr(runtime, "transport", None)
    if chosen is None or chosen == cfg.weight_sync.kind:
        return cfg
    ws = WeightSyncConfig.model_validate({**cfg.weight_sync.model_dump(), "transport": chosen})
    return cfg.model_copy(update={"weight_sync": ws})


def _job_wide(cfg: JobConfig) -> dict[str, Any]:
    """What every executor's setup takes from the job: the model, the weight transport, the
    seed and the runtime's kind."""
    return {
        "model": cfg.model,
        "weight_sync": cfg.weight_sync,
        "seed": cfg.seed,
        "runtime": cfg.runtime,
    }


def trainer_setup(cfg: JobConfig) -> TrainerSetup:
    """The trainer executor's sections of ``cfg``, and the job-wide values it needs."""
    return TrainerSetup(
        **_job_wide(cfg),
        trainer=cfg.trainer,
        algorithm=cfg.algorithm,
        temperature=cfg.generation.temperature,
        trace=cfg.uses_traces(cfg.trainer.trace),
        quantize=cfg.generation.engine.quantize,
        max_new_tokens=cfg.generation.max_new_tokens,
    )


def generator_setup(cfg: JobConfig) -> GeneratorSetup:
    """A generator executor's sections of ``cfg``, and the job-wide values it needs."""
    return GeneratorSetup(**_job_wide(cfg), generation=cfg.generation)


def open_transport_ends(cfg: JobConfig, runtime: Runtime, run_dir: Path) -> TransportEnds:
    """Each executor's end of the job's weight transport (``[weight_sync.transport]``)."""
    kind, kwargs = transport_args(
        cfg.weight_sync,
        run_dir=run_dir,
        num_generators=cfg.generation.num_generators,
        in_process=runtime.in_process,
        device=cfg.model.device,
        host=runtime.rendezvous_host,
    )
    runtime.uses_transport(kind, kwargs)
    return transport_ends(kind, kwargs, in_process=runtime.in_process)


@dataclass(frozen=True)
class JobExecutors:
    """The job's executors, each behind its supervision slot."""

    trainer: Any
    generators: list[Any]
    scorers: list[Any]
    in_process: bool  # threads of this process (runtime 'local'), not processes or actors


def start_executors(
    cfg: JobConfig, runtime: Runtime, ends: TransportEnds, faults: FaultStats
) -> JobExecutors:
    """The trainer and the generators, each holding its end of the weight transport, and the
    scorers; all supervised."""
    setup = trainer_setup(cfg)
    if cfg.trainer.parallel.type == "fsdp2":  # dp_shard ranks behind one handle
        trainer = start_trainer_group(runtime, setup, ends.trainer)
    else:
        trainer = runtime.start(
            "trainer", partial(start_trainer, setup, ends.trainer), TrainerEndpoints
        )
    gen_setup = generator_setup(cfg)
    generators = [
        runtime.start(
            f"generator{i}",
            partial(start_generator, gen_setup, ends.generator(i + 1), i),
            Generator,
        )
        for i in range(cfg.generation.num_generators)
    ]
    return supervise(cfg, runtime, trainer, generators, start_scorers(cfg, runtime), faults)


def start_scorers(cfg: JobConfig, runtime: Runtime) -> list[Any]:
    """Scorer executors for a reward function, a reward model or a judge (environment tasks
    score inside their episodes), each built from the task's sections. Executors in this
    process share its default sandbox pool, configured by the job; executors elsewhere
    configure their own."""
    if not cfg.task.has_reward:
        return []
    sandbox = None if runtime.in_process else cfg.sandbox
    return [
        runtime.start(
            f"scorer{i}",
            partial(start_scorer_executor, cfg.task, sandbox, cfg.data),
            ScorerEndpoints,
        )
        for i in range(cfg.task.num_scorers)
    ]


def supervise(
    cfg: JobConfig, runtime: Runtime, trainer, generators: list, scorers: list, faults: FaultStats
) -> JobExecutors:
    """Every executor behind a ``Supervised`` slot (loomrl.runtime.supervision): deadlines,
    and restarts for generators and scorers (on runtimes whose executors are processes or
    actors; on ``local`` the slots only count). The trainer, and generators in a torch_dist
    group (a fresh process cannot join it), are not restarted in place: losing one restarts
    the job from its last checkpoint."""
    if runtime.in_process:  # threads: a hung one cannot be killed, and none dies alone; the
        slot = partial(Supervised, None, deadlines=None, stats=faults)  # stall watchdog warns
        in_group = False
    else:
        slot = partial(
            Supervised, runtime, deadlines=Deadlines.from_config(cfg.faults), stats=faults
        )
        in_group = cfg.weight_sync.forms_group
    return JobExecutors(
        slot(trainer, restart=False),
        [slot(g, restart=not in_group) for g in generators],
        [slot(s) for s in scorers],
        runtime.in_process,
    )


def job_leases(cfg: JobConfig, trainer: Any, generators: list[Any]):
    """What the job's device phases run in: scheduler leases with ``scheduler.url`` set,
    turns on one device with ``generation.colocate``, otherwise None (and nothing of
    ``loomrl.scheduler`` but its config is imported)."""
    if cfg.generation.colocate:
        return ColocatedPhases(trainer, generators, replaced=was_replaced)
    if cfg.scheduler.url is None:
        return None
    # lazy: a job without a scheduler imports nothing of it but its config
    from loomrl.scheduler.jobside import JobLeases

    return JobLeases(cfg.scheduler, cfg.name, [trainer, *generators])


def with_lease_metrics(
    extra: Callable[[], dict[str, float]], leases
) -> Callable[[], dict[str, float]]:
    if leases is None:
        return extra
    return lambda: {**extra(), **leases.metrics()}
