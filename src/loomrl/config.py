"""Typed job configuration: loading a job file, and every section in one place. Imports
without torch, so ``loomrl --help`` answers fast.

One pydantic model per component; unknown keys are errors (``extra="forbid"``). A job is
a TOML file with one table per component; the CLI takes dotted overrides
(``trainer.lr=3e-4``). The fully resolved config is written to the run folder.

Each role's section lives beside its role (``generation/config.py``, ``training/config.py``,
``weights/config.py``, ``scoring/config.py``, ``sandbox/config.py``, ``scheduler/config.py``,
``runtime/config.py``) and the role imports it from there; the sections every role reads
(model, data, algorithm, checkpoints, evaluation, logging) live in ``loomrl.config_common``;
``JobConfig``, which puts them together with the rules that span sections, in
``loomrl.config_job``. This module loads a job and re-exports every section for the job's
callers (``from loomrl.config import JobConfig, load_config``).
"""

from __future__ import annotations

import tomllib
import typing
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ValidationError

from loomrl.config_base import Section
from loomrl.config_common import (
    AlgorithmConfig,
    CheckpointConfig,
    DataConfig,
    EvalConfig,
    LoggingConfig,
    LoraConfig,
    ModelConfig,
)
from loomrl.config_hints import suggest
from loomrl.config_job import JobConfig
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


class ConfigError(ValueError):
    """A job file or override that does not describe a valid job."""


# The override value that unsets a key (None: its "not set" of an optional key); TOML has
# no null, and the string is written quoted: ``key='null'``.
UNSET = "null"


def parse_override(text: str) -> tuple[list[str], Any]:
    """``'trainer.lr=3e-4'`` -> ``(['trainer', 'lr'], 3e-4)``; values parse as TOML, else str;
    ``key=null`` -> ``(['key'], None)``, the key unset (docs/config.md, "Unsetting a key")."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not of the form key.path=value")
    key, raw = text.split("=", 1)
    path = [p for p in key.strip().split(".") if p]
    if not path:
        raise ConfigError(f"override {text!r} has an empty key")
    if raw.strip() == UNSET:
        return path, None
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
            if got is None:
                got_text = " (got null: only a key whose default is none can be unset)"
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
