"""The runtime's sections: ``[faults]`` (deadlines and restarts of executors) and ``[ray]``
(where ``runtime = "ray"`` places its actors)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from loomrl.config_base import Section


class FaultsConfig(Section):
    """Self-healing: what happens when an executor dies or stops answering."""

    max_restarts: int = Field(
        2,
        ge=0,
        description="Times the job restarts itself from its last checkpoint after the trainer dies "
        "or hangs (0: the job fails, and `loomrl resume` continues it).",
    )
    max_executor_restarts: int = Field(
        10,
        ge=0,
        description="Generator and scorer restarts allowed in one run, all together; past it the job fails.",
    )
    deadline_factor: float = Field(
        10.0,
        gt=1,
        description="A call's deadline: this many times the longest call of that method seen so far "
        "(per executor role); an executor whose call runs past it is killed and replaced.",
    )
    min_deadline_s: float = Field(60.0, gt=0, description="No deadline is shorter than this.")
    first_call_deadline_s: float = Field(
        900.0,
        gt=0,
        description="The deadline before a method has `deadline_calls` observed calls (a first "
        "call also waits for its executor to load its model).",
    )
    deadline_calls: int = Field(
        3, gt=0, description="Observed calls of a method before its deadline adapts."
    )


class RayCpus(Section):
    trainer: float = Field(1.0, ge=0, description="Ray CPUs the trainer actor asks for.")
    generator: float = Field(1.0, ge=0, description="Ray CPUs each generator actor asks for.")
    scorer: float = Field(1.0, ge=0, description="Ray CPUs each scorer actor asks for.")


class RayGpus(Section):
    trainer: float = Field(0.0, ge=0, description="GPUs the trainer actor asks for.")
    generator: float = Field(0.0, ge=0, description="GPUs each generator actor asks for.")
    scorer: float = Field(0.0, ge=0, description="GPUs each scorer actor asks for.")


class RayMemory(Section):
    trainer: int | None = Field(
        None, gt=0, description="Memory (MiB) reserved for the trainer actor."
    )
    generator: int | None = Field(
        None, gt=0, description="Memory (MiB) reserved for each generator actor."
    )
    scorer: int | None = Field(
        None, gt=0, description="Memory (MiB) reserved for each scorer actor."
    )


# Ray's own resources, asked for by num_cpus, num_gpus and memory_mb, not as custom ones
_BUILTIN_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")

CustomResources = dict[str, float]


class RayResources(Section):
    """Custom Ray resources per role (a node started with ``ray start --resources='{"gpu_box": 1}'``
    offers them): an actor runs only on a node that has what its role asks for."""

    trainer: CustomResources = Field(
        default_factory=dict, description="Custom resources the trainer actor (each rank) asks for."
    )
    generator: CustomResources = Field(
        default_factory=dict, description="Custom resources each generator actor asks for."
    )
    scorer: CustomResources = Field(
        default_factory=dict, description="Custom resources each scorer actor asks for."
    )

    @model_validator(mode="after")
    def _custom_only(self) -> RayResources:
        for role in ("trainer", "generator", "scorer"):
            for name, amount in getattr(self, role).items():
                if name in _BUILTIN_RESOURCES:
                    raise ValueError(
                        f"ray.resources.{role}.{name}: {name!r} is one of Ray's own resources; "
                        "ask for it with ray.num_cpus, ray.num_gpus or ray.memory_mb"
                    )
                if not amount > 0:
                    raise ValueError(
                        f"ray.resources.{role}.{name} = {amount}: an amount must be above 0"
                    )
        return self


class RayConfig(Section):
    """``runtime = "ray"``: every executor is a Ray actor; its role (trainer, generator,
    scorer: the executor name's prefix) picks its resources."""

    address: str | None = Field(
        None,
        description="None: use the Ray this process already initialized, else $RAY_ADDRESS, else start a "
        "local cluster (shut down at the end); 'auto', 'host:port' or 'ray://host:port': connect to a running cluster.",
    )
    namespace: str | None = Field(
        None, description="Ray namespace of the job's actors (None: Ray's default)."
    )
    num_cpus: RayCpus = Field(default_factory=RayCpus)
    num_gpus: RayGpus = Field(default_factory=RayGpus)
    memory_mb: RayMemory = Field(default_factory=RayMemory)
    resources: RayResources = Field(
        default_factory=RayResources,
        description="Custom Ray resources per role, e.g. generator = {gpu_box = 1}: where roles go.",
    )
    placement: Literal["pack", "spread"] | None = Field(
        None,
        description="Reserve one placement-group bundle per executor, packed on few nodes or spread "
        "over many (None: Ray places each actor where it fits).",
    )
    object_store_mb: int | None = Field(
        None,
        gt=0,
        description="Object store of a local cluster this job starts (None: Ray's default).",
    )
    runtime_env: dict[str, Any] | None = Field(
        None,
        description="Ray runtime_env for the job's workers (e.g. {working_dir = '.'}), where this job initializes Ray.",
    )
