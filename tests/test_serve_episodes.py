"""Episode samples: requests that extend the one before merge token-exactly; one that does
not starts a sample of its own; a closed or unknown episode is refused with its reason."""

from __future__ import annotations

import asyncio

import pytest

from loomrl.serve.agents import AgentFailure, read_result
from loomrl.serve.episodes import EpisodeBook, EpisodeError, merge_calls
from loomrl.serve.protocol import SampledChoice


def call(prompt, tokens, version=0, logprob=-0.5):
    return SampledChoice(prompt, tokens, [logprob] * len(tokens), version, "length", "")


def test_extending_requests_merge_into_one_sample_with_inserted_tokens_masked():
    calls = [
        call([1, 2], [10, 11], 3),
        call([1, 2, 10, 11, 50], [12], 4),
        call([1, 2, 10, 11, 50, 12, 51, 52], [13, 14], 4),
    ]
    (sample,) = merge_calls(calls)
    assert sample.prompt_ids == [1, 2]
    assert sample.completion_ids == [10, 11, 50, 12, 51, 52, 13, 14]
    assert sample.loss_mask == [1, 1, 0, 1, 0, 0, 1, 1]
    assert sample.logprobs == [-0.5, -0.5, 0.0, -0.5, 0.0, 0.0, -0.5, -0.5]
    assert (sample.versions, sample.num_turns) == ([3, 4, 4], 3)


def test_a_request_that_does_not_extend_starts_a_new_sample():
    calls = [call([1, 2], [10]), call([1, 3], [11]), call([1, 3, 11, 7], [12])]
    first, second = merge_calls(calls)
    assert (first.prompt_ids, first.completion_ids) == ([1, 2], [10])
    assert (second.prompt_ids, second.completion_ids, second.loss_mask) == (
        [1, 3],
        [11, 7, 12],
        [1, 0, 1],
    )


def test_closed_and_unknown_episodes_are_refused_and_deadlines_close_them():
    async def main():
        book = EpisodeBook(deadline_s=60.0)
        done = book.start({"prompt": "x"})
        book.close(done.id, {"reward": 1.0}, "rewarded")
        assert await done.closed == {"reward": 1.0}
        with pytest.raises(EpisodeError, match="is closed \\(rewarded\\)") as closed:
            book.get(done.id)
        with pytest.raises(EpisodeError, match="no episode") as unknown:
            book.get("ep-unknown")
        late = book.start({}, deadline_s=0.01)
        await asyncio.sleep(0.05)
        with pytest.raises(EpisodeError, match="deadline passed"):
            book.get(late.id)
        with pytest.raises(TimeoutError):
            await late.closed
        return closed.value.status, unknown.value.status, book.num_expired

    assert asyncio.run(main()) == (409, 404, 1)


@pytest.mark.parametrize(
    ("value", "expected"),
    [(1, (1.0, {})), (None, (None, {})), ({"reward": 0.5, "turns": 3}, (0.5, {"turns": 3.0}))],
)
def test_an_agents_return_value_is_a_reward_a_dict_or_nothing(value, expected):
    assert read_result(value) == expected


@pytest.mark.parametrize(
    "value", ["high", float("nan"), {"score": 1.0}, {"reward": 1.0, "note": "x"}]
)
def test_anything_else_an_agent_returns_fails_its_episode_as_invalid(value):
    with pytest.raises(AgentFailure) as err:
        read_result(value)
    assert err.value.kind == "invalid"
