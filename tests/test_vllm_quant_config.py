"""Which ``generation.quantize`` the vllm engine refuses, and that it refuses before vLLM or
the model load (no vLLM needed: the default suite). The quantized engine itself is
tests/test_vllm_quant.py (``make test-vllm``)."""

from __future__ import annotations

import pytest

from loomrl.generation.executor import build_vllm_generator, vllm_quantize_refusal


def test_int8_is_refused_naming_what_the_vllm_engine_offers():
    refusal = vllm_quantize_refusal("int8", "bfloat16", "cpu")
    assert "generation.quantize='int8'" in refusal and "MoE experts only" in refusal
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
    ("quantize", "match"),
    [
        ("int8", "no vLLM counterpart"),
        ("int4", "no online int4"),
        ("fp8", "model.dtype='bfloat16'"),
    ],
)
def test_the_vllm_generator_refuses_at_start(tiny_job, tmp_path, quantize, match):
    engine = {"type": "vllm", "multiprocessing": False}
    cfg = tiny_job(model={"dtype": "float32"}, generation={"quantize": quantize, "engine": engine})
    with pytest.raises(ValueError, match=match):
        build_vllm_generator(cfg, None)  # before the model loads or vLLM imports


def test_fp8_maps_to_vllms_online_fp8_per_channel_and_none_to_no_quantization():
    from loomrl.generation.engine_config import VllmEngineConfig
    from loomrl.generation.vllm_adapter import _engine_kwargs

    settings = dict(dtype="bfloat16", seed=0, device_type="cuda", engine=VllmEngineConfig())
    kwargs = _engine_kwargs(max_model_len=None, quantize="fp8", **settings)
    assert kwargs["quantization"] == "fp8_per_channel"
    assert "quantization" not in _engine_kwargs(max_model_len=None, quantize="none", **settings)
    with pytest.raises(ValueError, match="generation.quantize='int8' has no vLLM online"):
        _engine_kwargs(max_model_len=None, quantize="int8", **settings)
