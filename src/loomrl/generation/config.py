"""``[generation]``: the generators' engine, sampling and decode settings.

The engine's own keys live in its table (``[generation.engine] type = "hf"``: ``trace``,
``cuda_graphs``, ``quantize``). The old keys ``generation.trace``, ``generation.cuda_graphs``
and ``generation.quantize`` are moved into it with a ``FutureWarning``; one the job's engine
does not take (it had no effect) is an error naming the engine that takes it.
"""

from __future__ import annotations

import warnings
from typing import Any

from pydantic import BaseModel, Field, model_validator

from loomrl.config_base import Section
from loomrl.generation.engine_config import EngineConfig, HFEngineConfig

# The engine keys that sat in [generation]: their old default, and the engines that take them.
_MOVED_KEYS: dict[str, tuple[Any, tuple[str, ...]]] = {
    "trace": ("auto", ("hf",)),
    "cuda_graphs": ("auto", ("hf",)),
    "quantize": ("none", ("hf", "vllm")),
}


def _engine_table(engine: Any) -> dict[str, Any]:
    """``generation.engine`` as a table: from its type alone, a table, or a built section."""
    if isinstance(engine, str):
        return {"type": engine}
    if isinstance(engine, BaseModel):
        return {"type": engine.type, **engine.model_dump(exclude_unset=True)}
    return dict(engine)


def _engine_keys_moved(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` (a ``[generation]`` table) with the old engine keys moved into
    ``[generation.engine]`` (a ``FutureWarning`` names each move). A key at its old default
    moves nowhere: an old config.json lists every key."""
    flat = {key: data.pop(key) for key in list(data) if key in _MOVED_KEYS}
    if not flat:
        return data
    table = _engine_table(data.get("engine", "hf"))
    kind, moved = table.get("type", "hf"), []
    for key, value in flat.items():
        old_default, kinds = _MOVED_KEYS[key]
        if value == old_default:
            continue
        if kind not in kinds:
            raise ValueError(
                f"generation.{key}={value!r} is a key of the {' and '.join(map(repr, kinds))} "
                f"engine (now generation.engine.{key}), and this job's engine is {kind!r}: remove it"
            )
        if key in table and table[key] != value:
            raise ValueError(
                f"generation.{key}={value!r} and generation.engine.{key}={table[key]!r}: "
                f"keep only generation.engine.{key}"
            )
        table[key] = value
        moved.append(f"generation.{key} -> generation.engine.{key}")
    if not moved:
        return data
    warnings.warn(
        "old generation keys, moved into the [generation.engine] table: "
        + ", ".join(moved)
        + "; write them there (the old keys will stop working)",
        FutureWarning,
        stacklevel=2,
    )
    return {**data, "engine": table}


class GenerationConfig(Section):
    engine: EngineConfig = Field(
        default_factory=HFEngineConfig,
        description="Generation engine: "
        "[generation.engine] type = 'hf' or 'vllm' with its settings (trace, cuda_graphs, quantize ...; "
        "docs/engines.md); engine = 'hf' too.",
    )
    temperature: float = Field(1.0, gt=0, description="Sampling temperature.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")
    max_new_tokens: int = Field(16, gt=0, description="Tokens generated per turn at most.")
    stop: list[str] = Field(
        default_factory=list,
        description="Stop strings: a sequence stops sampling once it holds one, and its "
        "completion is cut before the first (the tokens up to the one that completes it are kept for "
        "training; finish reason 'stop'). "
        "Generation also stops on every EOS id of the model's generation_config.",
    )

    prompts_per_request: int = Field(
        4, gt=0, description="Prompt groups batched into one generate call."
    )
    num_generators: int = Field(1, gt=0, description="Generator executors.")
    colocate: bool = Field(
        False,
        description="The generators and the trainer share one device and take turns on it: the "
        "generators' state is offloaded while the trainer steps, publishes or checkpoints, and the "
        "trainer's while they generate (hf: weights to host memory; vllm: sleep mode on CUDA, "
        "stop and restart from the verified weights on a CPU). Generation and training no longer "
        "overlap, even with max_staleness > 0; the colocate/* metrics say what the turns cost "
        "(docs/engines.md).",
    )
    inflight_updates: bool = Field(
        False,
        description="Apply a newer committed weight version in the middle of a request, between two "
        "decode steps (hf engine; docs/async.md#in-flight-updates): the KV cache of earlier tokens is "
        "kept, every token records the version that sampled it, and a rollout's staleness is its "
        "oldest token's. Off: updates only between generate calls.",
    )
    inflight_every_tokens: int = Field(
        16,
        gt=0,
        description="With inflight_updates: decode steps between two looks for a newer version.",
    )
    partial_rollouts: bool = Field(
        False,
        description="With inflight_updates: at an update, requests in flight are cut and continued "
        "as new requests (prompt + tokens so far, the prefix recomputed under the new weights) "
        "instead of keeping the KV cache; one rollout however many cuts.",
    )

    @model_validator(mode="before")
    @classmethod
    def _moved_engine_keys(cls, data: Any) -> Any:
        return _engine_keys_moved(dict(data)) if isinstance(data, dict) else data

    @model_validator(mode="after")
    def _stop_strings_not_empty(self) -> GenerationConfig:
        if "" in self.stop:
            raise ValueError(
                "generation.stop holds an empty string, which every completion holds; remove it"
            )
        return self

    @model_validator(mode="after")
    def _inflight_fits_engine(self) -> GenerationConfig:
        if self.partial_rollouts and not self.inflight_updates:
            raise ValueError(
                "generation.partial_rollouts=true cuts requests at an in-flight update: "
                "set generation.inflight_updates=true too"
            )
        if self.inflight_updates and self.engine.type != "hf":
            raise ValueError(
                f"generation.inflight_updates=true is not built yet for the {self.engine.type!r} "
                "engine (vLLM's AsyncLLM pause/reload/resume is planned); use engine 'hf' or "
                "inflight_updates=false"
            )
        return self
