"""The training-inference mismatch as metrics (issue 36 item 4): mean, max and a KL estimate
of the trainer's against the generators' log-probs on tokens sampled at the trainer's own
version, and a warning when the mean passes ``logging.logprob_mismatch_warning``."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from loomrl.job import Job
from loomrl.telemetry.metrics import read_metrics
from loomrl.telemetry.samples import MismatchWatch
from loomrl.training.step_stats import _Accumulator, add_mismatch_stats, add_offpolicy_stats


def test_mean_max_and_kl_are_those_of_the_same_version_tokens_only():
    log_ratio = torch.tensor([[0.1, -0.2, 5.0], [0.0, 0.3, 0.0]])
    same = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])  # the 5.0 is another version's
    acc = _Accumulator()
    add_mismatch_stats(acc, log_ratio, same)
    out = acc.finish()
    kept = [0.1, -0.2, 0.0, 0.3]
    assert out["train/logprob_mismatch_same_version"] == pytest.approx(0.6 / 4)
    assert out["train/logprob_mismatch_same_version_max"] == pytest.approx(0.3)
    k3 = sum(math.expm1(x) - x for x in kept) / 4  # E_mu[r - 1 - log r]
    assert out["train/logprob_mismatch_kl"] == pytest.approx(k3, rel=1e-5)
    assert out["train/logprob_mismatch_kl"] > 0


def test_the_offpolicy_gap_counts_every_target_token_and_ignores_padding():
    log_ratio = torch.tensor([[0.1, -0.2, 5.0], [0.0, 0.3, 90.0]])  # 90.0: a padded position
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    acc = _Accumulator()
    add_offpolicy_stats(acc, log_ratio, mask)
    out = acc.finish()
    kept = [0.1, -0.2, 5.0, 0.0, 0.3]  # the other version's 5.0 counts here
    assert out["train/offpolicy_logprob_gap"] == pytest.approx(5.6 / 5)
    k3 = sum(math.expm1(x) - x for x in kept) / 5
    assert out["train/offpolicy_kl"] == pytest.approx(k3, rel=1e-5)


def test_the_kl_estimate_approaches_the_true_kl_between_two_distributions():
    # Tokens sampled from mu; the k3 estimator of KL(mu || pi) from their log-ratios.
    g = torch.Generator().manual_seed(0)
    mu = torch.softmax(torch.randn(50, generator=g), 0)
    pi = torch.softmax(torch.log(mu) + 0.3 * torch.randn(50, generator=g), 0)
    tokens = torch.multinomial(mu, 200_000, replacement=True, generator=g)
    log_ratio = (torch.log(pi) - torch.log(mu))[tokens].unsqueeze(0)
    acc = _Accumulator()
    add_mismatch_stats(acc, log_ratio, torch.ones_like(log_ratio))
    true_kl = float((mu * (torch.log(mu) - torch.log(pi))).sum())
    assert acc.finish()["train/logprob_mismatch_kl"] == pytest.approx(true_kl, rel=0.05)


def test_the_warning_is_said_past_the_threshold_at_most_once_every_n_steps(caplog):
    watch = MismatchWatch(threshold=0.01, every_steps=5)
    with caplog.at_level(logging.WARNING, logger="loomrl.telemetry.samples"):
        counts = [
            watch.observe(step, {"train/logprob_mismatch_same_version": gap})
            for step, gap in [(1, 0.001), (2, 0.5), (3, 0.5), (7, 0.5), (8, 0.002)]
        ]
    assert [c["train/logprob_mismatch_warnings"] for c in counts] == [0, 1, 1, 2, 2]
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and "step 2:" in said[0] and "0.5 nats" in said[0]
    assert watch.observe(9, {})["train/logprob_mismatch_warnings"] == 2  # no figure: no warning


def test_a_job_reports_the_mismatch_and_warns_past_its_threshold(tiny_job, tmp_path, caplog):
    # bf16 publishing puts the generator a little off the fp32 trainer: above a tiny
    # threshold, so the job must warn; the metrics are in every step's record.
    cfg = tiny_job(
        algorithm={"max_staleness": 0},
        logging={"report": False, "logprob_mismatch_warning": 1e-7},
        output_dir=str(tmp_path / "run"),
    )
    with caplog.at_level(logging.WARNING, logger="loomrl.telemetry.samples"):
        result = Job(cfg).run()
    records = [r for r in read_metrics(result.run_dir) if "train/loss" in r]
    assert len(records) == 4
    for r in records:
        mean = r["train/logprob_mismatch_same_version"]
        assert 0 < mean <= r["train/logprob_mismatch_same_version_max"] < 0.1
        assert r["train/logprob_mismatch_kl"] >= 0
        # max_staleness 0: every token is of the trainer's version, so both gaps are one
        assert r["train/offpolicy_logprob_gap"] == pytest.approx(mean, rel=1e-4)
    assert records[-1]["train/logprob_mismatch_warnings"] >= 1
    assert any("differ by" in rec.getMessage() for rec in caplog.records)
