"""The trainer's step diagnostics measure what they name."""

from __future__ import annotations

import math

import pytest
import torch

from loomrl.config import AlgorithmConfig, TrainerConfig
from loomrl.models.tiny import build_tiny_model
from loomrl.training.trainer import Trainer
from loomrl.types import Group, Rollout


def _groups() -> list[Group]:
    rollouts = [
        Rollout(
            i,
            [1, 5 + i % 3, 6],
            [7 + i % 4] * (1 + i % 3),
            [-1.5] * (1 + i % 3),
            [1] * (1 + i % 3),
            0,
            reward=float(i % 2),
        )
        for i in range(8)
    ]
    return [Group.of_rollouts(g, 0, rollouts[g * 4 : (g + 1) * 4]) for g in range(2)]


def test_update_rms_is_the_root_mean_square_of_the_parameter_change():
    model, tok = build_tiny_model(
        "llama", seed=3, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64
    )
    trainer = Trainer(model, tok, AlgorithmConfig(), TrainerConfig(precision="fp32", lr=1e-3), 1.0)
    before = [p.detach().clone() for p in model.parameters()]
    metrics = trainer.train_step(_groups())
    after = list(model.parameters())
    count = sum(p.numel() for p in after)
    change = math.sqrt(
        sum(float(((a.detach() - b) ** 2).sum()) for a, b in zip(after, before)) / count
    )
    weights = math.sqrt(sum(float((a.detach() ** 2).sum()) for a in after) / count)
    assert change > 0
    assert math.isclose(metrics["train/update_rms"], change, rel_tol=1e-4)
    assert math.isclose(metrics["train/update_to_weight"], change / weights, rel_tol=1e-4)
    # the first AdamW step moves every parameter with a gradient by about lr
    assert 1e-4 < metrics["train/update_rms"] <= 1.01e-3


def test_measuring_the_update_does_not_change_the_step():
    results = []
    for measure in (True, False):
        model, tok = build_tiny_model(
            "llama", seed=3, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64
        )
        trainer = Trainer(
            model, tok, AlgorithmConfig(), TrainerConfig(precision="fp32", lr=1e-3), 1.0
        )
        if not measure:  # the plain AdamW step on the same gradients, as a reference
            trainer.train_step = _plain_step(trainer)
        trainer.train_step(_groups())
        results.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*results):
        assert torch.equal(a, b)


def _plain_step(trainer: Trainer):
    from loomrl.algorithms import policy_loss
    from loomrl.training.trainer import compute_advantages, token_logprobs

    def step(groups):
        rollouts, adv = compute_advantages(groups, trainer.algo.advantage_scale)
        batch = trainer._micro_batch(rollouts, adv)
        logp, _ = token_logprobs(trainer.model, batch, trainer.temperature)
        trainer.optimizer.zero_grad(set_to_none=True)
        policy_loss(
            trainer.algo.loss,
            logp,
            batch.behaviour,
            batch.advantages,
            batch.target_mask,
            delta=trainer.algo.delta,
            clip_eps=trainer.algo.clip_eps,
        ).backward()
        torch.nn.utils.clip_grad_norm_(trainer.model.parameters(), trainer.cfg.max_grad_norm)
        trainer.optimizer.step()

    return step


def test_step_phases_are_timed_within_the_step():
    model, tok = build_tiny_model(
        "llama", seed=3, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64
    )
    trainer = Trainer(
        model,
        tok,
        AlgorithmConfig(),
        TrainerConfig(precision="fp32", lr=1e-3, micro_batch_size=3),
        1.0,
    )
    metrics = trainer.train_step(_groups())
    phases = [metrics[f"timing/train_{p}_s"] for p in ("forward", "backward", "optimizer")]
    assert all(p > 0 for p in phases)
    assert sum(phases) <= metrics["timing/train_step_s"]


def test_the_fused_optimizer_is_adamw_up_to_rounding_and_can_be_turned_off():
    weights = {}
    for fused in (True, False):
        model, tok = build_tiny_model(
            "llama", seed=3, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64
        )
        trainer = Trainer(
            model,
            tok,
            AlgorithmConfig(),
            TrainerConfig(precision="fp32", lr=1e-3, fused_optimizer=fused),
            1.0,
        )
        assert bool(trainer.optimizer.param_groups[0]["fused"]) is fused
        for _ in range(3):
            trainer.train_step(_groups())
        weights[fused] = [p.detach().clone() for p in model.parameters()]
    diffs = [float((a - b).abs().max()) for a, b in zip(weights[True], weights[False])]
    assert max(diffs) < 1e-6  # the same update, rounded in another order


def test_advantages_of_groups_of_one_size_at_once_are_those_of_each_group_alone():
    from loomrl.algorithms import group_advantages
    from loomrl.training.trainer import compute_advantages

    gen = torch.Generator().manual_seed(5)
    groups = []
    for g, (size, failed) in enumerate([(8, 0), (8, 3), (8, 0), (8, 7), (8, 8), (4, 0), (8, 3)]):
        rewards = (
            torch.rand(size, generator=gen).tolist()
            if g % 2
            else [float(i % 3 == 0) for i in range(size)]
        )
        rollouts = [
            Rollout(g, [1], [2], [-1.0], [1], 0, reward=r, status="failed" if i < failed else "ok")
            for i, r in enumerate(rewards)
        ]
        groups.append(Group.of_rollouts(g, 0, rollouts))
    for scale in ("none", "std"):
        rollouts, adv = compute_advantages(groups, scale)
        expected_rollouts, expected = [], []
        for group in groups:
            ok = [r for r in group if r.status == "ok"]
            if ok:
                expected_rollouts += ok
                rewards = torch.tensor([[float(r.reward) for r in ok]])
                expected += (
                    group_advantages(rewards, scale=scale)[0].tolist() if len(ok) > 1 else [0.0]
                )
        assert rollouts == expected_rollouts and adv == expected  # (row views: equal, not the same)


@pytest.mark.parametrize("shared_prefix", [True, False])
def test_a_traced_training_forward_trains_the_same_weights_bit_for_bit(shared_prefix):
    runs = []
    for trace in (True, False):
        model, tok = build_tiny_model(
            "llama", seed=3, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64
        )
        trainer = Trainer(
            model,
            tok,
            AlgorithmConfig(),
            TrainerConfig(precision="fp32", lr=1e-3, trace=trace, shared_prefix=shared_prefix),
            1.0,
        )
        metrics = [trainer.train_step(_groups()) for _ in range(5)]  # traced from the third step
        runs.append(([p.detach().clone() for p in model.parameters()], metrics))
    (traced, traced_metrics), (eager, eager_metrics) = runs
    assert all(torch.equal(a, b) for a, b in zip(traced, eager))
    assert [m["train/loss"] for m in traced_metrics] == [m["train/loss"] for m in eager_metrics]
    assert [m["train/grad_norm"] for m in traced_metrics] == [
        m["train/grad_norm"] for m in eager_metrics
    ]
    last = traced_metrics[-1]
    assert (last["train/traces"], last["train/eager_forwards"], last["train/traced_forwards"]) == (
        1,
        2,
        3,
    )
    assert "train/traces" not in eager_metrics[-1]


def test_update_measured_in_buckets_gives_the_one_bucket_step_and_metrics(monkeypatch):
    """The update-size metric copies a bucket of parameters at a time (no second copy of the
    whole model): the weights after the step and the metrics are those of one step."""
    import loomrl.training.step_stats as step_stats

    results = []
    for bucket in (step_stats.UPDATE_BUCKET_NUMEL, 1000):
        monkeypatch.setattr(step_stats, "UPDATE_BUCKET_NUMEL", bucket)
        model, tok = build_tiny_model(
            "llama", seed=3, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64
        )
        trainer = Trainer(
            model, tok, AlgorithmConfig(), TrainerConfig(precision="fp32", lr=1e-3), 1.0
        )
        metrics = [trainer.train_step(_groups()) for _ in range(2)]
        grads = [p.grad is not None for p in model.parameters()]
        results.append(([p.detach().clone() for p in model.parameters()], metrics, grads))
    (want, want_metrics, want_grads), (got, got_metrics, got_grads) = results
    assert sum(p.numel() for p in got) > 10 * 1000  # many buckets
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert got_grads == want_grads  # the gradients hidden during the buckets' steps are back
    for g, w in zip(got_metrics, want_metrics):
        assert g["train/loss"] == w["train/loss"]
        assert math.isclose(g["train/update_rms"], w["train/update_rms"], rel_tol=1e-6)
        assert math.isclose(g["train/update_to_weight"], w["train/update_to_weight"], rel_tol=1e-6)
