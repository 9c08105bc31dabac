"""The chunked log-probs and entropy are the full log-softmax's, values and gradients."""

from __future__ import annotations

import pytest
import torch

from loomrl.config import AlgorithmConfig, TrainerConfig
from loomrl.models.tiny import build_tiny_model
from loomrl.training.chunked import chunked_logprobs
from loomrl.training.trainer import Trainer, build_token_batch, token_logprobs
from loomrl.types import Group, Rollout


def _full(hidden, weight, targets, temperature):
    logp_all = torch.log_softmax((hidden @ weight.t()).float() / temperature, dim=-1)
    return logp_all.gather(-1, targets[:, None]).squeeze(-1), -(logp_all.exp() * logp_all).sum(-1)


def _grads(fn, hidden, weight, targets, temperature, seed=0):
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    logp, entropy = fn(h, w, targets, temperature)
    gen = torch.Generator().manual_seed(seed)
    # arbitrary upstream gradients on both outputs, as a loss with an entropy term has
    a, b = (
        torch.randn(logp.shape, generator=gen).to(logp.device),
        torch.randn(entropy.shape, generator=gen).to(logp.device),
    )
    ((logp * a).sum() + (entropy * b).sum()).backward()
    return logp.detach(), entropy.detach(), h.grad, w.grad


def _close(a, b, rel):
    return float((a - b).abs().max()) <= rel * float(b.abs().max())


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
def test_chunked_equals_the_full_log_softmax_with_equal_gradients(temperature, chunk):
    gen = torch.Generator().manual_seed(1)
    hidden, weight = torch.randn(53, 32, generator=gen), torch.randn(301, 32, generator=gen) * 0.1
    targets = torch.randint(0, 301, (53,), generator=gen)
    want = _grads(_full, hidden, weight, targets, temperature)
    got = _grads(
        lambda h, w, t, T: chunked_logprobs(h, w, t, T, chunk), hidden, weight, targets, temperature
    )
    # one-row chunks multiply a vector, not a matrix: another BLAS kernel, a few ulps apart
    atol = 4e-6 if chunk == 1 else 1e-6
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=atol)  # log-probs
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=atol)  # entropy
    assert _close(got[2], want[2], 1e-5)  # d hidden
    assert _close(got[3], want[3], 1e-5)  # d weight


def test_chunked_keeps_the_batch_shape_and_computes_in_fp32_from_bf16_inputs():
    gen = torch.Generator().manual_seed(2)
    hidden, weight = torch.randn(3, 5, 16, generator=gen), torch.randn(40, 16, generator=gen)
    targets = torch.randint(0, 40, (3, 5), generator=gen)
    logp, entropy = chunked_logprobs(hidden.bfloat16(), weight.bfloat16(), targets, 1.0, 4)
    assert logp.shape == entropy.shape == (3, 5) and logp.dtype == entropy.dtype == torch.float32
    want, _ = _full(
        hidden.bfloat16().float().view(15, 16), weight.bfloat16().float(), targets.view(15), 1.0
    )
    torch.testing.assert_close(logp.view(15), want, rtol=0, atol=1e-5)


def _rollouts(n=6):
    return [
        Rollout(
            i,
            [1, 5 + i % 3, 6, 9],
            [7 + i % 4] * (1 + i % 3),
            [-1.5] * (1 + i % 3),
            [1] * (1 + i % 3),
            0,
            reward=float(i % 2),
        )
        for i in range(n)
    ]


@pytest.mark.parametrize("shared_prefix", [False, True])
def test_the_trainer_forward_chunked_equals_the_full_one_with_equal_gradients(shared_prefix):
    """Through a real model (token batch and shared-prompt batch): same log-probs, entropy
    and gradients as the full log-softmax path."""
    results = []
    for chunk in (None, 5):
        model, tok = build_tiny_model(
            "llama", seed=3, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64
        )
        trainer = Trainer(
            model, tok, AlgorithmConfig(), TrainerConfig(shared_prefix=shared_prefix), 0.8
        )
        rollouts = _rollouts()
        batch = (
            trainer._micro_batch(rollouts, [0.5] * len(rollouts))
            if shared_prefix
            else build_token_batch(rollouts, [0.5] * len(rollouts), 0, tok.pad_token_id)
        )
        logp, entropy = token_logprobs(trainer.model, batch, 0.8, chunk)
        ((logp * batch.target_mask).sum() + 0.1 * (entropy * batch.target_mask).sum()).backward()
        results.append(
            (logp.detach(), entropy.detach(), [p.grad.clone() for p in model.parameters()])
        )
    (lp0, en0, g0), (lp1, en1, g1) = results
    mask = batch.target_mask.bool()
    torch.testing.assert_close(lp1[mask], lp0[mask], rtol=0, atol=1e-6)
    torch.testing.assert_close(en1[mask], en0[mask], rtol=0, atol=1e-6)
    for a, b in zip(g1, g0):
        assert _close(a, b, 1e-5)


def test_train_steps_with_chunked_logprobs_give_the_full_paths_losses():
    losses = []
    for chunked in (False, True):
        model, tok = build_tiny_model(
            "llama", seed=3, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64
        )
        cfg = TrainerConfig(lr=1e-3, chunked_logprobs=chunked, logprob_chunk_tokens=4, trace=False)
        trainer = Trainer(model, tok, AlgorithmConfig(kl_coef=0.1), cfg, 1.0)
        assert (trainer.chunk is not None) == chunked
        rollouts = _rollouts(8)
        groups = [Group.of_rollouts(g, 0, rollouts[g * 4 : (g + 1) * 4]) for g in range(2)]
        losses.append([trainer.train_step(groups)["train/loss"] for _ in range(3)])
    for a, b in zip(*losses):
        assert abs(a - b) <= 1e-6


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_chunked_equals_the_full_log_softmax_on_cuda():
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")  # no TF32: compare the algorithms, not the matmul
    try:
        gen = torch.Generator().manual_seed(1)
        hidden, weight = (
            torch.randn(300, 64, generator=gen),
            torch.randn(5000, 64, generator=gen) * 0.1,
        )
        targets = torch.randint(0, 5000, (300,), generator=gen)
        args = [t.cuda() for t in (hidden, weight, targets)]
        want = _grads(_full, *args, 0.9)
        got = _grads(lambda h, w, t, T: chunked_logprobs(h, w, t, T, 128), *args, 0.9)
    finally:
        torch.set_float32_matmul_precision(previous)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=1e-5)
    assert _close(got[2], want[2], 1e-4) and _close(got[3], want[3], 1e-4)
