"""The job's OpenAI-compatible endpoint (``loomrl.serve``) for the length of a run: served
when ``serve.enabled`` or ``task.agent`` is set, on the controller's loop, its generate calls
routed to the least busy generator through the controller's own (``Rollouts.generate``: the
newest weights first, the staleness gate's oldest version, the scheduler's lease). With
``task.agent`` the controller runs the agent's episodes (``JobAgent``) in place of
generate calls, and evaluates with them."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from loomrl.config import JobConfig
from loomrl.types import Group


class JobAgent:
    """``task.agent``'s episodes as the controller asks for them: a group of
    ``group_size`` episodes for a training row, one episode per held-out row."""

    def __init__(self, episodes, controller, group_size: int) -> None:
        self.episodes, self.group_size = episodes, group_size
        self.prompts, self.scorer = controller.rollouts.prompts, controller.scorer
        self.eval_scorer = controller.evaluator.scorer

    def _prompt(self, row: dict[str, Any]) -> str:
        return str(row.get(self.prompts.key, ""))

    async def group(self, epoch: int, index: int) -> Group:
        row = self.prompts.rows[index]
        return await self.episodes.group(
            row, index, epoch, self.group_size, self._prompt(row), self.scorer
        )

    async def evaluate(self, rows: list[dict[str, Any]]) -> list[Group]:
        import asyncio

        return list(
            await asyncio.gather(
                *(
                    self.episodes.group(row, i, 0, 1, self._prompt(row), self.eval_scorer)
                    for i, row in enumerate(rows)
                )
            )
        )


def _endpoint_state(cfg: JobConfig, controller, tokenizer):
    """The endpoint's routes' state: the policy behind a batcher over the controller's
    generate calls, the episodes, a fresh token."""
    from loomrl.serve.app import ServeState
    from loomrl.serve.batcher import Batcher
    from loomrl.serve.episodes import EpisodeBook
    from loomrl.serve.policy import ServedPolicy, load_tool_parser
    from loomrl.serve.server import new_token

    serve, rollouts, generators = cfg.serve, controller.rollouts, controller.generators

    async def generate(requests):
        return await rollouts.generate(generators.least_busy(), rollouts.require(requests))

    batcher = Batcher(generate, serve.batch_window_ms / 1000, serve.max_batch, len(generators))
    policy = ServedPolicy(
        tokenizer,
        batcher,
        default_max_tokens=cfg.generation.max_new_tokens,
        max_tokens=serve.max_tokens or cfg.generation.max_new_tokens,
        seed=cfg.seed,
        tool_parser=load_tool_parser(serve.tool_parser),
        chat_template=serve.chat_template,
    )
    book = EpisodeBook(serve.episode_deadline_s)
    model = serve.model_name or cfg.name
    return ServeState(policy, book, new_token(), model, serve.max_body_bytes)


@contextlib.asynccontextmanager
async def serving(cfg: JobConfig, controller, run_dir: Path, tokenizer) -> AsyncIterator[Any]:
    """The endpoint, from start to the end of the block (None when the job serves none)."""
    if not (cfg.serve.enabled or cfg.task.agent):
        yield None
        return
    from loomrl.serve.agents import AgentEpisodes, load_agent
    from loomrl.serve.server import Endpoint

    serve = cfg.serve
    state = _endpoint_state(cfg, controller, tokenizer)
    batcher, book = state.policy.batcher, state.book
    endpoint = Endpoint(state, serve.host, serve.port)
    url = await endpoint.start()
    endpoint.write_run_files(run_dir)
    episodes = None
    if cfg.task.agent:
        # an agent's every request would be an httpx INFO line in the run's log
        logging.getLogger("httpx").setLevel(logging.WARNING)
        agent = load_agent(cfg.task.agent)
        episodes = AgentEpisodes(agent, book, url, state.token, serve.episode_timeout_s)
        state.claim = episodes.claim if episodes.external else None
        controller.agent = controller.evaluator.agent = JobAgent(
            episodes, controller, cfg.algorithm.group_size
        )
    before = controller.step_record.extra_metrics
    controller.step_record.extra_metrics = lambda: {
        **(before() if before else {}),
        **batcher.metrics(),
        **(episodes.metrics() if episodes else {}),
    }
    try:
        yield endpoint
    finally:
        if episodes is not None:
            await episodes.close()
        await endpoint.stop()
