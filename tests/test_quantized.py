"""Quantized generation (generation.engine.quantize): the generator's quantized Linear layers follow
every weight update, a delta update equals a full one, and a quantized job runs."""

from __future__ import annotations

import copy

import pytest
import torch

from loomrl.config import AlgorithmConfig, TrainerConfig
from loomrl.generation.hf import HFGenerator, published_state
from loomrl.job import Job
from loomrl.models import load_model_and_tokenizer
from loomrl.models.quantize import CpuInt8Linear, check_quantize, quantize_int8, quantize_linears
from loomrl.models.quantize_int4 import CpuInt4Linear, dequantize_int4, quantize_int4
from loomrl.telemetry.metrics import read_metrics
from loomrl.training.trainer import Trainer, build_token_batch, token_logprobs
from loomrl.types import GenerationRequest, Group, Rollout, SamplingParams
from loomrl.weights import encode_update

from conftest import TINY_MODEL

PROMPTS = ["45+17=", "3+4="]
COMPLETIONS = [[5, 9, 11, 2], [7, 3]]


def _logprobs(model, tok) -> torch.Tensor:
    """Log-probs of fixed completions under ``model``: [rows, seq], masked tokens zero."""
    rollouts = [
        Rollout(0, tok(p).input_ids, c, [0.0] * len(c), [1] * len(c), 0)
        for p, c in zip(PROMPTS, COMPLETIONS)
    ]
    batch = build_token_batch(rollouts, [0.0] * len(rollouts), 0, tok.pad_token_id)
    batch = batch.to(next(model.parameters()).device)
    with torch.no_grad():
        logp, _ = token_logprobs(model, batch, temperature=1.0)
    return (logp.float() * batch.target_mask).cpu()


def _perturbed(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    rng = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=rng) for k, v in state.items()}


def _fresh_quantized(model, state: dict[str, torch.Tensor], kind: str):
    """A copy of ``model`` holding ``state``, then quantized: what the generator should run."""
    fresh = copy.deepcopy(model)
    fresh.load_state_dict(state, strict=False)
    quantize_linears(fresh, kind)
    return fresh.eval()


@pytest.fixture(scope="module")
def trainer_model():
    return load_model_and_tokenizer(TINY_MODEL, seed=1)


def _generator(model, tok, kind: str) -> HFGenerator:
    return HFGenerator(copy.deepcopy(model), tok, publish_dtype="float32", quantize=kind)


def _codes(layer: torch.nn.Module) -> torch.Tensor:
    """A quantized layer's weight codes as the kernel holds them."""
    return layer.packed if isinstance(layer, CpuInt4Linear) else layer.inner.weight().int_repr()


def test_quantize_int8_rounds_per_output_channel():
    w = torch.tensor([[0.5, -1.0, 0.25], [0.0, 0.0, 0.0], [3.0, 1.5, -0.03]])
    q, scales = quantize_int8(w)
    assert torch.equal(scales, torch.tensor([1.0 / 127, 1.0, 3.0 / 127]))
    assert q.dtype == torch.int8 and q[0].tolist() == [64, -127, 32] and q[2, 0] == 127
    assert (q.float() * scales[:, None] - w).abs().max() <= scales.max() / 2


def test_quantize_int4_rounds_within_each_group():
    w = torch.arange(64, dtype=torch.float32).reshape(1, 64) / 10  # groups 0..3.1, 3.2..6.3
    w[0, 5] = 3.0  # inside the first group's range, not on one of its 16 levels
    codes, sz = quantize_int4(w, group=32)
    assert codes.dtype == torch.int32 and sz.shape == (2, 1, 2)  # [groups, out, (scale, zero)]
    assert codes[0, 0] == 0 and codes[0, 31] == 15 and codes[0, 32] == 0 and codes[0, 63] == 15
    assert torch.equal(sz[:, 0, 0], torch.tensor([3.1 / 15, 3.1 / 15]).bfloat16().float())
    back = dequantize_int4(codes, sz, group=32)
    assert (back - w).abs().max() <= sz[:, 0, 0].max() / 2 + 1e-6
    assert back[0, 5] != w[0, 5]  # rounded to a level


def test_the_int4_kernel_computes_with_the_dequantized_weights():
    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 48, bias=True)
    layer = CpuInt4Linear(linear)
    assert layer.group == 128 and layer.weight_bytes() < linear.weight.numel()  # 4 bits a weight
    x = torch.randn(5, 256)
    codes, sz = quantize_int4(linear.weight, group=128)
    # bf16 activations (the kernel's fast path), fp32 accumulation, a bf16 product
    want = x.bfloat16().float() @ dequantize_int4(codes, sz, group=128).t()
    got = layer(x)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want.bfloat16().float() + linear.bias, atol=2e-3, rtol=1e-2)
    assert (got - linear(x)).abs().max() > 2e-2  # it is quantized


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantized_generator_follows_every_update(trainer_model, kind):
    model, tok = trainer_model
    gen = _generator(model, tok, kind)
    layer_type = CpuInt4Linear if kind == "int4" else CpuInt8Linear
    layers = [m for m in gen.model.modules() if isinstance(m, layer_type)]
    assert len(layers) == 2 * 7  # q, k, v, o, gate, up, down per layer; not the head
    assert isinstance(gen.model.get_output_embeddings(), torch.nn.Linear)
    state = published_state(model, torch.float32)
    for version in range(3):
        if version:
            state = _perturbed(state, version)
        gen.update_weights(encode_update(None, state, version=version, base_version=None))
        got = _logprobs(gen.model, tok)
        want = _logprobs(_fresh_quantized(model, state, kind), tok)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        full = copy.deepcopy(model)
        full.load_state_dict(state, strict=False)
        assert (got - _logprobs(full, tok)).abs().max() > 1e-5  # it is quantized, not fp32


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_a_delta_update_to_a_quantized_generator_equals_a_full_one(trainer_model, kind):
    model, tok = trainer_model
    v0 = published_state(model, torch.float32)
    v1 = _perturbed(v0, 7)
    by_delta, by_full = _generator(model, tok, kind), _generator(model, tok, kind)
    by_delta.update_weights(encode_update(None, v0, version=0, base_version=None))
    by_delta.update_weights(encode_update(v0, v1, version=1, base_version=0))
    by_full.update_weights(encode_update(None, v1, version=1, base_version=None))
    assert torch.equal(_logprobs(by_delta.model, tok), _logprobs(by_full.model, tok))
    layers = zip(by_delta.quantized.modules.values(), by_full.quantized.modules.values())
    for a, b in layers:
        assert torch.equal(_codes(a), _codes(b))
    sp = SamplingParams(max_new_tokens=5, temperature=0.8)
    req = [GenerationRequest(tok("12+3=").input_ids, 3, sp, seed=4)]
    a, b = by_delta.generate(req)[0], by_full.generate(req)[0]
    assert a.token_ids == b.token_ids
    assert a.logprobs == b.logprobs


def test_fp8_on_the_cpu_is_a_clear_error(trainer_model, tiny_job):
    model, tok = trainer_model
    with pytest.raises(ValueError, match="quantize='fp8' needs a CUDA device"):
        HFGenerator(copy.deepcopy(model), tok, quantize="fp8")
    with pytest.raises(ValueError, match="quantize='fp8' needs a CUDA device"):  # at start
        Job(tiny_job(generation={"engine": {"quantize": "fp8"}}, model={"device": "cpu"})).run()


def test_int4_off_the_cpu_is_a_clear_error():
    with pytest.raises(ValueError, match="quantize='int4' runs on the CPU only"):
        check_quantize("int4", torch.device("cuda"))
    check_quantize("int4", torch.device("cpu"))  # no error there


def test_the_trainer_logs_the_share_of_ratios_past_delta(trainer_model):
    model, tok = trainer_model
    model = copy.deepcopy(model)
    rollouts = []
    for i in range(8):  # behaviour log-probs about e lower than the policy's on odd rollouts
        prompt, completion = tok(PROMPTS[i % 2]).input_ids, [7 + i % 4] * (1 + i % 3)
        behaviour = [-4.6 - (i % 2)] * len(completion)
        rollouts.append(Rollout(i, prompt, completion, behaviour, [1] * len(completion), 0))
        rollouts[-1].reward = float(i // 2 % 2)
    batch = build_token_batch(rollouts, [0.0] * 8, 0, tok.pad_token_id)
    with torch.no_grad():
        logp, _ = token_logprobs(model, batch, temperature=1.0)
    over = (torch.exp(logp - batch.behaviour) > 2.0).float() * batch.target_mask
    want = float(over.sum() / batch.target_mask.sum())
    assert 0.2 < want < 0.8  # the check below can tell a wrong share
    trainer = Trainer(
        model, tok, AlgorithmConfig(delta=2.0), TrainerConfig(precision="fp32", lr=1e-3), 1.0
    )
    metrics = trainer.train_step(
        [Group.of_rollouts(g, 0, rollouts[g * 4 : (g + 1) * 4]) for g in range(2)]
    )
    assert metrics["train/importance_ratio_truncated_frac"] == pytest.approx(want, abs=1e-6)
    assert metrics["train/importance_ratio_max"] > 2.0


@pytest.mark.parametrize(
    ("kind", "runtime"), [("int8", "local"), ("int8", "process"), ("int4", "local")]
)
def test_a_quantized_job_runs_end_to_end(tiny_job, kind, runtime):
    cfg = tiny_job(
        generation={"engine": {"quantize": kind}}, trainer={"num_steps": 2}, runtime=runtime
    )
    result = Job(cfg).run()
    assert result.summary["trained"] == 2 * 4 * 4
    steps = [r for r in read_metrics(result.run_dir) if "train/loss" in r]
    assert len(steps) == 2
    for record in steps:
        assert record["train/importance_ratio_max"] >= record["train/importance_ratio_mean"] > 0
        assert 0.0 <= record["train/importance_ratio_truncated_frac"] <= 1.0


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_cuda_quantized_generator_follows_updates(kind):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model, tok = load_model_and_tokenizer(
        "tiny:llama?hidden_size=64&num_layers=2&num_heads=4&intermediate_size=128", seed=1
    )
    model = model.to("cuda", torch.bfloat16)
    gen = HFGenerator(copy.deepcopy(model), tok, quantize=kind, cuda_graphs=True)
    assert len(gen.quantized.modules) == 2 * 7
    state = published_state(model, torch.bfloat16)
    for version in range(2):
        if version:
            state = {k: v + 0.05 * torch.randn_like(v) for k, v in state.items()}
        gen.update_weights(encode_update(None, state, version=version, base_version=None))
        fresh = copy.deepcopy(model)
        fresh.load_state_dict(state, strict=False)
        full = _logprobs(fresh, tok)
        quantize_linears(fresh, kind)
        torch.testing.assert_close(
            _logprobs(gen.model, tok), _logprobs(fresh, tok), atol=1e-5, rtol=0
        )
        assert (_logprobs(gen.model, tok) - full).abs().max() < 0.5
        sp = SamplingParams(max_new_tokens=8)
        out = gen.generate([GenerationRequest(tok("12+3=").input_ids, 4, sp, seed=1)])[0]
        assert all(len(ids) == len(lps) > 0 for ids, lps in zip(out.token_ids, out.logprobs))
