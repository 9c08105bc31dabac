"""Evaluation: greedy completions (or episodes) of the held-out prompts, scored.

A component the controller holds: it asks the first generator, through the controller's
generate calls (``Rollouts``), on the newest published weights, and scores with a twin of
the training scorer whose failures are counted apart (``eval/*``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from loomrl.config import JobConfig
from loomrl.control.rollouts import Rollouts
from loomrl.runtime.supervision import ExecutorLostError
from loomrl.scoring.client import Scorer
from loomrl.types import GenerationRequest, Rollout, SamplingParams

logger = logging.getLogger(__name__)


class Evaluator:
    def __init__(
        self,
        cfg: JobConfig,
        rows: list[dict[str, Any]],
        rollouts: Rollouts,
        generator,
        scorer: Scorer,
        env_factory: Callable[[], Any] | None = None,
    ) -> None:
        self.rows, self.rollouts, self.generator = rows, rollouts, generator
        self.scorer = scorer.for_eval()  # eval failures are counted under eval/*, apart
        self.greedy = SamplingParams(max_new_tokens=cfg.generation.max_new_tokens, greedy=True)
        self.env_factory, self.max_turns = env_factory, cfg.task.max_turns
        self.history: list[dict[str, Any]] = []

    async def first(self, history: dict[str, Any], resumed: bool) -> dict[str, Any]:
        """The evaluation before the first step, kept in ``history``; a resumed run keeps
        its first run's (its record is not logged again)."""
        if resumed:
            return {"eval/mean_reward": history["eval_start"]}
        record = await self.evaluate()
        history["eval_start"] = record.get("eval/mean_reward")
        return record

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
        if not self.rows:
            return {}
        t0 = time.perf_counter()
        failures_before = Counter(self.scorer.failures_by_reason)
        if self.env_factory is not None:
            rollouts = await self._episodes()
        else:
            rollouts = await self._completions()
            await self.scorer.score(rollouts)
        rewards = [r.reward for r in rollouts if r.status == "ok"]
        record = {
            "eval/mean_reward": sum(rewards) / len(rollouts),
            "eval/num_failed": len(rollouts) - len(rewards),
            "eval/version": min(r.version for r in rollouts),
            "timing/eval_s": time.perf_counter() - t0,
        }
        if self.env_factory is None:
            failed = self.scorer.failures_by_reason - failures_before
            record.update({f"eval/failed_{reason}": n for reason, n in failed.items()})
        if record["eval/num_failed"]:
            self._warn_failed(record, rollouts)
        self.history.append(record)
        return record

    async def _completions(self) -> list[Rollout]:
        """One greedy completion per held-out prompt, as rollouts to score."""
        prompts = self.rollouts.prompts
        requests = [
            GenerationRequest(ids, 1, self.greedy, 0, self.rollouts.versions.published)
            for ids in prompts.eval_ids(self.rows)
        ]
        results = await self.rollouts.generate(self.generator, requests)
        return [
            Rollout(
                i,
                req.prompt_ids,
                res.completions[0].token_ids,
                res.completions[0].logprobs,
                [],
                res.version,
                row[prompts.key],
                prompts.decode(res.completions[0].token_ids),
                row,
            )
            for i, (row, req, res) in enumerate(zip(self.rows, requests, results))
        ]

    @staticmethod
    def _warn_failed(record: dict[str, Any], rollouts: list[Rollout]) -> None:
        last = next((r.error for r in rollouts if r.status == "failed"), None)
        logger.warning(
            "eval at version %d: %d of %d rollouts failed scoring and count as wrong answers; "
            "first error: %s",
            record["eval/version"],
            record["eval/num_failed"],
            len(rollouts),
            last,
        )

    async def _episodes(self) -> list[Rollout]:
        from loomrl.envs.episode import run_group_episodes

        rollouts, prompts = self.rollouts, self.rollouts.prompts

        async def one(i: int, row: dict[str, Any]) -> Rollout:
            env = self.env_factory()
            try:
                (rollout,) = await run_group_episodes(
                    [env],
                    row,
                    i,
                    generate=lambda reqs: rollouts.generate(
                        self.generator, rollouts.require(reqs, eval_=True)
                    ),
                    encode=prompts.encode_text,
                    decode=prompts.decode,
                    sampling=self.greedy,
                    max_turns=self.max_turns,
                    seed=0,
                )
            finally:
                env.close()
            return rollout

        done = await asyncio.gather(
            *(one(i, row) for i, row in enumerate(self.rows)), return_exceptions=True
        )
        for outcome in done:  # every episode has ended: a retry does not run beside leftovers
            if isinstance(outcome, BaseException):
                raise outcome
        return list(done)
