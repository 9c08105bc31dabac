"""The newer objectives (clip-higher, Dr. GRPO, GSPO, CISPO) and DAPO's overlong handling,
against hand-computed losses and gradients; the older losses unchanged by the new options."""

from __future__ import annotations

import math

import pytest
import torch

from loomrl.algorithms import policy_loss, policy_loss_with_stats
from loomrl.algorithms.losses import sequence_ratio
from loomrl.config_common import AlgorithmConfig
from loomrl.training.overlong import buffer_tokens, mask_truncated, overlong_penalty
from loomrl.types import Group, Rollout


def _case(dtype=torch.float32):
    # two sequences, three positions; the last position of sequence 1 is padding
    logp = torch.log(torch.tensor([[0.5, 0.25, 0.8], [0.2, 0.9, 0.1]], dtype=dtype))
    beh = torch.log(torch.tensor([[0.25, 0.25, 0.2], [0.4, 0.3, 0.1]], dtype=dtype))
    adv = torch.tensor([1.0, -2.0], dtype=dtype)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=dtype)
    return logp, beh, adv, mask  # ratios: [[2, 1, 4], [0.5, 3, -]]


def _grad(kind, **options):
    logp, beh, adv, mask = _case()
    logp = logp.clone().requires_grad_(True)
    policy_loss(kind, logp, beh, adv, mask, **options).backward()
    return logp.grad


def test_clip_higher_decouples_the_two_clip_ranges():
    logp, beh, adv, mask = _case()
    # clamp(r, 0.8, 1.28). seq 0 (A=+1), r=[2,1,4]: min(r, clip r) = [1.28, 1, 1.28] -> [-1.28, -1, -1.28]
    # seq 1 (A=-2), r=0.5: min(-1, -1.6) = -1.6 -> 1.6; r=3: min(-6, -2.56) = -6 -> 6
    loss = policy_loss("grpo", logp, beh, adv, mask, clip_eps_low=0.2, clip_eps_high=0.28)
    assert math.isclose(loss.item(), (-1.28 - 1 - 1.28 + 1.6 + 6) / 5, rel_tol=1e-6)
    # a wider lower range only: clamp(r, 0.6, 1.2): seq 1's r=0.5 term is min(-1, -1.2) -> 1.2
    loss = policy_loss("grpo", logp, beh, adv, mask, clip_eps_low=0.4, clip_eps_high=0.2)
    assert math.isclose(loss.item(), (-1.2 - 1 - 1.2 + 1.2 + 6) / 5, rel_tol=1e-6)


@pytest.mark.parametrize("kind", ["grpo", "tis", "dr_grpo", "gspo"])
def test_equal_clip_ranges_are_clip_eps_bit_for_bit(kind):
    logp, beh, adv, mask = _case()
    options = {"length_divisor": 4} if kind == "dr_grpo" else {}
    plain = policy_loss(kind, logp, beh, adv, mask, clip_eps=0.2, **options)
    split = policy_loss(
        kind, logp, beh, adv, mask, clip_eps=0.5, clip_eps_low=0.2, clip_eps_high=0.2, **options
    )
    assert torch.equal(plain, split)


def test_dr_grpo_divides_by_a_constant_not_by_each_length():
    logp, beh, adv, mask = _case()
    # grpo's terms [-1.2, -1, -1.2] and [1.6, 6], summed (4.2) over 2 rows x L = 8
    loss = policy_loss("dr_grpo", logp, beh, adv, mask, length_divisor=8)
    assert math.isclose(loss.item(), 4.2 / 16, rel_tol=1e-6)
    # its gradient: -r A / (G L) where the unclipped term won, 0 where the clip won
    grad = _grad("dr_grpo", length_divisor=8)
    want = torch.tensor([[0.0, -1.0 / 16, 0.0], [0.0, 6.0 / 16, 0.0]])
    assert torch.allclose(grad, want, rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="length_divisor"):
        policy_loss("dr_grpo", logp, beh, adv, mask)


def test_gspo_uses_one_length_normalised_ratio_per_sequence():
    logp, beh, adv, mask = _case()
    # s_0 = (2 * 1 * 4) ** (1/3) = 2, s_1 = (0.5 * 3) ** (1/2); padding left out
    s1 = math.sqrt(1.5)
    assert torch.allclose(sequence_ratio(logp, beh, mask).squeeze(1), torch.tensor([2.0, s1]))
    # seq 0 (A=+1): min(2, 1.2) = 1.2 -> -1.2 on each of its 3 tokens
    # seq 1 (A=-2): min(-2 s1, -2 * 1.2) = -2 s1 -> 2 s1 on each of its 2 tokens
    loss = policy_loss("gspo", logp, beh, adv, mask, aggregation="sequence")
    assert math.isclose(loss.item(), (-1.2 + 2 * s1) / 2, rel_tol=1e-6)
    loss = policy_loss("gspo", logp, beh, adv, mask)
    assert math.isclose(loss.item(), (3 * -1.2 + 2 * 2 * s1) / 5, rel_tol=1e-6)
    _, stats = policy_loss_with_stats("gspo", logp, beh, adv, mask)
    assert math.isclose(stats.clip_fraction, 3 / 5, rel_tol=1e-6)  # all of seq 0, none of seq 1


def test_gspo_gradient_spreads_the_sequence_ratio_over_its_tokens():
    grad = _grad("gspo", aggregation="sequence")
    # seq 0 clipped: no gradient. seq 1: d/dlogp_t of -s A / G = -(A / G) s / |y| on each token
    g = 2.0 / 2 * math.sqrt(1.5) / 2
    want = torch.tensor([[0.0, 0.0, 0.0], [g, g, 0.0]])
    assert torch.allclose(grad, want, rtol=1e-6, atol=0)


def test_cispo_keeps_every_tokens_gradient_with_a_stopped_weight():
    logp, beh, adv, mask = _case()
    # w = sg(min(r, 2.5)) = [[2, 1, 2.5], [0.5, 2.5]]; loss = -sum(w A log pi) / 5
    w = [[2.0, 1.0, 2.5], [0.5, 2.5]]
    lp = [[0.5, 0.25, 0.8], [0.2, 0.9]]
    a = [1.0, -2.0]
    want = -sum(w[i][t] * a[i] * math.log(lp[i][t]) for i in range(2) for t in range(len(w[i])))
    loss, stats = policy_loss_with_stats("cispo", logp, beh, adv, mask, delta=2.5)
    assert math.isclose(loss.item(), want / 5, rel_tol=1e-6)
    assert math.isclose(stats.clip_fraction, 2 / 5, rel_tol=1e-6)  # r = 4 and r = 3
    # the gradient is -w A / 5 on every token, the truncated ones included (aipo drops
    # those), and nothing flows through w (which would add -A r log pi / 5 where r < delta)
    grad = _grad("cispo", delta=2.5)
    want_grad = torch.tensor([[-2.0, -1.0, -2.5], [1.0, 5.0, 0.0]]) / 5
    assert torch.allclose(grad, want_grad, rtol=1e-6, atol=0)
    aipo = _grad("aipo", delta=2.5)
    assert aipo[0, 2].item() == 0.0 and aipo[1, 1].item() == 0.0


@pytest.mark.parametrize("kind", ["dr_grpo", "gspo"])
def test_new_losses_pass_torch_gradcheck(kind):
    logp, beh, adv, mask = _case(torch.float64)
    # ratios away from every clip's edge: r = 1.1 and 0.95 (clip 0.2; delta 2)
    beh = logp - torch.log(torch.tensor([[1.1, 0.95, 1.1], [0.95, 1.1, 1.0]], dtype=torch.float64))
    options = {"length_divisor": 5} if kind == "dr_grpo" else {}

    def loss(lp):
        return policy_loss(kind, lp, beh, adv, mask, **options)

    assert torch.autograd.gradcheck(loss, (logp.clone().requires_grad_(True),))


def test_cispo_gradient_is_the_reinforce_gradient_at_a_fixed_weight():
    # Its value's own derivative is not its gradient (the weight is stopped): gradcheck holds
    # once the ratios are held where they are, so that the weight is a constant
    logp, _, adv, mask = _case(torch.float64)
    log_ratio = torch.log(torch.tensor([[2.0, 0.5, 4.0], [1.5, 3.0, 1.0]], dtype=torch.float64))

    def loss(lp):
        return policy_loss("cispo", lp, lp.detach() - log_ratio, adv, mask, delta=2.5)

    assert torch.autograd.gradcheck(loss, (logp.clone().requires_grad_(True),))


def test_loss_options_are_checked_at_load_time():
    with pytest.raises(ValueError, match="advantage_scale='none'"):
        AlgorithmConfig(loss="dr_grpo", advantage_scale="std")
    with pytest.raises(ValueError, match="aggregation='token'"):
        AlgorithmConfig(loss="dr_grpo", aggregation="sequence")
    assert AlgorithmConfig(clip_eps=0.3).clip_range == (0.3, 0.3)
    assert AlgorithmConfig(clip_eps_high=0.28).clip_range == (0.2, 0.28)
    with pytest.raises(ValueError, match="unknown policy loss 'ppo'"):
        policy_loss("ppo", *_case())


def test_soft_overlong_penalty_is_dapos_ramp():
    # L_max 20, L_cache 5: nothing up to 15, then -1/5 per token, -1 at 20 and beyond
    assert [overlong_penalty(n, 20, 5) for n in (3, 15, 16, 18, 20, 25)] == [
        0.0,
        0.0,
        -0.2,
        -0.6,
        -1.0,
        -1.0,
    ]
    assert buffer_tokens(AlgorithmConfig(), 20) == 4
    assert buffer_tokens(AlgorithmConfig(overlong_buffer_tokens=50), 20) == 20


def test_filter_masks_only_truncated_completions():
    def rollout(finish):
        return Rollout(0, [1], [2, 3, 4], [0.0] * 3, [1, 1, 1], 0, finish_reason=finish)

    rows, masked = mask_truncated([rollout("stop"), rollout("length")])
    assert masked == 1
    assert [r.loss_mask for r in rows] == [[1, 1, 1], [0, 0, 0]]


def _groups(finish=("stop",) * 8):
    rollouts = [
        Rollout(
            i,
            [1, 5 + i % 3, 6],
            [7 + i % 4] * (1 + i % 3),
            [-1.5] * (1 + i % 3),
            [1] * (1 + i % 3),
            0,
            reward=float(i % 2),
            finish_reason=finish[i],
        )
        for i in range(8)
    ]
    return [Group.of_rollouts(g, 0, rollouts[g * 4 : (g + 1) * 4]) for g in range(2)]


def _trainer(algo: AlgorithmConfig, micro_batch_size: int = 8, max_tokens: int | None = 3):
    from loomrl.config import TrainerConfig
    from loomrl.models.tiny import build_tiny_model
    from loomrl.training.trainer import Trainer

    model, tok = build_tiny_model(
        "llama", seed=3, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64
    )
    cfg = TrainerConfig(lr=1e-3, micro_batch_size=micro_batch_size, shared_prefix=False)
    return Trainer(model, tok, algo, cfg, 1.0, max_completion_tokens=max_tokens)


@pytest.mark.parametrize("loss", ["dr_grpo", "gspo", "cispo"])
def test_new_losses_train_the_same_in_any_micro_batches(loss):
    algo = AlgorithmConfig(loss=loss)
    whole = _trainer(algo).train_step(_groups())
    split = _trainer(algo, micro_batch_size=3).train_step(_groups())
    assert math.isfinite(whole["train/loss"]) and whole["train/grad_norm"] > 0
    assert math.isclose(whole["train/loss"], split["train/loss"], rel_tol=1e-5, abs_tol=1e-7)
    assert math.isclose(whole["train/grad_norm"], split["train/grad_norm"], rel_tol=1e-5)


def test_dr_grpo_needs_the_maximum_length():
    with pytest.raises(ValueError, match="max_completion_tokens"):
        _trainer(AlgorithmConfig(loss="dr_grpo"), max_tokens=None)


def test_overlong_filter_trains_no_token_of_a_truncated_completion():
    # rollout i has 1 + i % 3 tokens; rollouts 2 and 5 (3 tokens each) were cut at the limit
    finish = tuple("length" if i in (2, 5) else "stop" for i in range(8))
    metrics = _trainer(AlgorithmConfig(overlong="filter")).train_step(_groups(finish))
    assert metrics["train/truncated_frac"] == 2 / 8
    assert metrics["train/num_tokens"] == sum(1 + i % 3 for i in range(8)) - 6


def test_overlong_soft_lowers_the_reward_of_long_completions():
    # L_max 3, L_cache 2: lengths 1, 2, 3 get 0, -0.5, -1
    algo = AlgorithmConfig(overlong="soft", overlong_buffer_tokens=2)
    metrics = _trainer(algo).train_step(_groups())
    assert math.isclose(
        metrics["train/overlong_penalty_mean"], (0 - 0.5 - 1) * 2 / 8 + (0 - 0.5) / 8
    )
