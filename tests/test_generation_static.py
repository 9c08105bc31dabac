"""The generator's static-cache decode step (loomrl.generation.static_decode) against the
dynamic-cache loop, bf16 weights with fp32 sampling, and the engine knobs per device.
The CUDA-graph tests need a GPU (``gpu`` mark)."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from loomrl.generation.engine_config import HFEngineConfig
from loomrl.generation.hf import HFGenerator
from loomrl.generation.static_decode import (
    LENGTH_BUCKET,
    grouped_decode_attention,
    static_decode_unsupported,
)
from loomrl.models import build_tiny_model
from loomrl.training.trainer import build_token_batch, token_logprobs
from loomrl.types import GenerationRequest, Rollout, SamplingParams
from loomrl.weights import encode_update
from loomrl.weights.params import published_state

TINY = dict(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64)
PROMPTS = ("12+3=", "1+1234=", "9=")  # three widths: left padding in one batch


def make_generator(model, tok, **knobs) -> HFGenerator:
    gen = HFGenerator(model, tok, publish_dtype="float32", **knobs)
    state = published_state(model, next(model.parameters()).dtype)
    gen.update_weights(encode_update(None, state, version=0, base_version=None))
    return gen


def requests(
    tok, sampling: SamplingParams, prompts=PROMPTS, seed: int = 7
) -> list[GenerationRequest]:
    return [
        GenerationRequest(tok(p).input_ids, 3, sampling, seed=seed + i)
        for i, p in enumerate(prompts)
    ]


def completions(results):
    """Every completion of ``results`` as ``(token_ids, logprobs, finish_reason)``."""
    return [c for r in results for c in zip(r.token_ids, r.logprobs, r.finish_reasons)]


def assert_same_completions(expected, actual, atol: float = 1e-5) -> None:
    for want, got in zip(completions(expected), completions(actual), strict=True):
        assert got[0] == want[0] and got[2] == want[2]
        assert got[1] == pytest.approx(want[1], abs=atol)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_static_cache_decoding_gives_the_dynamic_loops_tokens_and_logprobs(arch, top_p):
    model, tok = build_tiny_model(arch, seed=1, **TINY)
    dynamic, static = make_generator(model, tok), make_generator(model, tok, static_cache=True)
    assert dynamic._static is None and static._static is not None
    sampling = SamplingParams(temperature=1.5, top_p=top_p, max_new_tokens=20)
    expected = dynamic.generate(requests(tok, sampling))
    assert_same_completions(expected, static.generate(requests(tok, sampling)))
    finished = [(finish, len(ids)) for ids, _, finish in completions(expected)]
    assert ("length", 20) in finished  # some rows run to the end ...
    # ... and some stop mid-way at EOS
    assert any(reason == "stop" and n < 20 for reason, n in finished)


def test_the_static_cache_is_reused_across_calls_of_other_prompt_widths_and_stays_exact():
    model, tok = build_tiny_model("llama", seed=2, **TINY)
    dynamic, static = make_generator(model, tok), make_generator(model, tok, static_cache=True)
    sampling = SamplingParams(temperature=1.2, max_new_tokens=12)
    # stale positions from a longer call
    for prompts in (PROMPTS, ("123456789+1=", "2=", "77+7="), PROMPTS):
        assert_same_completions(
            dynamic.generate(requests(tok, sampling, prompts)),
            static.generate(requests(tok, sampling, prompts)),
        )
    # every width fits one LENGTH_BUCKET: one cache (one graph on CUDA)
    assert len(static._static._steps) == 1
    assert next(iter(static._static._steps.values())).max_len == LENGTH_BUCKET


def test_greedy_static_decoding_and_a_weight_update_reach_the_static_step():
    model, tok = build_tiny_model("qwen2", seed=3, **TINY)
    dynamic, static = (
        make_generator(model, tok),
        make_generator(copy.deepcopy(model), tok, static_cache=True),
    )
    greedy = SamplingParams(greedy=True, max_new_tokens=10)
    assert_same_completions(
        dynamic.generate(requests(tok, greedy)), static.generate(requests(tok, greedy))
    )
    changed = {
        k: v + 0.05 * torch.randn_like(v) for k, v in published_state(model, torch.float32).items()
    }
    for gen in (dynamic, static):
        gen.update_weights(encode_update(gen.mirror, changed, version=1, base_version=0))
    after = static.generate(requests(tok, greedy))
    assert after[0].version == 1
    assert_same_completions(dynamic.generate(requests(tok, greedy)), after)


def test_checking_eos_every_k_steps_reports_what_checking_every_step_does():
    model, tok = build_tiny_model("llama", seed=1, **TINY)
    sampling = SamplingParams(temperature=1.5, max_new_tokens=20)
    every = make_generator(model, tok).generate(requests(tok, sampling))
    for knobs in ({"eos_check_every": 7}, {"eos_check_every": 5, "static_cache": True}):
        assert_same_completions(
            every, make_generator(model, tok, **knobs).generate(requests(tok, sampling))
        )
    with pytest.raises(ValueError, match="eos_check_every must be >= 1, got 0"):
        make_generator(model, tok, eos_check_every=0)


def test_bf16_weights_sample_with_fp32_logprobs_close_to_the_fp32_models():
    model, tok = build_tiny_model("qwen2", seed=4, **TINY)
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    sampling = SamplingParams(temperature=0.8, max_new_tokens=8)
    for knobs in ({}, {"static_cache": True}):
        results = make_generator(bf16, tok, **knobs).generate(requests(tok, sampling))
        logprobs = [lp for _, lps, _ in completions(results) for lp in lps]
        assert all(lp <= 0 for lp in logprobs)
        # fp32 arithmetic after the bf16 forward: most log-probs are not bf16 numbers
        as_bf16 = torch.tensor(logprobs).bfloat16().float().tolist()
        assert sum(a != b for a, b in zip(logprobs, as_bf16)) > len(logprobs) // 2
        # the same tokens scored by the fp32 model with the bf16-rounded weights: bf16 activations apart
        reference = copy.deepcopy(bf16).float()
        rollouts = [
            Rollout(0, tok(p).input_ids, ids, lps, [1] * len(ids), 0)
            for p, r in zip(PROMPTS, results)
            for ids, lps in zip(r.token_ids, r.logprobs)
        ]
        batch = build_token_batch(rollouts, [0.0] * len(rollouts), 0, tok.pad_token_id)
        with torch.no_grad():
            logp, _ = token_logprobs(reference, batch, temperature=0.8)
        assert ((logp - batch.behaviour).abs() * batch.target_mask).max() < 0.05


def gqa_model(tok, seed: int = 8):
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def test_grouped_decode_attention_equals_attention_over_repeated_key_value_heads():
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    gen = torch.Generator().manual_seed(0)
    query, key, value = (
        torch.randn(shape, generator=gen) for shape in ((3, 6, 1, 8), (3, 2, 10, 8), (3, 2, 10, 8))
    )
    mask = torch.rand((3, 1, 1, 10), generator=gen) > 0.3
    mask[:, :, :, 0] = True
    module = SimpleNamespace(num_key_value_groups=3, is_causal=True)
    got, _ = grouped_decode_attention(module, query, key, value, mask, scaling=0.3)
    want = torch.nn.functional.scaled_dot_product_attention(
        query, repeat_kv(key, 3), repeat_kv(value, 3), attn_mask=mask, scale=0.3
    ).transpose(1, 2)
    assert got.shape == (3, 1, 6, 8) and torch.allclose(got, want, atol=1e-6)
    # a prefill (several positions) is transformers' own sdpa
    long_query = torch.randn((3, 6, 4, 8), generator=gen)
    causal, _ = grouped_decode_attention(
        module, long_query, key[:, :, :4], value[:, :, :4], None, scaling=0.3
    )
    assert torch.equal(
        causal,
        sdpa_attention_forward(
            module, long_query, key[:, :, :4], value[:, :, :4], None, scaling=0.3
        )[0],
    )


def test_static_decoding_of_a_grouped_query_attention_model_matches_the_dynamic_loop():
    _, tok = build_tiny_model("qwen2", seed=1, **TINY)
    model = gqa_model(tok)
    dynamic, static = make_generator(model, tok), make_generator(model, tok, static_cache=True)
    sampling = SamplingParams(temperature=1.5, top_p=0.95, max_new_tokens=16)
    # padded, then not padded (no mask on the dynamic side)
    for prompts in (PROMPTS, ("5+5=", "6+6=", "7+7=")):
        assert_same_completions(
            dynamic.generate(requests(tok, sampling, prompts)),
            static.generate(requests(tok, sampling, prompts)),
        )
    # the grouped attention was for the step only
    assert model.config._attn_implementation == "sdpa"


def test_models_the_static_step_cannot_take_decode_on_the_dynamic_cache():
    def fake(impl, layer_types=None):
        return SimpleNamespace(
            config=SimpleNamespace(_attn_implementation=impl, layer_types=layer_types)
        )

    assert (
        static_decode_unsupported(fake("sdpa")) is None
        and static_decode_unsupported(fake("eager")) is None
    )
    assert "flash_attention_2" in static_decode_unsupported(fake("flash_attention_2"))
    assert "sliding_attention" in static_decode_unsupported(
        fake("sdpa", ["full_attention", "sliding_attention"])
    )
    assert "no transformers config" in static_decode_unsupported(SimpleNamespace())
    model, tok = build_tiny_model("llama", seed=1, **TINY)
    model.config._attn_implementation = "eager"  # the additive-mask flavour of the step
    sampling = SamplingParams(temperature=1.5, max_new_tokens=12)
    assert_same_completions(
        make_generator(model, tok).generate(requests(tok, sampling)),
        make_generator(model, tok, static_cache=True).generate(requests(tok, sampling)),
    )


def test_engine_knobs_resolve_per_device():
    auto = HFEngineConfig()
    assert (
        auto.resolve_trace("local", "cpu") is True and auto.resolve_trace("local", "cuda") is False
    )
    assert auto.resolve_trace("process", "cpu") is False
    assert HFEngineConfig(trace=True).resolve_trace("process", "cuda") is True
    assert auto.resolve_cuda_graphs("cuda") is True and auto.resolve_cuda_graphs("cpu") is False
    assert HFEngineConfig(cuda_graphs=False).resolve_cuda_graphs("cuda") is False
    with pytest.raises(ValueError, match="cuda_graphs"):
        HFEngineConfig(cuda_graphs="sometimes")


def test_a_job_with_cuda_graphs_on_a_cpu_decodes_on_the_static_cache(tiny_job):
    from loomrl.job import Job
    from loomrl.telemetry.metrics import read_metrics

    result = Job(
        tiny_job(
            trainer={"num_steps": 2},
            generation={
                "max_new_tokens": 3,
                "prompts_per_request": 2,
                "engine": {"type": "hf", "cuda_graphs": True, "trace": False},
            },
        )
    ).run()
    keys = set().union(*read_metrics(result.run_dir))
    assert "generation/cuda_graphs" in keys and "generation/traced_forwards" not in keys
    assert result.summary["trained"] == 2 * 4 * 4


# -- CUDA ------------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_decoding_equals_the_eager_static_step(dtype):
    model, tok = build_tiny_model("qwen2", seed=5, **TINY)
    model = model.to("cuda", dtype)
    eager = make_generator(model, tok, static_cache=True)
    graphed = make_generator(model, tok, cuda_graphs=True)
    assert eager.eos_check_every > 1 and graphed._static.cuda_graphs
    sampling = SamplingParams(temperature=1.5, max_new_tokens=20)
    for prompts in (PROMPTS, ("123456789+1=", "2=", "77+7=")):
        expected = eager.generate(requests(tok, sampling, prompts))
        results = graphed.generate(requests(tok, sampling, prompts))
        assert_same_completions(expected, results, atol=1e-6)
    # captured once, replayed since
    assert results[0].engine_metrics["generation/cuda_graphs"] == 1.0
    assert results[0].engine_metrics["generation/cuda_graph_failures"] == 0.0


@pytest.mark.gpu
@needs_cuda
def test_cuda_graph_decoding_matches_the_dynamic_loop_in_fp32(monkeypatch):
    # (another test may have set it)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    model, tok = build_tiny_model("llama", seed=6, **TINY)
    model = model.to("cuda")
    sampling = SamplingParams(temperature=1.5, max_new_tokens=20)
    # other attention kernels for other key lengths: equal up to their rounding
    assert_same_completions(
        make_generator(model, tok).generate(requests(tok, sampling)),
        make_generator(model, tok, cuda_graphs=True).generate(requests(tok, sampling)),
        atol=1e-4,
    )


@pytest.mark.gpu
@needs_cuda
def test_graph_decoding_does_not_sync_the_host_every_token():
    import warnings

    model, tok = build_tiny_model("qwen2", seed=7, **TINY)
    gen = make_generator(model.to("cuda"), tok, cuda_graphs=True)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=64)
    gen.generate(requests(tok, sampling))  # capture first
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            gen.generate(requests(tok, sampling))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchronizing" in str(w.message)]
    # prefill, the EOS check every eos_check_every steps and the results' copy to the host: not 64
    assert len(syncs) < 64 // 2, [str(w.message) for w in syncs[:5]]
