"""Packed micro-batches (trainer.packing) give the padded step's loss, log-probs and
gradients; the packing and its token budget; the configurations it refuses."""

from __future__ import annotations

import random

import pytest
import torch
from pydantic import ValidationError

from loomrl.config import AlgorithmConfig, TrainerConfig
from loomrl.models.tiny import build_tiny_model
from loomrl.training.packing import PackedBatch, check_packable, pack_slices
from loomrl.training.step_stats import _Accumulator
from loomrl.training.trainer import Trainer, compute_advantages
from loomrl.types import Group, Rollout

SPREADS = {"narrow": (20, 28), "wide": (3, 90), "one_long": (4, 12)}


def _rollouts(seed: int, spread: str, rows: int = 8) -> list[Rollout]:
    rng = random.Random(seed)
    lo, hi = SPREADS[spread]
    out = []
    for i in range(rows):
        # one_long: a rollout over the 160-token budget, a pack of its own
        n = rng.randint(lo, hi) if not (spread == "one_long" and i == 5) else 170
        prompt = [rng.randrange(3, 60) for _ in range(rng.randint(2, 9))]
        completion = [rng.randrange(3, 60) for _ in range(n)]
        out.append(
            Rollout(
                i,
                prompt,
                completion,
                [rng.uniform(-5.0, -2.0) for _ in range(n)],  # behaviour log-probs: ratios != 1
                [int(rng.random() > 0.2) for _ in range(n)],
                0,
                reward=rng.random() * (i + 1),
            )
        )
    return out


def _step(
    packing: bool, seed: int, spread: str, *, loss="grpo", agg="token", chunk=False, eager=False
):
    """One step's forward and backward (no optimizer step): its gradients, statistics and
    per-token log-probs of every micro-batch in the padded layout."""
    model, tok = build_tiny_model(
        "qwen2", seed=seed, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
        max_position_embeddings=256,
    )  # fmt: skip
    if eager:
        model.set_attn_implementation("eager")
    cfg = TrainerConfig(
        packing=packing,
        packing_max_tokens=160,
        micro_batch_size=8,
        max_tokens_per_micro_batch=None,
        trace=False,
        shared_prefix=False if not packing else "auto",
        chunked_logprobs=chunk,
        logprob_chunk_tokens=16,
    )
    algo = AlgorithmConfig(loss=loss, aggregation=agg, kl_coef=0.05)
    trainer = Trainer(model, tok, algo, cfg, 0.9)
    rollouts = _rollouts(seed, spread)
    groups = [Group.of_rollouts(g, 0, rollouts[g * 4 : (g + 1) * 4]) for g in range(2)]
    rollouts, adv = compute_advantages(groups, "std")
    acc, logps = _Accumulator(), []
    total = sum(sum(r.loss_mask) for r in rollouts)
    seqs = sum(1 for r in rollouts if sum(r.loss_mask))
    trainer._step_rows = len(rollouts)
    if packing and spread == "one_long":
        assert slice(5, 6) in trainer._slices(rollouts)  # over the budget: alone
    for rows in trainer._slices(rollouts):
        batch = trainer._micro_batch(rollouts[rows], adv[rows])
        assert isinstance(batch, PackedBatch) == packing
        logp, _ = trainer._logprobs(batch)
        logps.append(logp.detach()[batch.target_mask > 0])  # trained tokens, in row order
        trainer._micro_step(batch, total, seqs, acc)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return acc.finish(), torch.cat(logps), grads


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("spread", list(SPREADS))
def test_a_packed_step_equals_the_padded_one(seed, spread):
    padded, packed = _step(False, seed, spread), _step(True, seed, spread)
    (m0, lp0, g0), (m1, lp1, g1) = padded, packed
    assert abs(m0["train/loss"]) > 1e-3  # not a cancelled sum
    assert abs(m1["train/loss"] - m0["train/loss"]) <= 1e-5 * abs(m0["train/loss"])
    assert abs(m1["train/kl"] - m0["train/kl"]) <= 1e-5 * abs(m0["train/kl"])
    assert abs(m1["train/entropy"] - m0["train/entropy"]) <= 1e-5 * m0["train/entropy"]
    # per-token log-probs of the trained tokens, whatever micro-batches each path made
    assert lp0.shape == lp1.shape and lp0.numel() > 0
    assert _rel(lp1, lp0) <= 1e-5
    for name, g in g0.items():
        assert g.norm() > 0, name
        assert _rel(g1[name], g) <= 1e-5, name


@pytest.mark.parametrize(
    "kw",
    [
        {"loss": "gspo", "agg": "sequence"},
        {"loss": "cispo"},
        {"chunk": True},
        {"eager": True},
    ],
)
def test_packing_equals_padding_across_losses_chunked_log_probs_and_eager_attention(kw):
    (m0, _, g0), (m1, _, g1) = _step(False, 4, "wide", **kw), _step(True, 4, "wide", **kw)
    assert abs(m1["train/loss"] - m0["train/loss"]) <= 1e-5 * abs(m0["train/loss"])
    for name, g in g0.items():
        assert _rel(g1[name], g) <= 1e-5, name


def test_the_packed_row_keeps_attention_within_each_rollout():
    """The mask matters: a rollout's log-probs do not change with its neighbours."""
    model, tok = build_tiny_model("qwen2", seed=0, hidden_size=32, num_layers=1, num_heads=2)
    trainer = Trainer(model, tok, AlgorithmConfig(), TrainerConfig(packing=True, trace=False), 1.0)
    rollouts = _rollouts(0, "narrow", rows=3)
    alone = trainer._logprobs(trainer._micro_batch(rollouts[1:2], [1.0]))[0]
    together = trainer._logprobs(trainer._micro_batch(rollouts, [1.0, 1.0, 1.0]))[0]
    n = alone.shape[1]
    torch.testing.assert_close(together[1, :n], alone[0], rtol=0, atol=1e-5)


def test_packs_fill_the_budget_and_a_longer_rollout_is_its_own():
    def r(n):
        return Rollout(0, [1] * 2, [2] * (n - 2), [0.0] * (n - 2), [1] * (n - 2), 0)

    rollouts = [r(n) for n in (10, 20, 30, 100, 5, 5, 5)]
    assert pack_slices(rollouts, 8, 60) == [slice(0, 3), slice(3, 4), slice(4, 7)]
    assert pack_slices(rollouts, 2, 1000) == [slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 7)]
    assert pack_slices(rollouts[:1], 8, 4) == [slice(0, 1)]


def test_packing_with_an_explicit_shared_prefix_is_a_config_error():
    with pytest.raises(ValidationError, match="packing=true.*shared_prefix=true"):
        TrainerConfig(packing=True, shared_prefix=True)
    assert TrainerConfig(packing=True).shared_prefix == "auto"  # off under packing


def test_packing_refuses_an_attention_without_a_packed_path():
    model, tok = build_tiny_model("qwen2", seed=0, hidden_size=32, num_layers=1, num_heads=2)
    model.config._attn_implementation = "flex_attention"
    with pytest.raises(ValueError, match="trainer.packing=true: attention implementation"):
        Trainer(model, tok, AlgorithmConfig(), TrainerConfig(packing=True, trace=False), 1.0)


def test_packing_refuses_a_sliding_window_set_without_layer_types():
    """Mistral's config (like Mixtral's, Phi-3's, Starcoder2's) has no layer_types: its
    sliding_window, when set, applies to every layer, which the packed mask would not."""
    from transformers import MistralConfig, MistralForCausalLM

    def mistral(window):
        config = MistralConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=2, sliding_window=window,
        )  # fmt: skip
        model = MistralForCausalLM(config)
        model.set_attn_implementation("sdpa")
        return model

    with pytest.raises(ValueError, match="sliding_attention"):
        check_packable(mistral(16))
    check_packable(mistral(None))  # no window: full attention, packable
