"""The generator executor: the job's engine with its end of the weight transport, built
where it lives (a thread, a process, a Ray actor later), from its sections of the config."""

from __future__ import annotations

from dataclasses import dataclass

from loomrl.config_common import ModelConfig
from loomrl.device import module_device
from loomrl.generation import vllm_adapter
from loomrl.generation.base import Generator
from loomrl.generation.config import GenerationConfig
from loomrl.generation.engine_config import vllm_quantize_refusal
from loomrl.generation.hf import HFGenerator
from loomrl.generation.vllm_async import AsyncVllmGenerator
from loomrl.generation.vllm_engine import VllmGenerator
from loomrl.models.loading import load_policy, resolve_dtype
from loomrl.weights.config import WeightSyncConfig
from loomrl.weights.publisher import Subscriber
from loomrl.weights.transports import TransportSpec, open_transport


@dataclass(frozen=True)
class GeneratorSetup:
    """What a generator executor is built from: its sections of the job's config, and the
    few job-wide values it needs (pickles into a spawned process or an actor)."""

    model: ModelConfig
    generation: GenerationConfig
    weight_sync: WeightSyncConfig
    seed: int  # the job's: the initial weights of a 'tiny:' model, vLLM's sampling seed
    runtime: str  # 'local', 'process' or 'ray': where the hf engine's 'auto' traces pay


def build_generator(cfg: GeneratorSetup, receiver) -> Generator:
    """The job's generation engine (``generation.engine.type``), fed by ``receiver`` (one
    end of the weight transport)."""
    if cfg.generation.engine.type == "vllm":
        return build_vllm_generator(cfg, receiver)
    model, tokenizer = load_policy(cfg.model, seed=cfg.seed)
    ws, gen, engine = cfg.weight_sync, cfg.generation, cfg.generation.engine
    device_type = module_device(model).type
    cuda_graphs = engine.resolve_cuda_graphs(device_type)
    return HFGenerator(
        model,
        tokenizer,
        subscriber=Subscriber(receiver, prefetch=ws.prefetch),
        publish_dtype=ws.publish_dtype,
        trace=engine.resolve_trace(cfg.runtime, device_type),
        static_cache=cuda_graphs,
        cuda_graphs=cuda_graphs,
        stop=gen.stop,
        quantize=engine.quantize,
        publish_quantized=ws.publish_quantized,
        inflight_every_tokens=gen.inflight_every_tokens if gen.inflight_updates else None,
        partial_rollouts=gen.partial_rollouts,
    )


def build_vllm_generator(cfg: GeneratorSetup, receiver) -> Generator:
    """The vLLM engine (``loomrl.generation.vllm_engine``; on AsyncLLM with
    ``async_engine``, ``loomrl.generation.vllm_async``): vLLM is imported only here. What
    the config alone can refuse was refused when the job loaded (``loomrl.config_job``)."""
    engine = cfg.generation.engine
    if engine.quantize != "none":
        check_vllm_quantize(cfg)
    model, tokenizer = load_policy(cfg.model, seed=cfg.seed)
    # AsyncLLM: concurrent generate calls
    generator = AsyncVllmGenerator if engine.async_engine else VllmGenerator
    return generator(
        # vLLM holds the weights on the device; the mirror stays in host memory
        model.to("cpu"),
        tokenizer,
        engine=engine,
        subscriber=Subscriber(receiver, prefetch=cfg.weight_sync.prefetch),
        publish_dtype=cfg.weight_sync.publish_dtype,
        stop=cfg.generation.stop,
        seed=cfg.seed,
        quantize=engine.quantize,
    )


def check_vllm_quantize(cfg: GeneratorSetup) -> None:
    """Refuse, before vLLM starts, a ``generation.engine.quantize`` it cannot run on this
    machine: the dtype 'auto' resolves to and the device vLLM computes on are known only
    here (vLLM is imported to ask which device, for a quantization it may run)."""
    quantize = cfg.generation.engine.quantize
    dtype = str(resolve_dtype(cfg.model)).removeprefix("torch.")
    refusal = vllm_quantize_refusal(quantize, dtype)
    if refusal is None:
        device_type = vllm_adapter.platform_device_type()
        capability = vllm_adapter.platform_capability() if device_type == "cuda" else None
        refusal = vllm_quantize_refusal(quantize, dtype, device_type, capability)
    if refusal is not None:
        raise ValueError(refusal)


def start_generator(cfg: GeneratorSetup, transport: TransportSpec, rank: int) -> Generator:
    """A generator executor with receiving end ``rank`` of ``transport`` (module-level, so
    a ``functools.partial`` of it pickles into a spawned process)."""
    transport, _ = open_transport(transport)
    return build_generator(cfg, transport.receiver(rank))
