"""The generator executor: the job's engine with its end of the weight transport, built
where it lives (a thread, a process, a Ray actor later)."""

from __future__ import annotations

from loomrl.config import JobConfig
from loomrl.device import module_device
from loomrl.generation.base import Generator
from loomrl.generation.hf import HFGenerator
from loomrl.models.loading import load_policy
from loomrl.weights.publisher import Subscriber
from loomrl.weights.transports import TransportSpec, open_transport


def build_generator(cfg: JobConfig, receiver) -> Generator:
    """The job's generation engine (``generation.engine.type``), fed by ``receiver`` (one
    end of the weight transport)."""
    if cfg.generation.engine.type == "vllm":
        return build_vllm_generator(cfg, receiver)
    model, tokenizer = load_policy(cfg.model, seed=cfg.seed)
    ws, gen = cfg.weight_sync, cfg.generation
    device_type = module_device(model).type
    cuda_graphs = gen.resolve_cuda_graphs(device_type)
    return HFGenerator(
        model,
        tokenizer,
        subscriber=Subscriber(receiver, prefetch=ws.prefetch),
        publish_dtype=ws.publish_dtype,
        trace=gen.resolve_trace(cfg.runtime, device_type),
        static_cache=cuda_graphs,
        cuda_graphs=cuda_graphs,
        stop=gen.stop,
        quantize=gen.quantize,
        publish_quantized=ws.publish_quantized,
    )


def build_vllm_generator(cfg: JobConfig, receiver) -> Generator:
    """The vLLM engine (``loomrl.generation.vllm_engine``; on AsyncLLM with
    ``async_engine``, ``loomrl.generation.vllm_async``): vLLM is imported only here."""
    from loomrl.generation.vllm_async import AsyncVllmGenerator
    from loomrl.generation.vllm_engine import VllmGenerator

    gen = cfg.generation
    if cfg.model.lora is not None:
        raise ValueError("generation.engine.type='vllm' does not take model.lora yet; use 'hf'")
    if gen.engine.async_engine and cfg.runtime == "process":
        raise ValueError(
            "generation.engine.async_engine=true cannot run on runtime='process': its "
            "executors are daemonic processes, which may not start AsyncLLM's engine-core "
            "process (and it runs an executor's calls one at a time); use runtime='local'"
        )
    if gen.quantize != "none":
        raise ValueError(
            f"generation.quantize={gen.quantize!r} is the hf engine's; with the vllm engine use 'none'"
        )
    model, tokenizer = load_policy(cfg.model, seed=cfg.seed)
    engine = AsyncVllmGenerator if gen.engine.async_engine else VllmGenerator  # concurrent generate
    return engine(
        model.to("cpu"),  # vLLM holds the weights on the device; the mirror stays in host memory
        tokenizer,
        engine=gen.engine,
        subscriber=Subscriber(receiver, prefetch=cfg.weight_sync.prefetch),
        publish_dtype=cfg.weight_sync.publish_dtype,
        stop=gen.stop,
        seed=cfg.seed,
    )


def start_generator(cfg: JobConfig, transport: TransportSpec, rank: int) -> Generator:
    """A generator executor with receiving end ``rank`` of ``transport`` (module-level, so
    a ``functools.partial`` of it pickles into a spawned process)."""
    transport, _ = open_transport(transport)
    return build_generator(cfg, transport.receiver(rank))
