"""Completions cut at the generation limit (``algorithm.overlong``), after DAPO
(arXiv 2503.14476): a truncated answer is no evidence of a wrong one, so either it trains
on nothing ('filter', DAPO's overlong filtering) or its reward is lowered as it nears the
limit ('soft', DAPO's soft overlong punishment, eq. 13):

    R_length(y) = 0                              if |y| <= L_max - L_cache
                  ((L_max - L_cache) - |y|) / L_cache   if L_max - L_cache < |y| <= L_max
                  -1                             if |y| > L_max

added to the task's reward before advantages are computed. ``L_max`` is
``generation.max_new_tokens``, ``L_cache`` is ``algorithm.overlong_buffer_tokens`` and
``|y|`` counts the tokens the model generated (``loss_mask``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from loomrl.config_common import AlgorithmConfig
from loomrl.types import Rollout


def overlong_penalty(length: int, max_tokens: int, buffer_tokens: int) -> float:
    """DAPO's soft overlong punishment of a completion of ``length`` tokens (module
    docstring): 0 up to ``max_tokens - buffer_tokens``, then down linearly to -1."""
    expected = max_tokens - buffer_tokens
    if length <= expected:
        return 0.0
    if length <= max_tokens:
        return (expected - length) / buffer_tokens
    return -1.0


def buffer_tokens(algo: AlgorithmConfig, max_tokens: int) -> int:
    """The penalty's ramp: ``algorithm.overlong_buffer_tokens``, by default a fifth of
    ``max_tokens``; never longer than ``max_tokens``."""
    chosen = algo.overlong_buffer_tokens or max(1, max_tokens // 5)
    return min(chosen, max_tokens)


def reward_penalty(
    algo: AlgorithmConfig, max_tokens: int | None
) -> Callable[[Rollout], float] | None:
    """The penalty added to each rollout's reward ('soft'), or None."""
    if algo.overlong != "soft":
        return None
    if not max_tokens:
        raise ValueError(
            "algorithm.overlong='soft' needs the completions' maximum length "
            "(generation.max_new_tokens), got none"
        )
    ramp = buffer_tokens(algo, max_tokens)
    return lambda r: overlong_penalty(sum(r.loss_mask), max_tokens, ramp)


def mask_truncated(rollouts: list[Rollout]) -> tuple[list[Rollout], int]:
    """'filter': each rollout cut at the limit (``finish_reason == "length"``) with no
    token to train on, and how many there were."""
    out, masked = [], 0
    for r in rollouts:
        if r.finish_reason == "length":
            r = dataclasses.replace(r, loss_mask=[0] * len(r.loss_mask))
            masked += 1
        out.append(r)
    return out, masked
