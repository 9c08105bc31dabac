"""The shared-prompt training forward computes the full forward's loss and gradients."""

from __future__ import annotations

import random

import pytest
import torch
from step_checks import assert_same_step

from loomrl.config import AlgorithmConfig, TrainerConfig
from loomrl.models.tiny import build_tiny_model
from loomrl.training.prefix import PrefixBatch
from loomrl.training.trainer import Trainer, build_token_batch, token_logprobs
from loomrl.types import Group, Rollout


def _rollouts(seed: int, prompt_lengths=(3, 5, 4), group_size=4, max_completion=5) -> list[Rollout]:
    rng = random.Random(seed)
    out = []
    for i, length in enumerate(prompt_lengths):
        prompt = [1] + [rng.randrange(3, 60) for _ in range(length - 1)]
        for _ in range(group_size):
            k = rng.randrange(1, max_completion + 1)
            completion = [rng.randrange(3, 60) for _ in range(k)]
            mask = [1] * k
            if k >= 3:  # an environment-inserted token in the middle, never trained
                mask[1] = 0
            logps = [-rng.random() * 3 if m else 0.0 for m in mask]
            out.append(
                Rollout(i, prompt, completion, logps, mask, 0, reward=float(rng.random() > 0.5))
            )
    return out


def _model(seed=0):
    model, tok = build_tiny_model(
        "llama", seed=seed, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64
    )
    return model.float().train(), tok


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_log_probs_and_gradients_match_the_full_forward(seed):
    from loomrl.training.prefix import build_prefix_batch

    model, tok = _model(seed)
    rollouts = _rollouts(seed)
    adv = [random.Random(seed).uniform(-1, 1) for _ in rollouts]
    full = build_token_batch(rollouts, adv, 0, tok.pad_token_id)
    shared = build_prefix_batch(rollouts, adv, 0, tok.pad_token_id)
    assert shared.num_prompts == 3 and shared.suffix_ids.shape[0] == len(rollouts)

    def run(batch):
        model.zero_grad()
        logp, entropy = token_logprobs(model, batch, temperature=0.7)
        mask = batch.target_mask
        ((logp * mask).sum() + 0.1 * (entropy * mask).sum()).backward()
        picked = [logp[i][mask[i] > 0] for i in range(len(rollouts))]
        return picked, [p.grad.clone() for p in model.parameters()]

    full_logp, full_grads = run(full)
    shared_logp, shared_grads = run(shared)
    for a, b in zip(full_logp, shared_logp):
        assert a.shape == b.shape and a.numel() > 0
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    for a, b in zip(full_grads, shared_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    # behaviour log-probs and masks sit on the same trained tokens in both layouts
    assert torch.equal(
        full.behaviour[full.target_mask > 0], shared.behaviour[shared.target_mask > 0]
    )


def test_trainer_step_matches_with_and_without_sharing():
    results = []
    for shared in (True, False):
        model, tok = _model(5)
        trainer = Trainer(
            model,
            tok,
            AlgorithmConfig(loss="aipo"),
            TrainerConfig(precision="fp32", lr=1e-3, shared_prefix=shared),
            1.0,
        )
        rollouts = _rollouts(5)
        groups = [Group.of_rollouts(g, 0, rollouts[g * 4 : (g + 1) * 4]) for g in range(3)]
        batch = trainer._micro_batch(rollouts, [0.0] * len(rollouts))
        assert isinstance(batch, PrefixBatch) == shared
        metrics = trainer.train_step(groups)
        # (the step leaves its gradients in place: they are zeroed when the next one starts)
        params = list(model.parameters())
        results.append((metrics, [p.detach().clone() for p in params], [p.grad for p in params]))
    (m_shared, w_shared, g_shared), (m_full, w_full, g_full) = results
    keys = ("train/loss", "train/grad_norm", "train/entropy", "train/importance_ratio_mean")
    assert_same_step(m_shared, m_full, keys, rel=1e-4)
    lr = 1e-3
    for a, b, ga, gb in zip(w_shared, w_full, g_shared, g_full, strict=True):
        torch.testing.assert_close(ga, gb, rtol=1e-4, atol=1e-6)
        # AdamW's first step moves a weight by lr * g / (|g| + 1e-8): where the gradient is a
        # near-cancelled sum (|g| <= 1e-6, compared above within 1e-6) the two layouts' floating
        # point order may move it anywhere in [-lr, lr]; elsewhere the update is the same
        steady = ga.abs() > 1e-6
        assert steady.float().mean() > 0.5
        torch.testing.assert_close(a[steady], b[steady], rtol=1e-4, atol=1e-6)
        assert all(abs(d) <= 2 * lr * 1.001 for d in (a[~steady] - b[~steady]).tolist())


def test_distinct_prompts_take_the_plain_forward():
    model, tok = _model()
    trainer = Trainer(model, tok, AlgorithmConfig(), TrainerConfig(precision="fp32"), 1.0)
    rollouts = _rollouts(0, prompt_lengths=(3, 4, 5), group_size=1)
    assert not isinstance(trainer._micro_batch(rollouts, [0.0] * 3), PrefixBatch)


def test_generation_shares_each_prompt_prefill_and_samples_the_same():
    from loomrl.generation.hf import HFGenerator
    from loomrl.types import GenerationRequest, SamplingParams

    model, tok = _model(7)
    model.eval()
    requests = [
        GenerationRequest(
            [1] + [3 + (i * 7 + j) % 50 for j in range(2 + i)],
            4,
            SamplingParams(temperature=1.0, max_new_tokens=5),
            seed=11 + i,
        )
        for i in range(3)
    ]
    outputs, prefill_rows = [], []
    for share in (True, False):
        gen = HFGenerator(model, tok, publish_dtype="float32", trace=False)  # counts eager forwards
        gen.share_prefill = share
        calls = []
        forward = model.forward

        def counting(*args, _forward=forward, calls=calls, **kwargs):
            calls.append(kwargs["input_ids"].shape)
            return _forward(*args, **kwargs)

        model.forward = counting
        try:
            outputs.append(gen.generate(requests))
        finally:
            model.forward = forward
        prefill_rows.append(calls[0][0])
        # a forward per sampled token but the last: none for a token that is never sampled
        longest = max(len(ids) for r in outputs[-1] for ids in r.token_ids)
        assert len(calls) == longest
    assert prefill_rows == [3, 12]
    for shared, plain in zip(*outputs):
        assert shared.token_ids == plain.token_ids
        assert shared.finish_reasons == plain.finish_reasons
        for a, b in zip(shared.logprobs, plain.logprobs, strict=True):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-5, atol=1e-5)


def test_a_sliding_window_model_keeps_the_unshared_forward():
    from transformers import MistralConfig, MistralForCausalLM

    from loomrl.generation.hf import HFGenerator
    from loomrl.models.cache import probe_can_repeat
    from loomrl.types import GenerationRequest, SamplingParams

    _, tok = _model()
    config = MistralConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        sliding_window=4,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(0)
    model = MistralForCausalLM(config).float()
    assert not probe_can_repeat(model)
    assert probe_can_repeat(_model()[0])
    trainer = Trainer(model, tok, AlgorithmConfig(), TrainerConfig(precision="fp32"), 1.0)
    rollouts = _rollouts(0, prompt_lengths=(7, 6))
    assert not isinstance(trainer._micro_batch(rollouts, [0.0] * len(rollouts)), PrefixBatch)
    trainer.train_step(
        [Group.of_rollouts(0, 0, rollouts[:4]), Group.of_rollouts(1, 0, rollouts[4:])]
    )
    gen = HFGenerator(model.eval(), tok, publish_dtype="float32")
    out = gen.generate(
        [GenerationRequest([1] + [5] * 6, 3, SamplingParams(max_new_tokens=3), seed=1)]
    )
    assert len(out[0]) == 3 and not gen.share_prefill
