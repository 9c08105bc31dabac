"""Advantages and policy losses against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch
from step_checks import assert_sum_close

from loomrl.algorithms import group_advantages, kl_penalty, policy_loss, policy_loss_with_stats


def test_group_advantages_centre_within_each_group():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [3.0, 1.0, 2.0, 2.0]])
    adv = group_advantages(rewards)
    assert torch.allclose(adv, torch.tensor([[0.5, -0.5, -0.5, 0.5], [1.0, -1.0, 0.0, 0.0]]))


def test_group_advantages_std_scaling_uses_population_std():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]])
    adv = group_advantages(rewards, scale="std")
    # group 0: mean 0.5, population std 0.5 -> +-1 (up to eps); group 1: all equal -> 0
    assert torch.allclose(adv[0], torch.tensor([1.0, -1.0, -1.0, 1.0]), atol=1e-5)
    assert torch.equal(adv[1], torch.zeros(4))


def test_group_advantages_rejects_bad_input():
    with pytest.raises(ValueError, match="num_groups, group_size"):
        group_advantages(torch.ones(4))
    with pytest.raises(ValueError, match="scale"):
        group_advantages(torch.ones(2, 2), scale="max")


def _case():
    # two sequences, three positions; the last position of sequence 1 is padding
    logp = torch.log(torch.tensor([[0.5, 0.25, 0.8], [0.2, 0.9, 0.1]]))
    beh = torch.log(torch.tensor([[0.25, 0.25, 0.2], [0.4, 0.3, 0.1]]))
    adv = torch.tensor([1.0, -2.0])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    return logp, beh, adv, mask  # ratios: [[2, 1, 4], [0.5, 3, -]]


def test_grpo_loss_hand_computed():
    logp, beh, adv, mask = _case()
    # seq 0 (A=+1): min(r*A, clip(r,0.8,1.2)*A) = [1.2, 1, 1.2]  -> loss terms [-1.2, -1, -1.2]
    # seq 1 (A=-2): r=[0.5, 3]: min(-1, -1.6)=-1.6 ; min(-6, -2.4)=-6 -> loss terms [1.6, 6]
    expected = (-1.2 - 1.0 - 1.2 + 1.6 + 6.0) / 5
    loss = policy_loss("grpo", logp, beh, adv, mask, clip_eps=0.2)
    assert math.isclose(loss.item(), expected, rel_tol=1e-5)


def test_aipo_loss_truncates_ratio_at_delta():
    logp, beh, adv, mask = _case()
    # min(r, 1.5): [[1.5, 1, 1.5], [0.5, 1.5]]; terms -w*A: [-1.5, -1, -1.5], [1, 3]
    # the terms cancel to exactly 0: compared on their scale
    terms = [-1.5, -1, -1.5, 1, 3]
    loss = policy_loss("aipo", logp, beh, adv, mask, delta=1.5)
    assert_sum_close(loss.item(), sum(terms) / 5, terms)
    # with delta 2.5 only the ratios 3 and 4 are truncated: [-2, -1, -2.5], [1, 5]
    loss = policy_loss("aipo", logp, beh, adv, mask, delta=2.5)
    assert_sum_close(loss.item(), (-2 - 1 - 2.5 + 1 + 5) / 5, [-2, -1, -2.5, 1, 5])


def test_aipo_gradient_is_zero_where_truncated():
    logp, beh, adv, mask = _case()
    logp = logp.clone().requires_grad_(True)
    policy_loss("aipo", logp, beh, adv, mask, delta=1.5).backward()
    grad = logp.grad
    # d/dlogp of -r*A/5 = -r*A/5 where r < delta; 0 where r > delta
    assert grad[0, 0].item() == 0.0 and grad[0, 2].item() == 0.0 and grad[1, 1].item() == 0.0
    assert math.isclose(grad[0, 1].item(), -1.0 / 5, rel_tol=1e-5)
    assert math.isclose(grad[1, 0].item(), 0.5 * 2.0 / 5, rel_tol=1e-5)
    assert grad[1, 2].item() == 0.0  # padding


def test_tis_loss_weights_by_truncated_proximal_ratio():
    logp, beh, adv, mask = _case()
    # proximal = current (detached): PPO ratio 1, loss = -min(pi/mu, delta) * A with no grad in w
    loss = policy_loss("tis", logp, beh, adv, mask, delta=2.5)
    assert_sum_close(loss.item(), (-2 - 1 - 2.5 + 1 + 5) / 5, [-2, -1, -2.5, 1, 5])
    prox = logp - math.log(2.0)  # pi/pi_prox = 2 -> clipped to 1.2 for A > 0
    w = torch.minimum(torch.exp(prox - beh), torch.tensor(2.0))
    terms = torch.where(adv[:, None] > 0, -1.2 * w * adv[:, None], -2.0 * w * adv[:, None])
    loss2 = policy_loss("tis", logp, beh, adv, mask, proximal_logprobs=prox, delta=2.0)
    kept = terms[mask.bool()].tolist()
    assert_sum_close(loss2.item(), sum(kept) / 5, kept)


def test_pg_loss_ignores_the_behaviour_policy():
    logp, beh, adv, mask = _case()
    # -logp * A over unmasked tokens, whatever the behaviour log-probs say
    expected = (-(logp[0, :3] * 1.0).sum() - (logp[1, :2] * -2.0).sum()) / 5
    loss, stats = policy_loss_with_stats("pg", logp, beh, adv, mask)
    assert math.isclose(loss.item(), expected.item(), rel_tol=1e-5)
    assert math.isclose(
        policy_loss("pg", logp, beh + 3.0, adv, mask).item(), loss.item(), rel_tol=1e-6
    )
    assert stats.weight_mean == 1.0 and stats.clip_fraction == 0.0
    logp = logp.clone().requires_grad_(True)
    policy_loss("pg", logp, beh, adv, mask).backward()
    # the gradient is -A / num_tokens on every unmasked token, however far the ratio is from 1
    assert torch.allclose(logp.grad, torch.tensor([[-0.2, -0.2, -0.2], [0.4, 0.4, 0.0]]))


def test_sequence_aggregation_averages_each_sequence_first():
    logp, beh, adv, mask = _case()
    # aipo terms (delta 2.5): seq0 [-2, -1, -2.5] mean -11/6 ; seq1 [1, 5] mean 3
    loss = policy_loss("aipo", logp, beh, adv, mask, delta=2.5, aggregation="sequence")
    assert math.isclose(loss.item(), (-11 / 6 + 3) / 2, rel_tol=1e-5)


def test_per_token_advantages_and_bad_kind():
    logp, beh, adv, mask = _case()
    per_token = adv[:, None].expand(2, 3).clone()
    assert torch.allclose(
        policy_loss("grpo", logp, beh, per_token, mask), policy_loss("grpo", logp, beh, adv, mask)
    )
    with pytest.raises(ValueError, match="unknown policy loss"):
        policy_loss("ppo2", logp, beh, adv, mask)
    with pytest.raises(ValueError, match="same"):
        policy_loss("grpo", logp, beh[:, :2], adv, mask)


def test_kl_penalty_is_zero_at_equal_policies_and_positive_otherwise():
    lp = torch.log(torch.tensor([[0.5, 0.2]]))
    mask = torch.ones(1, 2)
    assert kl_penalty(lp, lp, mask).item() == 0.0
    ref = torch.log(torch.tensor([[0.25, 0.4]]))
    # k3: exp(d) - d - 1 with d = ref - lp = [-ln 2, ln 2]
    d = torch.tensor([-math.log(2), math.log(2)])
    assert math.isclose(
        kl_penalty(lp, ref, mask).item(), (torch.exp(d) - d - 1).mean().item(), rel_tol=1e-6
    )
