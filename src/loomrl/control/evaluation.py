"""Evaluation: greedy completions (or episodes) of the held-out prompts, scored.

A component the controller holds: it asks the first generator, through the controller's
generate calls (``Rollouts``), on the newest published weights, and scores with a twin of
the training scorer whose failures are counted apart (``eval/*``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from itertools import repeat
from pathlib import Path
from typing import Any

from loomrl.config import JobConfig
from loomrl.control.rollouts import Rollouts
from loomrl.runtime.supervision import ExecutorLostError
from loomrl.scoring.client import Scorer
from loomrl.types import GenerationRequest, Group, Rollout, SamplingParams

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
        # the last evaluation's rollouts, one a held-out row (``samples``), and the file
        # every evaluation's samples are appended to (the run's eval_samples.jsonl; None: kept)
        self.last_groups: list[Group] = []
        self.samples_path: Path | None = None
        # task.agent's episodes, run once per held-out row when set
        self.agent: Any = None

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
        failures_before = self.scorer.failure_counts()
        if self.agent is not None:
            groups = await self.agent.evaluate(self.rows)
        elif self.env_factory is not None:
            groups = await self._episodes()
        else:
            groups = await self._completions()
            await self.scorer.score_groups(groups)
        self.last_groups = groups
        count = sum(group.size for group in groups)
        rewards = [
            reward
            for group in groups
            for reward, status in zip(group.rewards, group.statuses or repeat("ok"))
            if status == "ok"
        ]
        record = {
            "eval/mean_reward": sum(rewards) / count,
            "eval/num_failed": count - len(rewards),
            "eval/version": min(group.min_version for group in groups),
            "timing/eval_s": time.perf_counter() - t0,
        }
        if self.env_factory is None and self.agent is None:
            failed = self.scorer.failure_counts() - failures_before
            record.update({f"eval/failed_{reason}": n for reason, n in failed.items()})
        if record["eval/num_failed"]:
            self._warn_failed(record, groups, count)
        self.history.append(record)
        if self.samples_path is not None:
            self._append_samples(self.samples_path)
        return record

    def _append_samples(self, path: Path) -> None:
        """This evaluation's samples, one JSON line each, appended to ``path`` (an error
        writing them is logged: a sample file must not fail the run)."""
        lines = "".join(
            json.dumps(s, ensure_ascii=False, default=str) + "\n" for s in self.samples()
        )
        try:
            with path.open("a", encoding="utf-8") as f:
                f.write(lines)
        except OSError as err:
            logger.error("could not write %s: %s", path, err)

    async def _completions(self) -> list[Group]:
        """One greedy completion per held-out prompt, as groups of one to score (built as
        training builds its groups, the held-out rows in place of the training rows)."""
        prompts = self.rollouts.prompts
        prompt_ids = prompts.eval_ids(self.rows)
        requests = [
            GenerationRequest(ids, 1, self.greedy, 0, self.rollouts.versions.published)
            for ids in prompt_ids
        ]
        results = await self.rollouts.generate(self.generator, requests)
        picks = [(0, i) for i in range(len(self.rows))]
        return Group.from_results(
            picks, prompt_ids, self.rows, prompts.key, results, prompts.decode_batch
        )

    def samples(self) -> list[dict[str, Any]]:
        """The last evaluation, one JSON-ready dict a held-out row: its index, prompt,
        completion, reward (None when it failed), status and error, and the row's other
        columns under ``row``."""
        out = []
        for group in self.last_groups:
            for rollout in group:
                out.append(
                    {
                        "index": group.prompt_index,
                        "prompt": rollout.prompt,
                        "completion": rollout.completion,
                        "reward": rollout.reward if rollout.status == "ok" else None,
                        "status": rollout.status,
                        "error": rollout.error,
                        "version": rollout.version,
                        "row": group.row,
                    }
                )
        return out

    @staticmethod
    def _warn_failed(record: dict[str, Any], groups: list[Group], count: int) -> None:
        errors = (error for group in groups for error in group.errors or () if error is not None)
        logger.warning(
            "eval at version %d: %d of %d rollouts failed scoring and count as wrong answers; "
            "first error: %s",
            record["eval/version"],
            record["eval/num_failed"],
            count,
            next(errors, None),
        )

    async def _episodes(self) -> list[Group]:
        """One greedy episode per held-out prompt, each a group of one (scored by its
        environment)."""
        rollouts = self.rollouts

        async def one(i: int, row: dict[str, Any]) -> Rollout:
            env = self.env_factory()
            try:
                rollout, *_ = await rollouts.run_episodes(
                    [env],
                    row,
                    i,
                    lambda reqs: rollouts.generate(
                        self.generator, rollouts.require(reqs, eval_=True)
                    ),
                    self.greedy,
                    0,
                    self.max_turns,
                    stats=False,
                )
            finally:
                env.close()
            return rollout

        done = await asyncio.gather(
            *(one(i, row) for i, row in enumerate(self.rows)), return_exceptions=True
        )
        # Every episode has ended: a retry does not run beside leftovers.
        for outcome in done:
            if isinstance(outcome, BaseException):
                raise outcome
        return [Group.of_rollouts(i, 0, [rollout]) for i, rollout in enumerate(done)]
