"""``[generation]``: the generators' engine, sampling and decode settings."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from loomrl.config_base import Section
from loomrl.generation.engine_config import EngineConfig, HFEngineConfig


class GenerationConfig(Section):
    engine: EngineConfig = Field(
        default_factory=HFEngineConfig,
        description="Generation engine: "
        "[generation.engine] type = 'hf' or 'vllm' with its settings (docs/engines.md); engine = 'hf' too.",
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

    @model_validator(mode="after")
    def _stop_strings_not_empty(self) -> GenerationConfig:
        if "" in self.stop:
            raise ValueError(
                "generation.stop holds an empty string, which every completion holds; remove it"
            )
        return self

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
    trace: bool | Literal["auto"] = Field(
        "auto",
        description="Forward passes from TorchScript traces, one per batch shape: bit-identical "
        "to eager, and no GIL held while they run. 'auto': on where executors share a process "
        "(runtime='local') and the model is on the CPU, the one place that pays for the tracing; "
        "off on CUDA, where the GIL is not what limits a forward and the traces cost time (26% of "
        "a 0.36B Qwen2 RL step on an H200). Eager for PEFT and non-DynamicCache models, or after a "
        "trace fails.",
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
        "only: torch's int4 CPU kernel). With the vllm engine: 'fp8' only, vLLM's own online "
        "fp8_per_channel on CUDA (sm89+, model.dtype bf16/fp16), kept through its layerwise "
        "reload on every update; the rest is a start error there. The generator keeps the published weights unquantized and "
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
