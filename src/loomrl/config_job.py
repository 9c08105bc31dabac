"""``JobConfig``: every section of a job put together, and the rules that span sections.

A section checks its own keys (beside its role: ``training/config.py``, ...); what needs two
sections is checked here when ``JobConfig`` is built, each rule raising ``ValueError`` naming
the keys to change: the weight transport against the runtime, the sharded trainer's needs,
the colocated mode's, quantized publishing's and the vLLM engine's. The rules read only config.
``loomrl.config`` re-exports ``JobConfig`` and loads it from a job file.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field, PrivateAttr, model_validator

from loomrl.config_base import Section
from loomrl.config_common import (
    AlgorithmConfig,
    CheckpointConfig,
    DataConfig,
    EvalConfig,
    LoggingConfig,
    ModelConfig,
)
from loomrl.generation.config import GenerationConfig
from loomrl.generation.engine_config import vllm_quantize_refusal
from loomrl.runtime.config import FaultsConfig, RayConfig
from loomrl.sandbox.config import SandboxConfig
from loomrl.scheduler.config import SchedulerConfig
from loomrl.scoring.config import TaskConfig
from loomrl.serve.config import ServeConfig
from loomrl.training.config import TrainerConfig
from loomrl.weights.config import ShmTransportConfig, WeightSyncConfig


class JobConfig(Section):
    name: str = Field("job", description="Job name; the run folder is named after it.")
    seed: int = Field(0, description="Seed for data order, sampling and init.")
    output_dir: str | None = Field(None, description="Run folder; default runs/<name>-<timestamp>.")
    runtime: Literal["local", "process", "ray"] = Field(
        "local",
        description="Where executors live: 'local' (threads of this process), 'process' "
        "(one spawned process each, no shared GIL) or 'ray' (Ray actors, see [ray]); the last two "
        "send weights by shm, files or torch_dist.",
    )
    event_loop: Literal["auto", "uvloop", "asyncio"] = Field(
        "auto",
        description="The controller's event loop: 'uvloop' (libuv; its turns and cross-thread "
        "wake-ups cost the controller less CPU), 'asyncio' (the standard library's) or 'auto' "
        "(uvloop where it is installed, else asyncio).",
    )
    stall_warning_s: float = Field(
        300.0,
        gt=0,
        description="Warn when one executor call (generate, train_step, publish ...) runs longer than this.",
    )
    no_step_timeout_s: float | None = Field(
        3600.0,
        gt=0,
        description="Stop the job, naming the reason (the last rollout failure, stale drops, rollouts in "
        "flight), when no training step completes for this long (every rollout failing with "
        "task.max_failure_rate=1.0, generators that never return); None: never. Raise it where a step, "
        "an eval or a wait for the scheduler's lease can take longer.",
    )
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig
    task: TaskConfig
    generation: GenerationConfig = Field(default_factory=GenerationConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    weight_sync: WeightSyncConfig = Field(default_factory=WeightSyncConfig)
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    faults: FaultsConfig = Field(default_factory=FaultsConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    ray: RayConfig = Field(default_factory=RayConfig)
    serve: ServeConfig = Field(default_factory=ServeConfig)

    # runtime 'ray' with no weight_sync.transport in the input: the runtime may pick one that
    # crosses nodes (loomrl.runtime.placement); config.json then leaves it out, so a resume
    # decides again on the cluster it runs on
    _transport_defaulted: bool = PrivateAttr(False)

    @model_validator(mode="wrap")
    @classmethod
    def _default_transport(cls, data: Any, handler: Any) -> JobConfig:
        """Executors in processes or actors get weights by 'shm' where the job names no
        transport: the default is resolved on the input, before any section is built."""
        if not isinstance(data, dict) or data.get("runtime") not in ("process", "ray"):
            return handler(data)
        ws, defaulted = data.get("weight_sync", {}), False
        if isinstance(ws, dict) and "transport" not in ws:
            data, defaulted = {**data, "weight_sync": {**ws, "transport": "shm"}}, True
        elif isinstance(ws, WeightSyncConfig) and "transport" not in ws.model_fields_set:
            shm = ws.model_copy(update={"transport": ShmTransportConfig()})
            data, defaulted = {**data, "weight_sync": shm}, True
        cfg = handler(data)
        cfg._transport_defaulted = defaulted and cfg.runtime == "ray"
        return cfg

    @property
    def transport_defaulted(self) -> bool:
        """Whether ``weight_sync.transport`` is the ray runtime's default (the job named none)."""
        return self._transport_defaulted

    @model_validator(mode="after")
    def _transport_fits_runtime(self) -> JobConfig:
        kind = self.weight_sync.kind
        if self.runtime in ("process", "ray") and kind == "inproc":
            raise ValueError(
                "weight_sync.transport='inproc' only reaches executors in this process; "
                f"runtime={self.runtime!r} needs 'shm' (the default there; one node only), 'files' or 'torch_dist'"
            )
        if self.runtime == "local" and kind == "torch_dist":
            raise ValueError(
                "weight_sync.transport='torch_dist' needs one process per executor; the local "
                "runtime runs executors as threads: use runtime='process', or 'inproc' or 'shm'"
            )
        return self

    @model_validator(mode="after")
    def _sections_fit_together(self) -> JobConfig:
        check_job(self)
        return self

    @model_validator(mode="after")
    def _sync_keeps_rollouts_fresh(self) -> JobConfig:
        # Generators hold the last published version, up to sync_every - 1 behind the
        # trainer; past max_staleness every rollout is dropped and no step ever completes.
        every, stale = self.weight_sync.sync_every, self.algorithm.max_staleness
        if every > stale + 1:
            raise ValueError(
                f"weight_sync.sync_every={every} with algorithm.max_staleness={stale}: generators would "
                f"lag up to {every - 1} versions, so every rollout would be dropped as stale and the job "
                f"would hang; set sync_every <= max_staleness + 1 = {stale + 1}"
            )
        return self

    def uses_traces(self, setting: bool | str) -> bool:
        """A ``trace`` setting resolved: 'auto' traces where executors share a process."""
        return self.runtime == "local" if setting == "auto" else bool(setting)

    def dump(self, mode: str = "python") -> dict[str, Any]:
        """The config as a dict that builds it again: a defaulted transport left out."""
        raw = self.model_dump(mode=mode)
        if self._transport_defaulted:
            del raw["weight_sync"]["transport"]
        return raw

    def to_json(self) -> str:
        return json.dumps(self.dump(mode="json"), indent=2, sort_keys=True)


# -- the rules that span sections ----------------------------------------------------------


def check_job(cfg: JobConfig) -> None:
    parallel_fits_job(cfg)
    colocate_fits_job(cfg)
    quantized_publish_fits_job(cfg)
    vllm_fits_job(cfg)
    overlong_fits_job(cfg)


def overlong_fits_job(cfg: JobConfig) -> None:
    """'soft' reads a completion's length against generation.max_new_tokens, which bounds
    one turn: a multi-turn episode has no such maximum."""
    if cfg.algorithm.overlong == "soft" and cfg.task.environment is not None:
        raise ValueError(
            "algorithm.overlong='soft' penalises a completion near generation.max_new_tokens, a "
            "limit per turn; an environment's episode has several turns: use 'filter' or 'none'"
        )


def parallel_fits_job(cfg: JobConfig) -> None:
    if cfg.trainer.parallel.type != "fsdp2":
        return
    if cfg.runtime == "local":
        raise ValueError(
            "trainer.parallel.type='fsdp2' needs one process per rank (a process has one default "
            "torch.distributed group); runtime='local' runs executors as threads: use "
            "runtime='process' (or 'ray')"
        )
    if cfg.weight_sync.forms_group:
        raise ValueError(
            f"trainer.parallel.type='fsdp2' with weight_sync.transport={cfg.weight_sync.kind!r} "
            "(a torch_dist group): the ranks' process group is the default one, which the "
            "weight-sync group would need too; use transport 'shm' or 'files'"
        )
    if cfg.model.lora is not None:
        raise ValueError(
            "trainer.parallel.type='fsdp2' with model.lora: sharded LoRA training is not built "
            "yet; drop [model.lora] or set parallel.type='single'"
        )
    if cfg.algorithm.kl_coef > 0:
        raise ValueError(
            f"trainer.parallel.type='fsdp2' with algorithm.kl_coef={cfg.algorithm.kl_coef}: the "
            "sharded KL reference is not built yet; set kl_coef=0 or parallel.type='single'"
        )
    if cfg.scheduler.url is not None and cfg.scheduler.offload:
        raise ValueError(
            "trainer.parallel.type='fsdp2' with scheduler.url and scheduler.offload: a sharded "
            "trainer cannot be offloaded yet; set scheduler.offload=false or parallel.type='single'"
        )


def colocate_fits_job(cfg: JobConfig) -> None:
    """``generation.colocate``: the generators and one trainer take turns on one device."""
    if not cfg.generation.colocate:
        return
    if cfg.scheduler.url is not None:
        raise ValueError(
            "generation.colocate=true with scheduler.url: the scheduler's leases already offload "
            "this job's executors between its phases; use one or the other"
        )
    if cfg.trainer.parallel.type != "single":
        raise ValueError(
            f"generation.colocate=true with trainer.parallel.type={cfg.trainer.parallel.type!r}: "
            "colocation puts one trainer and the generators on one device; use parallel.type='single'"
        )
    if cfg.weight_sync.prefetch:
        raise ValueError(
            "generation.colocate=true with weight_sync.prefetch=true: a prefetch thread reads the "
            "generator's weights while they are offloaded; set prefetch=false"
        )


def quantized_publish_fits_job(cfg: JobConfig) -> None:
    """``weight_sync.publish_quantized``: the trainer sends codes and scales, which only the
    hf engine's quantized Linear layers take."""
    if not cfg.weight_sync.publish_quantized:
        return
    engine = cfg.generation.engine
    if engine.quantize == "none":
        raise ValueError(
            "weight_sync.publish_quantized=true with generation.engine.quantize='none': there is "
            "nothing to publish quantized; set generation.engine.quantize='int8' or 'fp8', or "
            "publish_quantized=false"
        )
    if engine.quantize == "int4":
        raise ValueError(
            "weight_sync.publish_quantized=true with generation.engine.quantize='int4': the trainer "
            "publishes int8 or fp8 codes; an int4 generator quantizes what it receives: set "
            "publish_quantized=false"
        )
    if engine.type != "hf":
        raise ValueError(
            f"weight_sync.publish_quantized=true with generation.engine.type={engine.type!r}: "
            "only the hf engine loads published codes and scales; set publish_quantized=false"
        )
    if cfg.model.lora is not None:
        raise ValueError(
            "weight_sync.publish_quantized=true with model.lora: a LoRA job publishes its adapter "
            "only, which is not quantized; set publish_quantized=false"
        )
    if cfg.weight_sync.kind == "tensor":
        raise ValueError(
            "weight_sync.publish_quantized=true with weight_sync.transport type 'tensor': the tensor "
            "lane publishes one dtype; use a byte lane ('inproc', 'shm', 'files', 'torch_dist')"
        )


def vllm_fits_job(cfg: JobConfig) -> None:
    """``generation.engine.type = "vllm"``: what vLLM cannot run, refused before it starts.
    The engine checks what only its machine knows (the device; the dtype 'auto' resolves to
    on an 'auto' device) before vLLM starts."""
    engine = cfg.generation.engine
    if engine.type != "vllm":
        return
    if cfg.model.lora is not None:
        raise ValueError("generation.engine.type='vllm' does not take model.lora yet; use 'hf'")
    if engine.async_engine and cfg.runtime == "process":
        raise ValueError(
            "generation.engine.async_engine=true cannot run on runtime='process': its "
            "executors are daemonic processes, which may not start AsyncLLM's engine-core "
            "process (and it runs an executor's calls one at a time); use runtime='local'"
        )
    refusal = vllm_quantize_refusal(engine.quantize, _known_dtype(cfg.model))
    if refusal is not None:
        raise ValueError(refusal)


def _known_dtype(model: ModelConfig) -> str | None:
    """The generators' compute dtype where the config alone says it (``model.dtype``, or
    'auto' on a named device: bfloat16 on CUDA, float32 on the CPU), else None."""
    if model.dtype != "auto":
        return model.dtype
    if model.device == "cpu":
        return "float32"
    return "bfloat16" if model.device.startswith("cuda") else None
