"""Typed job configuration. Imports without torch, so ``loomrl --help`` answers fast.

One pydantic model per component; unknown keys are errors (``extra="forbid"``). A job is
a TOML file with one table per component; the CLI takes dotted overrides
(``trainer.lr=3e-4``). The fully resolved config is written to the run folder.

Each role's section lives beside its role (``generation/config.py``, ``training/config.py``,
``weights/config.py``, ``scoring/config.py``, ``sandbox/config.py``, ``scheduler/config.py``,
``runtime/config.py``); the sections every role reads (model, data, algorithm, checkpoints,
evaluation, logging) live here, with ``JobConfig``, which puts them together and checks what
spans sections, and the loading. Every section is re-exported: ``from loomrl.config import X``.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationError, model_validator

from loomrl.config_base import DEVICE_PATTERN, DtypeName, Section
from loomrl.config_hints import suggest
from loomrl.generation.config import GenerationConfig
from loomrl.runtime.config import FaultsConfig, RayConfig, RayCpus, RayGpus, RayMemory
from loomrl.sandbox.config import SandboxConfig
from loomrl.scheduler.config import SchedulerConfig
from loomrl.scoring.config import (
    FunctionScorerConfig,
    JudgeScorerConfig,
    ModelScorerConfig,
    RewardSpec,
    ScorerConfig,
    TaskConfig,
)
from loomrl.training.config import (
    Fsdp2ParallelConfig,
    ParallelConfig,
    SingleParallelConfig,
    TrainerConfig,
)
from loomrl.weights.config import (
    FilesTransportConfig,
    InprocTransportConfig,
    ShmTransportConfig,
    TensorTransportConfig,
    TorchDistTransportConfig,
    TransportConfig,
    WeightSyncConfig,
)

__all__ = [
    "AlgorithmConfig",
    "CheckpointConfig",
    "ConfigError",
    "DataConfig",
    "EvalConfig",
    "FaultsConfig",
    "FilesTransportConfig",
    "Fsdp2ParallelConfig",
    "FunctionScorerConfig",
    "GenerationConfig",
    "InprocTransportConfig",
    "JobConfig",
    "JudgeScorerConfig",
    "LoggingConfig",
    "LoraConfig",
    "ModelConfig",
    "ModelScorerConfig",
    "ParallelConfig",
    "RayConfig",
    "RayCpus",
    "RayGpus",
    "RayMemory",
    "RewardSpec",
    "SandboxConfig",
    "SchedulerConfig",
    "ScorerConfig",
    "Section",
    "ShmTransportConfig",
    "SingleParallelConfig",
    "TaskConfig",
    "TensorTransportConfig",
    "TorchDistTransportConfig",
    "TrainerConfig",
    "TransportConfig",
    "WeightSyncConfig",
    "apply_overrides",
    "build_config",
    "config_reference",
    "load_config",
    "parse_override",
]


class ModelConfig(Section):
    path: str = Field(
        "tiny:llama",
        description="A local Hugging Face model folder, or a 'tiny:' spec built offline "
        "(e.g. 'tiny:llama', 'tiny:qwen2?hidden_size=128&num_layers=4').",
    )
    lora: LoraConfig | None = Field(
        None, description="Train a LoRA adapter instead of all weights."
    )
    device: str = Field(
        "auto",
        pattern=DEVICE_PATTERN,
        description="Where the trainer and generators compute: 'auto' (CUDA when present, else the CPU), "
        "'cpu', 'cuda' or 'cuda:<index>'.",
    )
    dtype: DtypeName = Field(
        "auto",
        description="dtype of the compute weights: the generators' model and the trainer's KL reference "
        "(the trainer's own weights follow trainer.precision). 'auto': bfloat16 on CUDA, float32 on the "
        "CPU, so CPU runs (and the golden record) compute exactly as before; set 'bfloat16' to try it on "
        "a CPU with bf16 instructions (avx512_bf16 / amx_bf16).",
    )


class LoraConfig(Section):
    r: int = Field(8, gt=0, description="LoRA rank.")
    alpha: float = Field(16.0, gt=0, description="LoRA scaling alpha.")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "v_proj"], description="Module names to adapt."
    )


class DataConfig(Section):
    train: str = Field(
        ...,
        description="Training prompts: a .jsonl, .json (array or lines) or .parquet file, or a "
        "dataset folder (save_to_disk, or data files named as on the hub) (docs/data.md).",
    )
    eval: str | None = Field(None, description="Held-out prompts for evaluation (as train).")
    train_split: str = Field(
        "train", description="Split of a dataset folder data.train names (files: not read)."
    )
    eval_split: str = Field(
        "test", description="Split of a dataset folder data.eval names (files: not read)."
    )
    prompt_key: str = Field(
        "prompt",
        description="Column holding the prompt: a string, or a list of {role, content} messages "
        "(TRL's conversational format; needs the chat template).",
    )
    chat_template: bool | Literal["auto"] = Field(
        "auto",
        description="Render prompts with the tokenizer's chat template (with the generation prompt) "
        "and tokenize the result with no extra special tokens. 'auto': for prompts that are lists of "
        "messages, and for every prompt when system_prompt is set; false: never (a message list is then "
        "an error).",
    )
    system_prompt: str | None = Field(
        None,
        description="A system message put before each prompt's messages (a row that starts with a "
        "system message keeps its own); applies the chat template.",
    )
    max_eval_examples: int = Field(256, gt=0, description="Evaluate on at most this many rows.")
    shuffle: bool = Field(True, description="Shuffle the training rows each epoch (seeded).")
    truncate_prompts: bool = Field(
        False,
        description="Cut prompts that do not fit the model's context with generation.max_new_tokens "
        "(keeping their end) instead of failing; the run log says how many were cut.",
    )
    max_prompt_bytes: int = Field(
        1 << 20,
        gt=0,
        description="A prompt longer than this many UTF-8 bytes is refused (naming its file and "
        "line) before it is tokenized; with truncate_prompts it is first cut to its last max_prompt_bytes bytes. "
        "Tokenizing a huge prompt costs ~400x its size in memory.",
    )

    @model_validator(mode="after")
    def _system_prompt_needs_template(self) -> DataConfig:
        if self.system_prompt is not None and self.chat_template is False:
            raise ValueError(
                "data.system_prompt is put in through the chat template; data.chat_template=false "
                "leaves it out: set chat_template to 'auto' or true, or drop system_prompt"
            )
        return self


class AlgorithmConfig(Section):
    loss: Literal["pg", "grpo", "aipo", "tis"] = Field(
        "aipo", description="Policy loss; 'pg' is plain policy gradient with no importance weight."
    )
    group_size: int = Field(8, ge=2, description="Completions per prompt (G).")
    groups_per_step: int = Field(8, gt=0, description="Groups per optimizer step (B).")
    max_staleness: int = Field(
        1, ge=0, description="Max versions a rollout may lag when trained; 0 = synchronous."
    )
    delta: float = Field(2.0, gt=0, description="Truncation of the importance weight (AIPO/TIS).")
    clip_eps: float = Field(0.2, gt=0, description="PPO clip range (grpo/tis).")
    advantage_scale: Literal["none", "std"] = Field(
        "none", description="Divide group-centred rewards by the group's std."
    )
    aggregation: Literal["token", "sequence"] = Field("token", description="Loss averaging.")
    kl_coef: float = Field(
        0.0,
        ge=0,
        description="KL penalty to the initial model (0 = off). The frozen reference is kept "
        "in model.dtype's compute dtype (bf16 on CUDA by default), not as a second fp32 copy.",
    )


class CheckpointConfig(Section):
    every_steps: int = Field(50, gt=0, description="Checkpoint every this many steps.")
    keep: int = Field(2, gt=0, description="Checkpoints kept (oldest deleted first).")


class EvalConfig(Section):
    every_steps: int = Field(25, gt=0, description="Evaluate every this many steps.")


class WandbConfig(Section):
    """``[logging.wandb]``: log to Weights & Biases (the table's presence turns it on)."""

    project: str = Field("loomrl", description="W&B project.")
    entity: str | None = Field(None, description="W&B entity (team or user); None: your default.")
    mode: Literal["online", "offline"] = Field(
        "online",
        description="'offline' writes under RUN_DIR/wandb with no network; `wandb sync` uploads it.",
    )
    tags: list[str] = Field(default_factory=list, description="W&B run tags.")


class LoggingConfig(Section):
    """What the run folder records besides metrics.jsonl."""

    completions_per_step: int = Field(
        4,
        ge=0,
        description="(prompt, completion, reward) samples written to samples.jsonl (and TensorBoard "
        "text) per step: the first completion of each of this many of the step's groups, as text. 0: none.",
    )
    zero_variance_warning_every_steps: int = Field(
        20,
        gt=0,
        description="Warn when more than half of a step's groups got the same reward for every "
        "completion (nothing to learn from them), at most once every this many steps.",
    )
    logprob_mismatch_warning: float = Field(
        0.05,
        gt=0,
        description="Warn when the trainer's and the generators' log-probs of the same tokens at "
        "the same policy version differ by more than this on average (nats, "
        "train/logprob_mismatch_same_version: the training-inference mismatch of engine, kernels "
        "and precision), at most once every zero_variance_warning_every_steps steps.",
    )
    trace: bool = Field(
        True,
        description="Write trace.json: every process's spans (calls, endpoints, publishing, sandbox "
        "runs, lease waits) as Chrome trace events (Perfetto, chrome://tracing; docs/runs.md).",
    )
    wandb: WandbConfig | None = Field(
        None,
        description="Weights & Biases: every metrics record and each step's samples (a table); the "
        "run id follows the run folder, so a resume continues the W&B run. Needs `pip install wandb`.",
    )
    report: bool = Field(
        True,
        description="Write report.html at the end of the run (plots of reward, eval, throughput, "
        "staleness, the executor timeline, weight sync, failures; `loomrl report RUN_DIR` redraws it).",
    )


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

    @model_validator(mode="after")
    def _transport_fits_runtime(self) -> JobConfig:
        ws = self.weight_sync
        if self.runtime in ("process", "ray") and ws.kind == "inproc":
            if "transport" in ws.model_fields_set:
                raise ValueError(
                    "weight_sync.transport='inproc' only reaches executors in this process; "
                    f"runtime={self.runtime!r} needs 'shm' (the default there; one node only), 'files' or 'torch_dist'"
                )
            ws.transport = ShmTransportConfig()
        if self.runtime == "local" and ws.kind == "torch_dist":
            raise ValueError(
                "weight_sync.transport='torch_dist' needs one process per executor; the local "
                "runtime runs executors as threads: use runtime='process', or 'inproc' or 'shm'"
            )
        return self

    @model_validator(mode="after")
    def _sections_fit_together(self) -> JobConfig:
        from loomrl.config_rules import check_job

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

    def to_json(self) -> str:
        return json.dumps(self.model_dump(mode="json"), indent=2, sort_keys=True)


ModelConfig.model_rebuild()


class ConfigError(ValueError):
    """A job file or override that does not describe a valid job."""


def parse_override(text: str) -> tuple[list[str], Any]:
    """``'trainer.lr=3e-4'`` -> ``(['trainer', 'lr'], 3e-4)``; values parse as TOML, else str."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not of the form key.path=value")
    key, raw = text.split("=", 1)
    path = [p for p in key.strip().split(".") if p]
    if not path:
        raise ConfigError(f"override {text!r} has an empty key")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return path, value


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Set each ``key.path=value`` in ``raw``. A tagged table given by its type alone
    (``transport = "files"``) becomes ``{type = "files"}`` when an override sets a key in it."""
    for text in overrides:
        path, value = parse_override(text)
        node = raw
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if isinstance(child, str):
                child = node[part] = {"type": child}
            if not isinstance(child, dict):
                raise ConfigError(f"override {text!r}: {part!r} is not a table")
            node = child
        node[path[-1]] = value
    return raw


def _format_validation_error(err: ValidationError, source: str) -> str:
    lines = [f"invalid job config ({source}):"]
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "<root>"
        if e["type"] == "extra_forbidden":
            hint = suggest(loc, key_paths()) or "check the spelling"
            lines.append(f"  {loc}: unknown key ({hint}; see `loomrl config`)")
        else:
            got = e.get("input")
            got_text = "" if isinstance(got, dict) else f" (got {got!r})"
            lines.append(f"  {loc}: {e['msg']}{got_text}")
    return "\n".join(lines)


def build_config(raw: dict[str, Any], source: str = "<dict>") -> JobConfig:
    try:
        return JobConfig.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err, source)) from None


def load_config(path: str | Path, overrides: list[str] | None = None) -> JobConfig:
    """Read a TOML job file (relative data/model paths resolve from the working dir)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"job file not found: {path}")
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path}: not valid TOML: {err}") from None
    return build_config(apply_overrides(raw, overrides or []), str(path))


def _section_types(annotation: Any) -> list[type[BaseModel]]:
    """The config sections a field holds: its class, or each table of a (tagged) union."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    args = getattr(annotation, "__args__", ()) or getattr(annotation, "__metadata__", ())
    if getattr(annotation, "__origin__", None) is not None and hasattr(annotation, "__metadata__"):
        args = (annotation.__origin__,)  # Annotated[Union[...], Field(discriminator=...)]
    return [t for arg in args for t in _section_types(arg)]


def _choices_text(annotation: Any) -> str:
    """`` [one of: 'a', 'b']`` for a field whose values are a Literal's (with None or a
    bool beside it), else nothing."""
    import typing

    def literals(t: Any) -> list[Any]:
        if typing.get_origin(t) is Literal:
            return list(typing.get_args(t))
        return [v for arg in typing.get_args(t) for v in literals(arg)]

    values = literals(annotation)
    return f" [one of: {', '.join(map(repr, values))}]" if len(values) > 1 else ""


def _default_text(field: Any) -> str:
    if field.is_required():
        return "(required)"
    default = field.get_default(call_default_factory=True)
    return repr(default.model_dump() if isinstance(default, BaseModel) else default)


def key_paths(model: type[BaseModel] = JobConfig, prefix: str = "") -> list[str]:
    """Every dotted key, each table of a tagged section and a list of tables included."""
    paths = []
    for name, field in model.model_fields.items():
        sections = _section_types(field.annotation)
        if not sections:
            paths.append(f"{prefix}{name}")
        for section in sections:
            paths += key_paths(section, f"{prefix}{name}.")
    return sorted(set(paths))


def config_reference(model: type[BaseModel] = JobConfig, prefix: str = "") -> list[str]:
    """Every key with its default and description, one ``key = default    # description``
    line each (what ``loomrl config`` prints and docs/config.md shows). A section is walked
    into; a tagged union is listed table by table, each starting at its ``type`` line."""
    lines = []
    for name, field in model.model_fields.items():
        sections = _section_types(field.annotation)
        if len(sections) == 1 and field.annotation is sections[0]:
            lines += config_reference(sections[0], f"{prefix}{name}.")
            continue
        lines.append(
            f"{prefix}{name} = {_default_text(field)}    # {field.description or ''}"
            + _choices_text(field.annotation)
        )
        for section in sections:
            lines += config_reference(section, f"{prefix}{name}.")
    return lines
