"""Evaluation: greedy completions (or episodes) of the held-out prompts, scored.

A part of ``Controller`` (a mixin: it reads the controller's generators, scorer, tokenizer
and versions), kept apart so the RL loop in ``loomrl.controller`` stays short.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from typing import Any

from loomrl.runtime.supervision import ExecutorLostError
from loomrl.types import GenerationRequest, Rollout, SamplingParams

logger = logging.getLogger(__name__)


class Evaluation:
    async def evaluate(self) -> dict[str, Any]:
        """Greedy completions (or episodes) of the held-out prompts, scored: mean reward.
        Run once more if its generator is lost (and replaced) on the way."""
        try:
            return await self._evaluate_once()
        except ExecutorLostError as err:
            if not err.restarted:
                raise
            logger.warning("evaluation lost its generator (%s); evaluating again", err)
            return await self._evaluate_once()

    async def _evaluate_once(self) -> dict[str, Any]:
        if not self.eval_rows:
            return {}
        t0 = time.perf_counter()
        greedy = SamplingParams(max_new_tokens=self.cfg.generation.max_new_tokens, greedy=True)
        if self.env_factory is not None:
            rollouts = await self._evaluate_episodes(greedy)
        else:
            requests = [
                GenerationRequest(ids, 1, greedy, 0, self.published_version)
                for ids in self._eval_prompts()
            ]
            results = await self._generate(self.generators[0], requests)
            rollouts = [
                Rollout(
                    i,
                    req.prompt_ids,
                    res.completions[0].token_ids,
                    res.completions[0].logprobs,
                    [],
                    res.version,
                    row[self._prompt_key],
                    self._decode(res.completions[0].token_ids),
                    row,
                )
                for i, (row, req, res) in enumerate(zip(self.eval_rows, requests, results))
            ]
            failures_before = Counter(self.eval_scorer.failures_by_reason)
            await self.eval_scorer.score(rollouts)
        rewards = [r.reward for r in rollouts if r.status == "ok"]
        record = {
            "eval/mean_reward": sum(rewards) / len(rollouts),
            "eval/num_failed": len(rollouts) - len(rewards),
            "eval/version": min(r.version for r in rollouts),
            "timing/eval_s": time.perf_counter() - t0,
        }
        if self.env_factory is None:
            failed = self.eval_scorer.failures_by_reason - failures_before
            record.update({f"eval/failed_{reason}": n for reason, n in failed.items()})
        if record["eval/num_failed"]:
            last = next((r.error for r in rollouts if r.status == "failed"), None)
            logger.warning(
                "eval at version %d: %d of %d rollouts failed scoring and count as wrong answers; "
                "first error: %s",
                record["eval/version"],
                record["eval/num_failed"],
                len(rollouts),
                last,
            )
        self.eval_history.append(record)
        return record

    def _eval_prompts(self) -> list[list[int]]:
        """The held-out prompts' ids, encoded in one tokenizer call at the first evaluation
        and kept (every evaluation asks the same prompts)."""
        if self._eval_prompt_ids is None:
            self._eval_prompt_ids = self._encode_prompts(
                [r[self._prompt_key] for r in self.eval_rows]
            )
        return self._eval_prompt_ids

    async def _evaluate_episodes(self, greedy: SamplingParams) -> list[Rollout]:
        from loomrl.envs.episode import run_group_episodes

        async def one(i: int, row: dict[str, Any]) -> Rollout:
            env = self.env_factory()
            try:
                (rollout,) = await run_group_episodes(
                    [env],
                    row,
                    i,
                    generate=lambda reqs: self._generate(
                        self.generators[0], self._require(reqs, eval_=True)
                    ),
                    encode=self._encode,
                    decode=self._decode,
                    sampling=greedy,
                    max_turns=self.cfg.task.max_turns,
                    seed=0,
                )
            finally:
                env.close()
            return rollout

        done = await asyncio.gather(
            *(one(i, row) for i, row in enumerate(self.eval_rows)), return_exceptions=True
        )
        for outcome in done:  # every episode has ended: a retry does not run beside leftovers
            if isinstance(outcome, BaseException):
                raise outcome
        return list(done)
