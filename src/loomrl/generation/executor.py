"""The generator executor: the job's engine with its end of the weight transport, built
where it lives (a thread, a process, a Ray actor later)."""

from __future__ import annotations

from loomrl.config import JobConfig
from loomrl.device import module_device
from loomrl.generation.base import Generator
from loomrl.generation.hf import HFGenerator
from loomrl.models.loading import load_policy, resolve_dtype
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
        check_vllm_quantize(cfg)
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
        quantize=gen.quantize,
    )


def check_vllm_quantize(cfg: JobConfig) -> None:
    """Refuse, before vLLM starts, a ``generation.quantize`` it cannot run here (vLLM is
    imported only to ask which device it computes on, for a quantization it may run)."""
    quantize = cfg.generation.quantize
    dtype = str(resolve_dtype(cfg.model)).removeprefix("torch.")
    refusal = vllm_quantize_refusal(quantize, dtype)
    if refusal is None:
        from loomrl.generation import vllm_adapter

        device_type = vllm_adapter.platform_device_type()
        capability = vllm_adapter.platform_capability() if device_type == "cuda" else None
        refusal = vllm_quantize_refusal(quantize, dtype, device_type, capability)
    if refusal is not None:
        raise ValueError(refusal)


def vllm_quantize_refusal(
    quantize: str,
    dtype: str,
    device_type: str | None = None,
    capability: tuple[int, int] | None = None,
) -> str | None:
    """Why a job cannot run the vllm engine with ``generation.quantize=quantize``, weights
    in ``dtype``, on vLLM's ``device_type`` (a CUDA device's ``capability``; None: not
    known yet, only what holds on every device is checked), or None when it can. Written
    against vLLM 0.32's online methods (``vllm_adapter.VLLM_QUANTIZATION``)."""
    if quantize == "int8":
        return (
            "generation.quantize='int8' has no vLLM counterpart for dense Linear layers: "
            "vLLM 0.32's online int8 ('int8_per_channel_weight_only') quantizes MoE experts "
            "only, and its torchao int8 needs the torchao package, which loomrl's vllm extra does "
            "not install; use 'fp8' (vLLM's online fp8_per_channel) or "
            "generation.engine.type='hf' for int8"
        )
    if quantize == "int4":
        return (
            "generation.quantize='int4' is the hf engine's (torch's int4 CPU kernel); vLLM 0.32 "
            "has no online int4 for a bf16 checkpoint (its int4 needs a GPTQ/AWQ-quantized "
            "checkpoint, whose weights an update could not keep): use 'fp8' or "
            "generation.engine.type='hf'"
        )
    if quantize != "fp8":
        return None
    if dtype not in ("bfloat16", "float16"):
        return (
            f"generation.quantize='fp8' with the vllm engine needs model.dtype='bfloat16' "
            f"(vLLM's online fp8 quantizes bfloat16/float16 weights only), got {dtype} "
            "(model.dtype='auto' is float32 on a CPU)"
        )
    if device_type == "cpu":
        return (
            "generation.quantize='fp8' with the vllm engine on vLLM's CPU backend: it runs "
            "(tests/test_vllm_quant.py) but through torch's emulated fp8 matmul, hundreds of "
            "times slower than bf16 (3 vs 2297 tokens/s on a 4M-parameter model); use "
            "generation.engine.type='hf' with quantize='int8' on a CPU, or fp8 on a CUDA GPU"
        )
    if device_type == "cuda" and capability is not None and capability < (8, 9):
        return (
            f"generation.quantize='fp8' with the vllm engine needs a CUDA device of compute "
            f"capability >= 8.9 (fp8 matmuls: Ada, Hopper or newer), got "
            f"{capability[0]}.{capability[1]}"
        )
    return None


def start_generator(cfg: JobConfig, transport: TransportSpec, rank: int) -> Generator:
    """A generator executor with receiving end ``rank`` of ``transport`` (module-level, so
    a ``functools.partial`` of it pickles into a spawned process)."""
    transport, _ = open_transport(transport)
    return build_generator(cfg, transport.receiver(rank))
