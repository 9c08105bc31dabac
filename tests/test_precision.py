"""Precision policies, compute dtypes, token-budget micro-batches and gradient checkpointing."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from loomrl.config import AlgorithmConfig, ModelConfig, TrainerConfig
from loomrl.models.loading import load_policy, resolve_dtype
from loomrl.models.tiny import build_tiny_model
from loomrl.training.precision import chunk_tokens, resolve_precision
from loomrl.training.trainer import Trainer, micro_batch_slices
from loomrl.types import Group, Rollout


def _model():
    return build_tiny_model(
        "llama", seed=3, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64
    )


def _groups(n_groups=2, size=4) -> list[Group]:
    rollouts = [
        Rollout(
            i,
            [1, 5 + i % 3, 6] + [9] * (i % 2),
            [7 + i % 4] * (1 + i % 3),
            [-1.5] * (1 + i % 3),
            [1] * (1 + i % 3),
            0,
            reward=float(i % 2),
        )
        for i in range(n_groups * size)
    ]
    return [Group.of_rollouts(g, 0, rollouts[g * size : (g + 1) * size]) for g in range(n_groups)]


def test_auto_dtype_and_precision_are_fp32_on_the_cpu_and_bf16_on_cuda():
    cfg = ModelConfig()
    assert resolve_dtype(cfg, torch.device("cpu")) == torch.float32
    assert resolve_dtype(cfg, torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype(ModelConfig(dtype="float16"), torch.device("cpu")) == torch.float16
    assert resolve_precision(TrainerConfig(), torch.device("cpu")) == "fp32"
    assert resolve_precision(TrainerConfig(), torch.device("cuda")) == "bf16_mixed"
    # chunked log-probs: off only where the CPU trains in fp32 (the golden record's path)
    assert chunk_tokens(TrainerConfig(), "fp32", torch.device("cpu")) is None
    assert chunk_tokens(TrainerConfig(), "fp32", torch.device("cuda")) == 512
    assert chunk_tokens(TrainerConfig(), "bf16_mixed", torch.device("cpu")) == 512


def test_auto_chunks_the_log_probs_of_a_large_vocabulary_in_fp32_on_the_cpu():
    """Where the [tokens, vocabulary] log-softmax holds the step's peak (Qwen2's 151,936),
    'auto' chunks even in fp32 on the CPU; a small vocabulary keeps the exact path."""
    cpu, cfg = torch.device("cpu"), TrainerConfig()
    assert chunk_tokens(cfg, "fp32", cpu, vocab=151_936) == 512
    assert chunk_tokens(cfg, "fp32", cpu, vocab=cfg.chunked_logprobs_min_vocab - 1) is None
    assert chunk_tokens(TrainerConfig(chunked_logprobs=False), "fp32", cpu, vocab=151_936) is None
    model, tok = build_tiny_model("llama", hidden_size=32, num_layers=1, num_heads=2)
    vocab = model.get_output_embeddings().weight.shape[0]
    assert vocab < cfg.chunked_logprobs_min_vocab <= 151_936
    assert Trainer(model, tok, AlgorithmConfig(), TrainerConfig(trace=False), 1.0).chunk is None
    low = TrainerConfig(chunked_logprobs_min_vocab=vocab, trace=False)
    assert Trainer(model, tok, AlgorithmConfig(), low, 1.0).chunk == 512


def test_load_policy_loads_the_compute_dtype():
    model, _ = load_policy(
        ModelConfig(
            path="tiny:llama?hidden_size=32&num_layers=1&num_heads=2",
            dtype="bfloat16",
            device="cpu",
        )
    )
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    model, _ = load_policy(
        ModelConfig(path="tiny:llama?hidden_size=32&num_layers=1&num_heads=2", device="cpu")
    )
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_bf16_mixed_keeps_fp32_masters_and_computes_under_bf16_autocast():
    model, tok = _model()
    trainer = Trainer(
        model, tok, AlgorithmConfig(), TrainerConfig(lr=1e-3, precision="bf16_mixed"), 1.0
    )
    losses = [trainer.train_step(_groups())["train/loss"]]
    seen = []  # after the first step, which also probes the cache outside training
    model.model.layers[0].self_attn.q_proj.register_forward_hook(
        lambda m, i, out: seen.append(out.dtype)
    )
    losses.append(trainer.train_step(_groups())["train/loss"])
    assert all(math.isfinite(v) for v in losses)
    assert seen and set(seen) == {torch.bfloat16}
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    states = [s for s in trainer.optimizer.state.values()]
    assert states and {s["exp_avg"].dtype for s in states} == {torch.float32}


def test_bf16_trains_bf16_weights_and_state_with_fp32_logprobs():
    model, tok = _model()
    trainer = Trainer(model, tok, AlgorithmConfig(), TrainerConfig(lr=1e-2, precision="bf16"), 1.0)
    before = [p.detach().clone() for p in model.parameters()]
    metrics = trainer.train_step(_groups())
    assert math.isfinite(metrics["train/loss"]) and metrics["train/update_rms"] > 0
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert {s["exp_avg"].dtype for s in trainer.optimizer.state.values()} == {torch.bfloat16}
    assert any(not torch.equal(a, b) for a, b in zip(model.parameters(), before))
    assert trainer.chunk is not None  # fp32 log-probs from bf16 hidden states


def test_kl_reference_is_kept_in_the_compute_dtype():
    model, tok = _model()
    trainer = Trainer(
        model,
        tok,
        AlgorithmConfig(kl_coef=0.1),
        TrainerConfig(lr=1e-3, precision="bf16_mixed"),
        1.0,
        reference_dtype=torch.bfloat16,
    )
    assert {p.dtype for p in trainer.reference.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}
    assert not any(p.requires_grad for p in trainer.reference.parameters())
    metrics = trainer.train_step(_groups())
    assert math.isfinite(metrics["train/kl"]) and metrics["train/kl"] >= 0


def _step_grads(cfg: TrainerConfig, groups):
    model, tok = _model()
    trainer = Trainer(model, tok, AlgorithmConfig(), cfg, 1.0)
    metrics = trainer.train_step(groups)  # the step leaves its gradients on the parameters
    return metrics, [p.grad.clone() for p in model.parameters()]


def test_token_budget_micro_batches_give_the_row_micro_batches_loss_and_grads():
    groups = _groups(3, 4)
    want, want_grads = _step_grads(TrainerConfig(micro_batch_size=64, trace=False), groups)
    got, got_grads = _step_grads(
        TrainerConfig(micro_batch_size=64, max_tokens_per_micro_batch=20, trace=False), groups
    )
    assert got["train/loss"] == pytest.approx(want["train/loss"], abs=1e-6)
    assert got["train/grad_norm"] == pytest.approx(want["train/grad_norm"], rel=1e-5)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_micro_batch_slices_respect_rows_and_padded_tokens():
    rollouts = [
        Rollout(i, [1] * 3, [2] * n, [0.0] * n, [1] * n, 0)
        for i, n in enumerate([1, 1, 5, 1, 20, 2])
    ]
    lengths = [4, 4, 8, 4, 23, 5]
    assert micro_batch_slices(rollouts, 64, None) == [slice(0, 6)]
    assert micro_batch_slices(rollouts, 4, None) == [slice(0, 4), slice(4, 6)]
    slices = micro_batch_slices(rollouts, 64, 16)
    # the 23-token row goes alone
    assert slices == [slice(0, 2), slice(2, 4), slice(4, 5), slice(5, 6)]
    for s in slices:
        rows = lengths[s]
        assert len(rows) == 1 or max(rows) * len(rows) <= 16


def test_gradient_checkpointing_gives_equal_grads():
    groups = _groups()
    _, want = _step_grads(TrainerConfig(shared_prefix=False, trace=False), groups)
    _, got = _step_grads(TrainerConfig(gradient_checkpointing=True, trace=False), groups)
    model, tok = _model()
    trainer = Trainer(
        model, tok, AlgorithmConfig(), TrainerConfig(gradient_checkpointing=True, trace=True), 1.0
    )
    assert (
        model.is_gradient_checkpointing and trainer._prefix_ok is False and trainer.traces is None
    )
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8)


def test_config_errors_name_the_bad_value():
    with pytest.raises(ValidationError, match="precision"):
        TrainerConfig(precision="fp16")
    with pytest.raises(ValidationError, match="max_tokens_per_micro_batch"):
        TrainerConfig(max_tokens_per_micro_batch=0)
    with pytest.raises(ValidationError, match="logprob_chunk_tokens"):
        TrainerConfig(logprob_chunk_tokens=0)
    with pytest.raises(ValidationError, match="dtype"):
        ModelConfig(dtype="float8")


def test_gradient_checkpointing_on_a_model_without_it_is_a_clear_error():
    class NoCheckpointing(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(2, 2)

    _, tok = _model()
    with pytest.raises(ValueError, match="NoCheckpointing does not support gradient checkpointing"):
        Trainer(
            NoCheckpointing(),
            tok,
            AlgorithmConfig(),
            TrainerConfig(gradient_checkpointing=True),
            1.0,
        )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bf16_mixed_train_step_on_cuda():
    model, tok = _model()
    trainer = Trainer(model.cuda(), tok, AlgorithmConfig(kl_coef=0.05), TrainerConfig(lr=1e-3), 1.0)
    assert trainer.precision == "bf16_mixed" and trainer.chunk is not None
    assert (
        trainer.reference is not None
        and next(trainer.reference.parameters()).dtype == torch.bfloat16
    )
    metrics = trainer.train_step(_groups())
    assert math.isfinite(metrics["train/loss"]) and {p.dtype for p in model.parameters()} == {
        torch.float32
    }


def test_chunked_logprobs_through_a_lora_model_equal_the_full_ones():
    from loomrl.models.loading import apply_lora
    from loomrl.training.trainer import build_token_batch, token_logprobs

    model, tok = _model()
    model = apply_lora(model, 4, 8.0, ["q_proj", "v_proj"])
    for p in model.parameters():  # a non-zero adapter, so that it shows in the log-probs
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.05)
    rollouts = [r for g in _groups() for r in g]
    batch = build_token_batch(rollouts, [0.5] * len(rollouts), 0, tok.pad_token_id)
    full, _ = token_logprobs(model, batch, 1.0, None)
    chunked, _ = token_logprobs(model, batch, 1.0, 4)
    mask = batch.target_mask.bool()
    torch.testing.assert_close(chunked[mask], full[mask], rtol=0, atol=1e-6)
