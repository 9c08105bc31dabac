"""A ``Group`` holds one prompt's rollouts as columns; a ``Rollout`` is a row view built
where one is needed. Every reading the loop makes must agree with the rollouts the
controller used to build one by one, and a change goes into the columns, never a view."""

from __future__ import annotations

import asyncio
import copy
import pickle

import pytest

from loomrl.config import TaskConfig
from loomrl.runtime.endpoints import Endpoint
from loomrl.scoring.base import per_group_outcomes
from loomrl.scoring.client import Scorer
from loomrl.scoring.function import FunctionScorer
from loomrl.types import GenerationResult, Group, Rollout

ROW = {"prompt": "1+2=", "answer": "3"}


def _result(version: int = 3) -> GenerationResult:
    """Three completions, with their texts, as an engine gives them."""
    return GenerationResult.from_columns(
        [[5, 2], [7], [8, 9, 4]],
        [[-0.5, -0.25], [-1.5], [-0.1, -0.2, -0.3]],
        ["length", "stop", "length"],
        ["3", "4", "x"],
        version,
    )


def _no_decode(ids):
    raise AssertionError("these completions carry their texts")


def _from_result(index: int, epoch: int, result: GenerationResult, decode=_no_decode) -> Group:
    """The group of one result, for prompt ``[1, 2]`` of row ``index`` (``ROW``)."""
    return Group.from_results([(epoch, index)], [[1, 2]], {index: ROW}, "prompt", [result], decode)[
        0
    ]


def _columnar(index: int = 7, epoch: int = 1, version: int = 3) -> Group:
    return _from_result(index, epoch, _result(version))


def _one_by_one(index: int = 7, version: int = 3) -> list[Rollout]:
    """What the controller built per completion before groups held columns."""
    result = _result(version)
    return [
        Rollout(
            index,
            [1, 2],
            ids,
            logprobs,
            [1] * len(ids),
            version,
            ROW["prompt"],
            text,
            ROW,
            None,
            "ok",
            None,
            finish,
        )
        for ids, logprobs, finish, text in zip(
            result.token_ids, result.logprobs, result.finish_reasons, result.texts
        )
    ]


def test_a_generated_group_reads_as_the_rollouts_it_stands_for():
    group = _columnar()
    explicit = Group.of_rollouts(7, 1, _one_by_one())
    assert group.size == explicit.size == 3
    assert group.min_version == explicit.min_version == 3
    assert group.rewards == explicit.rewards == [None, None, None]
    assert group.completion_tokens == explicit.completion_tokens == 6 == group.num_tokens
    assert explicit.num_tokens is None  # (counted when asked)
    assert group.all_ok and explicit.all_ok and group.num_failed == explicit.num_failed == 0
    # Default columns are None in both forms, so they compare equal column by column.
    assert group == explicit and explicit.loss_masks is None and explicit.statuses is None
    fresh = group.ok_rollouts()
    assert fresh == list(group) == _one_by_one() and group.ok_rollouts() is not fresh


def test_a_row_is_a_view_and_changes_go_into_the_columns():
    group = _columnar()
    group.rewards = [1.0, 0.0, 0.5]
    rows = list(group)
    assert [r.reward for r in rows] == [1.0, 0.0, 0.5] and [r.loss_mask for r in rows] == [
        [1, 1],
        [1],
        [1] * 3,
    ]
    rows[1].reward = 9.0  # a view: the group does not change
    assert group.rewards == [1.0, 0.0, 0.5]
    group.fail(1, "timeout", "slow")
    assert not group.all_ok and group.num_failed == 1 and group.rewards == [1.0, None, 0.5]
    assert group.failures == [None, "timeout", None] and group.errors == [None, "slow", None]
    ok = group.ok_rollouts()
    assert [r.completion_ids for r in ok] == [[5, 2], [8, 9, 4]]
    failed = list(group)[1]
    assert (failed.status, failed.failure, failed.error) == ("failed", "timeout", "slow")
    kept = group.without_failed()
    assert kept.size == 2 and kept.all_ok and kept.completion_tokens == 5
    assert list(kept) == ok and group.size == 3  # (a new group: this one keeps its rows)


def test_rollouts_with_masks_turns_and_failures_round_trip_through_the_columns():
    rollouts = _one_by_one()
    rollouts[0].loss_mask, rollouts[0].num_turns = [1, 0], 2
    rollouts[2].status, rollouts[2].failure, rollouts[2].error = "failed", "environment", "boom"
    rollouts[2].timings = {"episode_s": 0.5}
    group = Group.of_rollouts(7, 1, rollouts)
    assert group.loss_masks == [[1, 0], [1], [1, 1, 1]] and group.num_turns == [2, 1, 1]
    assert group.statuses == ["ok", "ok", "failed"] and group.failures == [
        None,
        None,
        "environment",
    ]
    assert list(group) == rollouts and group.completion_tokens == 5
    with pytest.raises(ValueError, match="no rollouts for prompt 4"):
        Group.of_rollouts(4, 0, [])


@pytest.mark.parametrize("failed", [False, True])
def test_a_group_pickles_and_copies_as_its_columns(failed):
    group = _columnar()
    group.rewards = [1.0, 0.0, 1.0]
    if failed:
        group.fail(2, "raised", "no")
    for back in (pickle.loads(pickle.dumps(group, protocol=5)), copy.deepcopy(group)):
        assert type(back) is Group and back == group and back is not group
        assert back.num_tokens == group.num_tokens and list(back) == list(group)
    # (memoized: the prompt and its ids repeated per rollout pickle once)
    back = pickle.loads(pickle.dumps(group))
    assert back.prompt_ids[0] is back.prompt_ids[2]


def picky_reward(prompt: str, completion: str, answer: str, **row) -> float:
    if completion == "x":
        raise ValueError("no x here")
    return 1.0 if completion == answer else 0.0


def test_scoring_groups_sets_column_rewards_and_marks_a_failure_on_built_rollouts():
    scorer = Scorer(TaskConfig(reward="tests.test_groups:picky_reward"))
    clean = _columnar(index=1)
    clean.texts = ["3", "4", "3"]
    faulty = _columnar(index=2)  # its third completion is "x"
    asyncio.run(scorer.score_groups([clean, faulty]))
    assert clean.all_ok and clean.rewards == [1.0, 0.0, 1.0] and clean.statuses is None
    assert [r.status for r in faulty] == ["ok", "ok", "failed"]
    assert faulty.rewards == [1.0, 0.0, None] and "no x here" in faulty.errors[2]
    assert faulty.failures == [None, None, "raised"]
    assert scorer.failures_by_reason and sum(scorer.failures_by_reason.values()) == 1
    # The same outcomes for groups of one (evaluation's), scored as one batch.
    twin = Scorer(TaskConfig(reward="tests.test_groups:picky_reward"))
    rollouts = _one_by_one(index=1)
    for r, text in zip(rollouts, ["3", "4", "3"]):
        r.completion = text
    singles = [Group.of_rollouts(7, 1, [r]) for r in rollouts + _one_by_one(index=2)]
    asyncio.run(twin.score_groups(singles))
    assert [g.rewards[0] for g in singles] == clean.rewards + faulty.rewards
    assert twin.failure_counts() == scorer.failure_counts() == {"raised": 1}


class _Slot:
    """A scorer executor as the Scorer sees one (a ``Supervised`` slot): its endpoints."""

    def __init__(self, executor) -> None:
        self.executor, self.in_flight, self.name, self.methods = executor, 0, "scorer0", []
        self.score = Endpoint("score", self._send)
        self.score_groups = Endpoint("score_groups", self._send)

    async def _send(self, method, args, kwargs, then):
        result = await self._run(method, *args)
        return result if then is None else then(result)

    async def _run(self, method, *args):
        self.methods.append(method)
        return getattr(self.executor, method)(*args)


def test_scoring_groups_on_an_executor_sends_a_group_not_an_item_and_agrees_with_scoring_here():
    task = TaskConfig(reward="tests.test_groups:picky_reward")
    executor = FunctionScorer(task)
    try:
        remote = Scorer(task)
        slot = _Slot(executor)
        remote.attach([slot], fault_stats=None)
        local = Scorer(task)
        groups = {}
        for scorer in (remote, local):
            clean, faulty = _columnar(index=1), _columnar(index=2)
            clean.texts = ["3", "4", "3"]
            asyncio.run(scorer.score_groups([clean, faulty]))
            groups[id(scorer)] = (clean, faulty)
        assert slot.methods == ["score_groups"]  # one call for both groups, no ScoreItem built here
        (rc, rf), (lc, lf) = groups[id(remote)], groups[id(local)]
        assert rc.all_ok and rc.rewards == lc.rewards == [1.0, 0.0, 1.0]
        assert rf.statuses == ["ok", "ok", "failed"] and rf == lf
        assert (
            remote.failures_by_reason == local.failures_by_reason
            and sum(remote.failures_by_reason.values()) == 1
        )
    finally:
        executor.close()


class _LostSlot(_Slot):
    """A scorer executor lost with every call (as one killed, restarted and killed again)."""

    async def _run(self, method, *args):
        from loomrl.runtime.supervision import ExecutorLostError

        self.methods.append(method)
        raise ExecutorLostError(
            "executor 'scorer0' (pid 1) killed by SIGKILL", "scorer", restarted=True
        )


def test_groups_whose_scorer_is_lost_twice_fail_as_lost_and_are_counted():
    """A group call lost on its retry too: every rollout fails as ``scorer_lost`` (its
    prompt goes out again in the controller), counted as re-scored, then lost."""
    from loomrl.runtime.supervision import FaultStats
    from loomrl.scoring.base import lost_by_scorer

    task = TaskConfig(reward="tests.test_groups:picky_reward")
    scorer, slot, stats = Scorer(task), _LostSlot(None), FaultStats()
    scorer.attach([slot], fault_stats=stats)
    groups = [_columnar(index=1), _columnar(index=2)]
    asyncio.run(scorer.score_groups(groups))
    assert slot.methods == ["score_groups", "score_groups"]
    assert stats.rescored_rollouts == stats.lost_rollouts == 6
    assert all(g.num_failed == 3 and all(map(lost_by_scorer, g)) for g in groups)
    assert "SIGKILL" in groups[0].errors[0]
    assert {f for g in groups for f in g.failures} == {"scorer_lost"}


def test_a_reward_whose_message_reads_like_a_lost_scorer_is_still_the_rewards_failure():
    """``lost_by_scorer`` reads the failure kind, never the error text."""
    from loomrl.scoring.base import SCORER_LOST, lost_by_scorer

    group = _columnar()
    group.fail(0, "raised", f"{SCORER_LOST}: said the reward")
    group.fail(1, "scorer_lost", "killed")
    said, killed, scored = list(group)
    assert said.status == "failed" and said.failure == "raised" and not lost_by_scorer(said)
    assert lost_by_scorer(killed) and not lost_by_scorer(scored)


def test_per_group_outcomes_split_at_the_group_sizes():
    outcomes = [("ok", 1.0, 0.0), ("ok", 0.0, 0.0), ("timeout", "slow", 1.0), ("ok", 1.0, 0.0)]
    assert per_group_outcomes(outcomes, [2, 2, 0]) == [
        ("ok", [1.0, 0.0]),
        ("outcomes", outcomes[2:]),
        ("ok", []),
    ]


def test_one_calls_groups_are_built_together_each_as_its_own_result_would_be():
    """``Group.from_results``: group i is result i's completions, for pick i's row and epoch
    and request i's prompt; a result without texts is decoded, alone."""
    full = _result(3)
    rows = {3: {"prompt": "2+2=", "answer": "4"}, 7: ROW}
    decoded = []

    def decode(ids):
        decoded.append(ids)
        return [f"d{len(i)}" for i in ids]

    results = [
        full,
        GenerationResult.from_columns([[4, 4]], [[-0.3, -0.6]], ["stop"], None, 2),
        GenerationResult.from_columns(
            full.token_ids[:2], full.logprobs[:2], ["stop", "length"], ["a", "b"], 1
        ),
    ]
    groups = Group.from_results(
        [(1, 7), (0, 3), (2, 7)], [[1, 2], [9], [1, 2]], rows, "prompt", results, decode
    )
    assert decoded == [[[4, 4]]]  # only the result without texts
    assert [(g.epoch, g.prompt_index, g.size, g.min_version) for g in groups] == [
        (1, 7, 3, 3),
        (0, 3, 1, 2),
        (2, 7, 2, 1),
    ]
    assert groups[0] == Group.of_rollouts(7, 1, _one_by_one())
    assert list(groups[1]) == [
        Rollout(
            3, [9], [4, 4], [-0.3, -0.6], [1, 1], 2, "2+2=", "d2", rows[3], None, "ok", None, "stop"
        )
    ]
    assert groups[2].texts == ["a", "b"] and list(groups[2])[1].finish_reason == "length"
    assert all(g.rewards == [None] * g.size for g in groups[:1])
    # Without a decode (built off the loop, where the tokenizer is not to be used): an
    # error naming the row for a call with a result to decode (``has_texts`` says which to
    # leave to the loop), the same groups for one without.
    assert [r.has_texts for r in results] == [True, False, True]
    with pytest.raises(ValueError, match="row 3 has completions without text"):
        Group.from_results([(1, 7), (0, 3)], [[1, 2], [9]], rows, "prompt", results[:2], None)
    assert Group.from_results(
        [(1, 7), (2, 7)], [[1, 2], [1, 2]], rows, "prompt", results[::2], None
    ) == [groups[0], groups[2]]


def test_a_generation_result_is_its_columns_and_pickles_as_them():
    result = _result(3)
    assert len(result) == 3 and result.has_texts
    assert result == GenerationResult(
        [[5, 2], [7], [8, 9, 4]],
        [[-0.5, -0.25], [-1.5], [-0.1, -0.2, -0.3]],
        ["length", "stop", "length"],
        ["3", "4", "x"],
        3,
    )
    result.weight_apply_s, result.engine_metrics = 0.5, {"generation/forwards": 2.0}
    for back in (pickle.loads(pickle.dumps(result)), copy.deepcopy(result)):
        assert back == result and back is not result
        assert back.engine_metrics == {"generation/forwards": 2.0}
    assert _from_result(7, 1, result) == Group.of_rollouts(7, 1, _one_by_one())
    # One form: no completion objects to set or read (slotted: no new attribute either).
    with pytest.raises(AttributeError):
        result.completions = []
    untexted = GenerationResult.from_columns([[1]], [[-0.1]], ["stop"], None, 0)
    assert untexted.texts is None and not untexted.has_texts
    with pytest.raises(ValueError, match="differ in length"):
        GenerationResult.from_columns([[1], [2]], [[-0.1]], ["stop"], None, 0)
