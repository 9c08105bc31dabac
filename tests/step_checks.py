"""Comparing two trainers' step metrics up to float32 summation order, on scales that fit.

``train/loss`` is a mean of per-token terms ``weight * advantage`` whose advantages sum to
zero in each group, so it can nearly cancel (6e-5 where its terms are 3e-2, in
``tests/test_fsdp.py``'s uneven groups at step 2): a relative tolerance on it measures the
cancellation, not the error, and another summation order (ranks, idle micro-batches,
micro-batch sizes, thread counts) moved it by 3e-5 of itself. It is compared to ``rel`` of
its terms' scale, the mean |advantage| times the mean importance weight, both from the
reference step. The other step metrics (norms, entropy, ratios, lr) are not cancelled
sums and keep the relative tolerance.
"""

from __future__ import annotations

import pytest

CANCELLED = ("train/loss",)


def loss_term_scale(metrics: dict) -> float:
    """The size of the loss's per-token terms: mean |advantage| x mean importance weight."""
    return metrics["train/advantage_abs_mean"] * metrics["train/importance_weight_mean"]


def assert_same_step(got: dict, want: dict, keys: tuple[str, ...], rel: float = 1e-5) -> None:
    """``got[key]`` is ``want[key]`` within ``rel``: of the value itself, or, for a
    near-cancelled sum (the loss), of the size of its terms (``rel=0``: equal)."""
    for key in keys:
        if key in CANCELLED:
            tolerance = rel * loss_term_scale(want)
            assert got[key] == pytest.approx(want[key], rel=0, abs=tolerance), key
        else:
            assert got[key] == pytest.approx(want[key], rel=rel, abs=0), key


def assert_sum_close(got: float, want: float, terms: list[float], rel: float = 1e-5) -> None:
    """``got`` is the near-cancelled mean ``want`` of ``terms``, within ``rel`` of the terms'
    mean size (not of the mean itself, which cancellation can make as small as zero)."""
    scale = sum(abs(t) for t in terms) / len(terms)
    assert got == pytest.approx(want, rel=0, abs=rel * scale)
