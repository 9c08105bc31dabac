"""Multi-turn episode driver with a fake generator: masks, log-probs, versions, rewards, failures."""

from __future__ import annotations

import asyncio

from loomrl.envs.base import Environment, StepResult
from loomrl.envs.episode import run_group_episodes, turn_seed
from loomrl.types import GenerationResult, SamplingParams

BOS = 1


def encode(text: str) -> list[int]:
    return [BOS] + [ord(c) for c in text]  # adds BOS like the core's tokenizer


def decode(ids: list[int]) -> str:
    return "".join(chr(i) for i in ids if i > 2)


class FakeGenerator:
    """Completion text depends on the seed; log-prob of token k is -(k+1)/10; version rises."""

    def __init__(self) -> None:
        self.calls: list[list] = []
        self.version = 3

    async def __call__(self, requests):
        self.calls.append(requests)
        results = []
        for req in requests:
            text = f"a{req.seed % 7}"
            ids = [ord(c) for c in text]
            logprobs = [-(k + 1) / 10 for k in range(len(ids))]
            results.append(GenerationResult([ids], [logprobs], ["stop"], None, self.version))
        self.version += 1
        return results


class CountingEnv(Environment):
    """Reward 1 per turn, done after ``turns`` turns; observation 'ok'."""

    def __init__(self, turns: int, fail_at: int | None = None, async_step: bool = False) -> None:
        self.turns, self.fail_at, self.seen = turns, fail_at, []
        if async_step:
            self.step = self._async_step  # type: ignore[method-assign]

    def reset(self, row):
        return row["prompt"]

    def step(self, completion):
        self.seen.append(completion)
        if self.fail_at is not None and len(self.seen) == self.fail_at:
            raise RuntimeError("env exploded")
        done = len(self.seen) >= self.turns
        return StepResult(observation="" if done else "ok", reward=1.0, done=done)

    async def _async_step(self, completion):
        await asyncio.sleep(0)
        return CountingEnv.step(self, completion)


def run(envs, max_turns=4, seed=5):
    gen = FakeGenerator()
    rollouts = asyncio.run(
        run_group_episodes(
            envs,
            {"prompt": "P?", "extra": 1},
            7,
            generate=gen,
            encode=encode,
            decode=decode,
            sampling=SamplingParams(max_new_tokens=2),
            max_turns=max_turns,
            seed=seed,
        )
    )
    return rollouts, gen


def test_masks_logprobs_and_prompts_line_up():
    envs = [CountingEnv(turns=2), CountingEnv(turns=1)]
    (two, one), gen = run(envs)
    # two turns: gen(2) + obs "ok" (2, masked, no BOS) + gen(2)
    assert two.loss_mask == [1, 1, 0, 0, 1, 1]
    assert two.behaviour_logprobs == [-0.1, -0.2, 0.0, 0.0, -0.1, -0.2]
    assert two.completion_ids[2:4] == [ord("o"), ord("k")]
    assert len(two.completion_ids) == len(two.loss_mask) == len(two.behaviour_logprobs)
    assert two.prompt_ids == encode("P?") and two.prompt == "P?"
    assert one.loss_mask == [1, 1] and one.num_turns == 1
    # turn 2 asked only for the live episode, prompting with everything so far
    assert [len(c) for c in gen.calls] == [2, 1]
    assert gen.calls[1][0].prompt_ids == encode("P?") + two.completion_ids[:4]
    assert gen.calls[0][0].seed == turn_seed(5, 0, 0) and gen.calls[1][0].seed == turn_seed(5, 1, 0)
    assert all(r.num_samples == 1 for call in gen.calls for r in call)


def test_reward_is_the_sum_and_version_the_minimum():
    (three,), _ = run([CountingEnv(turns=3)])
    assert three.reward == 3.0 and three.num_turns == 3
    assert three.version == 3  # versions 3, 4, 5 over the turns
    # each token's own version (an observation: its turn's), for the per-token parity metrics
    assert three.token_versions == [3, 3, 3, 3, 4, 4, 4, 4, 5, 5]
    assert three.status == "ok" and three.prompt_index == 7 and three.row["extra"] == 1


def test_max_turns_stops_and_appends_no_trailing_observation():
    (ep,), gen = run([CountingEnv(turns=10)], max_turns=2)
    assert ep.num_turns == 2 and ep.reward == 2.0
    assert ep.loss_mask == [1, 1, 0, 0, 1, 1]
    assert len(gen.calls) == 2


def test_a_failing_env_fails_only_its_own_rollout():
    envs = [CountingEnv(turns=3, fail_at=2), CountingEnv(turns=3, async_step=True)]
    (bad, good), _ = run(envs)
    assert bad.status == "failed" and "env exploded" in bad.error and bad.reward is None
    assert good.status == "ok" and good.reward == 3.0 and good.num_turns == 3


def test_a_failing_reset_fails_only_its_own_rollout():
    class BadReset(CountingEnv):
        def reset(self, row):
            raise KeyError("no prompt")

    (bad, good), gen = run([BadReset(turns=1), CountingEnv(turns=1)])
    assert bad.status == "failed" and "reset raised" in bad.error and bad.completion_ids == []
    assert good.status == "ok" and good.reward == 1.0
    assert len(gen.calls[0]) == 1


def test_a_turn_whose_weights_changed_mid_request_keeps_each_tokens_version():
    class InflightGenerator(FakeGenerator):
        async def __call__(self, requests):
            results = await super().__call__(requests)  # version 3, then 4 ...
            return [
                GenerationResult.from_columns(
                    r.token_ids,
                    r.logprobs,
                    r.finish_reasons,
                    None,
                    r.version,
                    [[r.version, r.version + 1]],  # the second token sampled one version on
                )
                for r in results
            ]

    gen = InflightGenerator()
    (ep,) = asyncio.run(
        run_group_episodes(
            [CountingEnv(turns=2)],
            {"prompt": "P?"},
            0,
            generate=gen,
            encode=encode,
            decode=decode,
            sampling=SamplingParams(max_new_tokens=2),
            max_turns=2,
            seed=5,
        )
    )
    assert ep.version == 3 and ep.token_versions == [3, 4, 4, 4, 4, 5]
