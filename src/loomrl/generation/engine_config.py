"""Which generation engine a job runs, and that engine's own settings.

``[generation.engine]`` is a table tagged by ``type``: ``"hf"`` (the embedded transformers
engine, ``loomrl.generation.hf``) or ``"vllm"`` (``loomrl.generation.vllm_engine``). The old
string form ``generation.engine = "hf"`` is read as ``{type = "hf"}``. Imports without torch
or vLLM (the config package must).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field

from loomrl.config_base import Section as _Engine


class HFEngineConfig(_Engine):
    """The embedded transformers engine: its knobs are ``generation.trace``,
    ``generation.cuda_graphs`` and ``generation.quantize``."""

    type: Literal["hf"] = Field("hf", description="The embedded transformers engine.")


class VllmEngineConfig(_Engine):
    """vLLM (``pip install 'loomrl[vllm]'`` on a GPU; ``make vllm-env`` on a CPU)."""

    type: Literal["vllm"] = Field("vllm", description="The vLLM engine.")
    gpu_memory_utilization: float = Field(
        0.5,
        gt=0,
        le=1,
        description="Share of the GPU's memory vLLM may take for weights, activations and its "
        "key/value cache (the trainer needs the rest when it shares the device).",
    )
    cpu_kv_cache_gb: float = Field(
        1.0,
        gt=0,
        description="Key/value cache size on a CPU, in GiB (vLLM's VLLM_CPU_KVCACHE_SPACE).",
    )
    max_model_len: int | None = Field(
        None,
        gt=0,
        description="Longest prompt plus completion in tokens; None: the model's "
        "max_position_embeddings.",
    )
    max_num_seqs: int = Field(256, gt=0, description="Sequences vLLM schedules at once at most.")
    enforce_eager: bool = Field(
        False,
        description="No CUDA graphs or torch.compile in vLLM (faster start, slower decode); "
        "always on for a CPU.",
    )
    multiprocessing: bool = Field(
        True,
        description="Run vLLM's engine core in its own process (vLLM's default). False runs it "
        "in the generator's process (VLLM_ENABLE_V1_MULTIPROCESSING=0): starts in seconds on a "
        "CPU, for tests. With async_engine the engine core has a process of its own either "
        "way; False keeps vLLM's worker in it (8-18 s to start on 2 cores, against 31 s).",
    )
    async_engine: bool = Field(
        False,
        description="Drive vLLM's AsyncLLM on an event loop of its own: generate calls overlap "
        "(each request goes to vLLM as it comes and vLLM batches them continuously), for "
        "multi-turn environments and several rollouts in flight on one engine. Weights still "
        "change only between requests: a reload waits for the calls in flight. Needs "
        "runtime='local' (its pool runs the calls concurrently; docs/engines.md).",
    )


def _engine_from_string(value: Any) -> Any:
    """``engine = "hf"`` (the old form) is ``[engine] type = "hf"``."""
    return {"type": value} if isinstance(value, str) else value


EngineConfig = Annotated[
    HFEngineConfig | VllmEngineConfig,
    BeforeValidator(_engine_from_string),
    Field(discriminator="type"),
]
