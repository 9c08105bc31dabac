"""Which ``generation.engine.quantize`` the vllm engine refuses, and that the config refuses
what it can know when the job loads, before vLLM or the model (no vLLM needed: the default
suite). The quantized engine itself is
tests/test_vllm_quant.py (``make test-vllm``)."""

from __future__ import annotations

import pytest

from loomrl.config import ConfigError
from loomrl.generation.engine_config import vllm_quantize_refusal

from conftest import TINY_MODEL


def test_int8_is_refused_naming_what_the_vllm_engine_offers():
    refusal = vllm_quantize_refusal("int8", "bfloat16", "cpu")
    assert "generation.engine.quantize='int8'" in refusal and "MoE experts only" in refusal
    assert "use 'fp8'" in refusal and "engine.type='hf'" in refusal


def test_fp8_needs_bf16_or_fp16_weights_and_an_fp8_capable_cuda_device():
    assert "got float32" in vllm_quantize_refusal("fp8", "float32")
    assert vllm_quantize_refusal("fp8", "bfloat16") is None  # the device is asked next
    assert "hundreds of times slower" in vllm_quantize_refusal("fp8", "bfloat16", "cpu")
    assert vllm_quantize_refusal("fp8", "float16", "cuda", (9, 0)) is None
    assert vllm_quantize_refusal("fp8", "bfloat16", "cuda", (8, 9)) is None
    assert "got 8.0" in vllm_quantize_refusal("fp8", "bfloat16", "cuda", (8, 0))
    assert vllm_quantize_refusal("none", "float32", "cuda", (7, 0)) is None


@pytest.mark.parametrize(
    ("quantize", "model", "match"),
    [
        ("int8", {}, "no vLLM counterpart"),
        ("int4", {}, "no online int4"),
        ("fp8", {"dtype": "float32"}, "model.dtype='bfloat16'"),
        ("fp8", {"device": "cpu"}, "got float32"),  # 'auto' on the CPU
    ],
)
def test_the_vllm_engine_refuses_when_the_job_loads(tiny_job, quantize, model, match):
    engine = {"type": "vllm", "multiprocessing": False, "quantize": quantize}
    with pytest.raises(ConfigError, match=match):
        tiny_job(model=model, generation={"engine": engine})  # no engine built, no vLLM imported


def test_what_the_vllm_engine_cannot_take_is_refused_when_the_job_loads(tiny_job):
    engine = {"type": "vllm", "multiprocessing": False}
    with pytest.raises(ConfigError, match="does not take model.lora"):
        tiny_job(model={"lora": {"r": 4}}, generation={"engine": engine})
    with pytest.raises(ConfigError, match="async_engine=true cannot run on runtime='process'"):
        tiny_job(runtime="process", generation={"engine": {**engine, "async_engine": True}})
    # what only the machine knows ('auto' on an 'auto' device) is left to the engine's start
    cfg = tiny_job(
        model={"path": TINY_MODEL, "dtype": "auto"},
        generation={"engine": {**engine, "quantize": "fp8"}},
    )
    assert cfg.generation.engine.quantize == "fp8"


def test_fp8_maps_to_vllms_online_fp8_per_channel_and_none_to_no_quantization():
    from loomrl.generation.engine_config import VllmEngineConfig
    from loomrl.generation.vllm_adapter import _engine_kwargs

    settings = dict(dtype="bfloat16", seed=0, device_type="cuda", engine=VllmEngineConfig())
    kwargs = _engine_kwargs(max_model_len=None, quantize="fp8", **settings)
    assert kwargs["quantization"] == "fp8_per_channel"
    assert "quantization" not in _engine_kwargs(max_model_len=None, quantize="none", **settings)
    with pytest.raises(ValueError, match="generation.engine.quantize='int8' has no vLLM online"):
        _engine_kwargs(max_model_len=None, quantize="int8", **settings)
