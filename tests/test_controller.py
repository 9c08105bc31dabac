"""The controller with fake executors: the staleness bound under randomized timings, the
accounting identity, stale drops, and failure handling of reward functions."""

from __future__ import annotations

import asyncio
import logging
import math
import random
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loomrl.control import Controller
from loomrl.control.buffer import RolloutBuffer, StalenessGate
from loomrl.data import PromptStream, load_rows
from loomrl.generation.base import Generator
from loomrl.models import build_char_tokenizer
from loomrl.runtime.local import LocalRuntime
from loomrl.scoring.client import JobFailedError, Scorer
from loomrl.telemetry.metrics import MetricsLogger, read_metrics
from loomrl.training.base import PublishAfterStepError, TrainerEndpoints
from loomrl.types import GenerationResult, Group, Rollout
from loomrl.weights.receiver import WeightsApplied


class Published:
    def __init__(self) -> None:
        self.version = -1
        self.lock = threading.Lock()


class FakeGenerator(Generator):
    """Applies the latest published version before each request, like the real engine."""

    def __init__(self, published: Published, delays: list[float], seed: int) -> None:
        self.published, self.delays, self.rng = published, delays, random.Random(seed)
        self.calls = 0

    def apply_weights(self, min_version=0):
        with self.published.lock:
            return WeightsApplied(self.published.version)

    def update_weights(self, update):  # pragma: no cover - weights come by the fake's lock
        raise NotImplementedError

    def load_weights(self, weights):  # pragma: no cover
        raise NotImplementedError

    def generate(self, requests, apply_newest=False):
        with self.published.lock:
            version = self.published.version
        time.sleep(self.delays[self.calls % len(self.delays)])
        self.calls += 1
        digits = [c for c in range(5, 15)]
        results = []
        for r in requests:
            ids = [[self.rng.choice(digits) for _ in range(2)] for _ in range(r.num_samples)]
            results.append(
                GenerationResult.from_columns(
                    ids, [[-1.0, -1.0] for _ in ids], ["length"] * len(ids), None, version
                )
            )
        return results


class FakeTrainer(TrainerEndpoints):
    def __init__(self, published: Published, delays: list[float]) -> None:
        self.published, self.delays = published, delays
        self.version = 0
        self.staleness: list[int] = []

    def train_step(self, groups, publish=False):
        self.staleness.extend(self.version - g.min_version for g in groups)
        time.sleep(self.delays[self.version % len(self.delays)])
        self.version += 1
        return {"train/loss": 0.0, **(self.publish() if publish else {})}

    def publish(self, full=False):
        with self.published.lock:
            self.published.version = self.version
        return {}

    def state_dict(self):
        return {"version": self.version}

    def load_state_dict(self, state):
        self.version = state["version"]

    def save_checkpoint(self, root, step, extra, keep):  # pragma: no cover - no checkpoints here
        raise NotImplementedError

    def save_pretrained(self, path):  # pragma: no cover
        raise NotImplementedError


def run_fake(cfg, tmp_path, gen_delays, train_delays, reward_path=None, trainer_cls=None):
    if reward_path:
        cfg.task.reward = reward_path
    runtime = LocalRuntime()
    published = Published()
    trainer_cls = trainer_cls or FakeTrainer
    trainer = runtime.start(
        "trainer", lambda: trainer_cls(published, train_delays), TrainerEndpoints
    )
    gens = [
        runtime.start(f"g{i}", lambda i=i: FakeGenerator(published, gen_delays, i), Generator)
        for i in range(cfg.generation.num_generators)
    ]
    rows = load_rows(cfg.data.train)
    metrics = MetricsLogger(tmp_path, tensorboard=False)
    ctl = Controller(
        cfg,
        trainer=trainer,
        generators=gens,
        scorer=Scorer(cfg.task),
        tokenizer=build_char_tokenizer(),
        train_rows=rows,
        eval_rows=[],
        stream=PromptStream(len(rows), 0),
        metrics=metrics,
    )
    run_fake.last = ctl  # (for a test whose run raises)
    try:
        summary = asyncio.run(ctl.run())
    finally:
        metrics.close()
        runtime.shutdown()
    return ctl, trainer.obj, summary


class PublishFailsAtStep3(FakeTrainer):
    def train_step(self, groups, publish=False):
        if self.version + 1 < 3:
            return super().train_step(groups, publish)
        super().train_step(groups)
        raise PublishAfterStepError(
            "step 3 was trained but publishing it failed: OSError: disk full"
        )


def test_a_step_whose_fused_publish_fails_is_counted_before_the_job_fails(tiny_job, tmp_path):
    cfg = tiny_job(
        algorithm={"max_staleness": 1, "groups_per_step": 2, "group_size": 2},
        trainer={"num_steps": 6},
    )
    with pytest.raises(PublishAfterStepError, match="disk full"):
        run_fake(cfg, tmp_path, [0.0], [0.0], trainer_cls=PublishFailsAtStep3)
    ctl = run_fake.last
    # the controller is at the trainer's version (a checkpoint now would match), and the
    # step's rollouts count as trained, not in flight
    assert ctl.version == 3 and ctl.published_version == 2
    c = ctl.counters
    assert (
        c.trained == 3 * 2 * 2
        and c.generated == c.trained + c.dropped_stale + c.failed + ctl.in_flight
    )


class RecordingTrainer(FakeTrainer):
    def train_step(self, groups, publish=False):
        self.groups = getattr(self, "groups", []) + list(groups)
        return super().train_step(groups, publish)


class RecordingGenerator(FakeGenerator):
    def generate(self, requests, apply_newest=False):
        with self.published.lock:
            self.asked = getattr(self, "asked", []) + [(apply_newest, self.published.version)]
        results = super().generate(requests)
        for r in results:
            r.texts = ["t" + "".join(map(str, ids)) for ids in r.token_ids]
            r.finish_reasons = ["stop"] * len(r)
        return results


def test_trained_rollouts_carry_what_the_generator_and_the_dataset_gave(tiny_job, tmp_path):
    """The controller builds rollouts positionally (speed): each field lands where it belongs."""
    cfg = tiny_job(
        algorithm={"max_staleness": 1, "groups_per_step": 2, "group_size": 3},
        trainer={"num_steps": 3},
    )
    import test_controller as me

    real = me.FakeGenerator
    me.FakeGenerator = RecordingGenerator
    try:
        ctl, trainer, _ = run_fake(cfg, tmp_path, [0.0], [0.0], trainer_cls=RecordingTrainer)
    finally:
        me.FakeGenerator = real
    rows = load_rows(cfg.data.train)
    tok = build_char_tokenizer()
    assert len(trainer.groups) == 3 * 2
    for group in trainer.groups:
        assert group.size == 3
        for r in group:
            assert r.prompt_index == group.prompt_index and r.row == rows[r.prompt_index]
            assert (
                r.prompt == rows[r.prompt_index]["prompt"]
                and r.prompt_ids == tok(r.prompt).input_ids
            )
            assert (
                r.completion == "t" + "".join(map(str, r.completion_ids))
                and len(r.completion_ids) == 2
            )
            assert r.behaviour_logprobs == [-1.0, -1.0] and r.loss_mask == [1, 1]
            assert r.finish_reason == "stop" and r.status == "ok" and r.error is None
            assert r.reward is not None and 0 <= r.version <= 3 and r.num_turns == 1


def test_a_generator_behind_the_published_version_applies_it_in_its_generate_call(
    tiny_job, tmp_path
):
    cfg = tiny_job(
        algorithm={"max_staleness": 0, "groups_per_step": 2, "group_size": 2},
        generation={"prompts_per_request": 2},
        trainer={"num_steps": 4},
    )
    import test_controller as me

    real = me.FakeGenerator
    me.FakeGenerator = RecordingGenerator
    try:
        ctl, _, _ = run_fake(cfg, tmp_path, [0.0], [0.0])
    finally:
        me.FakeGenerator = real
    asked = ctl.generators[0].obj.asked
    # synchronous: every training request comes after a new version, so each one asks for
    # it; none finds the generator already up to date
    training = asked[: cfg.trainer.num_steps]
    assert [a for a, _ in training] == [True] * cfg.trainer.num_steps
    assert [v for _, v in training] == list(range(cfg.trainer.num_steps))


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    max_staleness=st.integers(0, 3),
    num_generators=st.integers(1, 2),
    per_request=st.integers(1, 3),
    gen_delays=st.lists(st.floats(0, 0.004), min_size=1, max_size=5),
    train_delays=st.lists(st.floats(0, 0.004), min_size=1, max_size=5),
)
def test_staleness_bound_and_accounting_hold_under_random_timings(
    tiny_job, tmp_path, max_staleness, num_generators, per_request, gen_delays, train_delays
):
    cfg = tiny_job(
        algorithm={"max_staleness": max_staleness, "groups_per_step": 3, "group_size": 2},
        generation={"num_generators": num_generators, "prompts_per_request": per_request},
        trainer={"num_steps": 8},
    )
    ctl, trainer, summary = run_fake(cfg, tmp_path, gen_delays, train_delays)
    assert len(trainer.staleness) == 8 * 3
    assert max(trainer.staleness) <= max_staleness
    if max_staleness == 0:
        assert set(trainer.staleness) == {0}
    c = ctl.counters
    assert c.generated == c.trained + c.dropped_stale + c.failed + ctl.in_flight
    assert c.trained == 8 * 3 * 2


def test_buffer_drops_stale_groups_and_counts_them():
    def group(index, version):
        r = Rollout(index, [1], [5], [-1.0], [1], version, reward=1.0)
        return Group.of_rollouts(index, 0, [r, r])

    async def scenario():
        buf = RolloutBuffer(max_staleness=1)
        dropped = []

        async def on_drop(g):
            dropped.append(g.prompt_index)

        for i, v in enumerate([0, 2, 1, 3, 2]):
            await buf.put_many([group(i, v)])
        batch = await buf.take(3, version=3, on_drop=on_drop)
        return dropped, [g.prompt_index for g in batch.groups], batch.staleness

    dropped, taken, staleness = asyncio.run(scenario())
    assert dropped == [0, 2]  # versions 0 and 1 are more than 1 behind version 3
    assert taken == [1, 3, 4] and staleness == [1, 0, 1]


def test_a_requests_groups_enter_the_buffer_and_leave_the_gate_together():
    def group(index):
        return Group.of_rollouts(index, 0, [Rollout(index, [1], [5], [-1.0], [1], 0, reward=1.0)])

    async def scenario():
        gate, buf = (
            StalenessGate(max_staleness=0, groups_per_step=4),
            RolloutBuffer(max_staleness=0),
        )
        started = await gate.acquire(4)
        take = asyncio.create_task(buf.take(3, version=0, on_drop=None))
        await asyncio.sleep(0)  # the trainer waits for its batch
        # one request's groups (one failed: 3 of 4)
        await buf.put_many([group(2), group(0), group(1)])
        await gate.finish_many(4, accepted=3)
        batch = await take
        return (
            started,
            gate.running,
            gate.accepted,
            gate.capacity(),
            [g.prompt_index for g in batch.groups],
        )

    assert asyncio.run(scenario()) == (4, 0, 3, 1, [0, 1, 2])


def test_the_gate_wakes_a_waiting_generator_when_a_place_frees_and_a_stop_ends_a_waiting_take():
    async def scenario():
        gate, buf = (
            StalenessGate(max_staleness=0, groups_per_step=2),
            RolloutBuffer(max_staleness=0),
        )
        await gate.acquire(2)
        waiting = asyncio.create_task(gate.acquire(2))
        await gate.finish_many(2, accepted=2)  # all accepted: no place frees until the step
        for _ in range(3):
            await asyncio.sleep(0)
        blocked = not waiting.done()
        await gate.set_version(1)  # the step opens two places
        started = await asyncio.wait_for(waiting, 1.0)
        take = asyncio.create_task(buf.take(2, version=1, on_drop=None))
        await asyncio.sleep(0)
        buf.interrupt()  # Ctrl-C while the trainer waits for a batch that will not come
        return blocked, started, await asyncio.wait_for(take, 1.0)

    assert asyncio.run(scenario()) == (True, 2, None)


def test_prompt_stream_hands_out_each_prompt_once_per_epoch_and_resumes():
    stream = PromptStream(10, seed=3)
    got = [stream.next() for _ in range(6)]
    for epoch, i in got[:4]:
        stream.mark_trained(epoch, i)
    stream.requeue(*got[4])  # dropped stale: comes back first
    assert stream.next() == got[4]
    resumed = PromptStream(10, seed=3)
    resumed.load_state_dict(stream.state_dict())
    rest = [resumed.next()[1] for _ in range(6)]
    assert sorted(rest + [i for _, i in got[:4]]) == list(range(10))  # nothing lost, nothing twice
    assert resumed.next()[0] == 1  # then the next epoch


def raising_reward(prompt, completion, **row):
    raise RuntimeError("reward backend down")


def nan_reward(prompt, completion, **row):
    # (None would mean "not applicable", a reward of 0.0: TRL's rule)
    return math.nan if len(completion) % 2 else math.inf


def sometimes_hangs(prompt, completion, answer, **row):
    if completion.endswith(("1", "3")):
        time.sleep(1.5)
    return 0.5


async def async_reward(prompt, completion, **row):
    await asyncio.sleep(0)
    return 1.0


def test_prompts_handed_out_and_marked_in_batches_follow_one_at_a_time():
    """``next_many`` and ``mark_trained_many`` (one call a request, one a step) give the
    same order and state as ``next`` and ``mark_trained``, across epochs and requeues."""
    one, many = PromptStream(7, seed=3), PromptStream(7, seed=3)
    for n in (3, 2, 4, 5, 1, 6):
        singles = [one.next() for _ in range(n)]
        assert many.next_many(n) == singles
        one.requeue(*singles[0])
        many.requeue(*singles[0])
        for pick in singles[1:]:
            one.mark_trained(*pick)
        many.mark_trained_many(singles[1:])
        assert (one.epoch, one.trained, one.trained_twice, one.state_dict()) == (
            many.epoch,
            many.trained,
            many.trained_twice,
            many.state_dict(),
        )
        assert one._outstanding == many._outstanding and list(one._pending) == list(many._pending)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 1), st.integers(0, 5)), max_size=12),
    st.lists(st.integers(0, 5), max_size=4),
)
def test_marking_a_steps_prompts_at_once_counts_as_marking_them_one_by_one(picks, before):
    """``mark_trained_many`` (sets at C speed) against the rule it stands for, applied one
    pick at a time: a pick of another epoch is ignored; an index trained before in this
    epoch, or earlier in the same call, counts as trained twice."""
    stream = PromptStream(6, seed=1)
    stream.epoch = 1
    stream.trained, stream._trained_set, stream._outstanding = list(before), set(before), {0, 2, 4}
    trained, seen, twice, outstanding = list(before), set(before), 0, {0, 2, 4}
    for epoch, index in picks:
        if epoch == 1:
            outstanding.discard(index)
            twice += index in seen
            seen.add(index)
            trained.append(index)
    stream.mark_trained_many(picks)
    assert (stream.trained, stream._trained_set, stream.trained_twice, stream._outstanding) == (
        trained,
        seen,
        twice,
        outstanding,
    )


def test_the_buffer_keeps_its_rollout_count_and_each_batch_its_group_sizes():
    """``num_rollouts`` is kept as groups come and go (no pass over the buffer a step), and
    a batch carries its groups' sizes in its own (sorted) order."""

    def group(index, version, size):
        return Group.of_rollouts(
            index,
            0,
            [Rollout(index, [1], [5], [-1.0], [1], version, reward=1.0) for _ in range(size)],
        )

    async def scenario():
        buf = RolloutBuffer(max_staleness=1)
        counts = []
        for i, (v, n) in enumerate([(2, 3), (0, 2), (3, 1), (2, 4), (3, 5)]):
            await buf.put_many([group(i, v, n)])
            counts.append(buf.num_rollouts)
        # drops the version-0 group
        batch = await buf.take(2, version=3, on_drop=lambda g: asyncio.sleep(0))
        counts.append(buf.num_rollouts)
        rest = await buf.take(2, version=3, on_drop=None)
        return counts, batch, rest, buf.num_rollouts

    counts, batch, rest, left = asyncio.run(scenario())
    assert counts == [3, 5, 6, 10, 15, 15 - 2 - 3 - 1]
    assert [g.prompt_index for g in batch.groups] == [0, 2] and batch.sizes == [3, 1]
    assert [g.prompt_index for g in rest.groups] == [3, 4] and rest.sizes == [4, 5] and left == 0
    assert all(g.size == n for b in (batch, rest) for g, n in zip(b.groups, b.sizes))


@pytest.mark.parametrize("reward,reason", [("raising_reward", "raised"), ("nan_reward", "invalid")])
def test_failing_reward_marks_rollouts_failed_and_stops_job_clearly(
    tiny_job, tmp_path, reward, reason
):
    cfg = tiny_job(task={"reward": f"test_controller:{reward}", "max_failure_rate": 0.5})
    with pytest.raises(JobFailedError, match=r"rollouts failed scoring .*max_failure_rate=0.5"):
        run_fake(cfg, tmp_path, [0.0], [0.0])


def test_hanging_reward_times_out_and_is_counted_without_stopping(tiny_job, tmp_path):
    cfg = tiny_job(
        task={
            "reward": "test_controller:sometimes_hangs",
            "reward_timeout_s": 0.2,
            "max_failure_rate": 0.9,
        },
        trainer={"num_steps": 3},
    )
    ctl, trainer, summary = run_fake(cfg, tmp_path, [0.0], [0.0])
    assert ctl.counters.failed > 0
    assert ctl.scorer.failures_by_reason["timeout"] == ctl.counters.failed
    assert 0 < ctl.counters.trained < 3 * 4 * 4  # groups lose their timed-out rollouts
    c = ctl.counters
    assert c.generated == c.trained + c.dropped_stale + c.failed + ctl.in_flight
    records = [r for r in read_metrics(tmp_path) if "train/loss" in r]
    seen = [r.get("rollout/failed_timeout", 0) for r in records]
    # (counted before the step that lost them)
    assert seen == sorted(seen) and 1 <= seen[-1] <= ctl.counters.failed
    # The step record's failures by reason: a new count or reason shows at once.
    ctl.scorer.failures_by_reason["timeout"] += 2
    ctl.scorer.failures_by_reason["raised"] += 1
    assert ctl.step_record.failed_metrics() == {
        "rollout/failed_timeout": ctl.counters.failed + 2,
        "rollout/failed_raised": 1,
    }


def test_async_reward_functions_are_awaited(tiny_job, tmp_path):
    cfg = tiny_job(task={"reward": "test_controller:async_reward"}, trainer={"num_steps": 2})
    ctl, trainer, summary = run_fake(cfg, tmp_path, [0.0], [0.0])
    assert ctl.counters.failed == 0 and ctl.counters.trained == 2 * 4 * 4


def test_a_call_past_stall_warning_s_is_logged_once_and_counted(tiny_job, tmp_path, caplog):
    cfg = tiny_job(stall_warning_s=0.3, trainer={"num_steps": 3})
    with caplog.at_level(logging.WARNING, logger="loomrl.control.watchdog"):
        ctl, trainer, summary = run_fake(cfg, tmp_path, [0.0, 0.0, 1.2], [0.0])  # one slow generate
    stalls = [r.getMessage() for r in caplog.records if "past stall_warning_s" in r.getMessage()]
    # once per slow call, however long it runs
    assert len(stalls) == ctl.watchdog.stall_warnings >= 1
    assert all(
        m.startswith("g0 (a thread of pid ") and "'generate' has run for" in m for m in stalls
    )
    records = [r for r in read_metrics(tmp_path) if "executor/stall_warnings" in r]
    assert records[-1]["executor/stall_warnings"] == ctl.watchdog.stall_warnings
    quiet = tiny_job(trainer={"num_steps": 3})  # the default (300 s) stays quiet
    (tmp_path / "quiet").mkdir()
    assert (
        run_fake(quiet, tmp_path / "quiet", [0.0, 0.0, 1.2], [0.0])[0].watchdog.stall_warnings == 0
    )


def test_prompt_ids_stay_right_when_the_cache_of_them_is_full(monkeypatch):
    import loomrl.control.prompts as prompts_module
    from loomrl.config import DataConfig
    from loomrl.control.prompts import PromptCache

    monkeypatch.setattr(prompts_module, "PROMPT_CACHE_ROWS", 3)

    class Tok:
        bos_token_id = 1

        def __call__(self, texts):
            class Out:
                input_ids = [[1, len(t)] for t in texts]

            return Out()

    rows = [{"prompt": "x" * (i + 1)} for i in range(10)]
    cache = PromptCache(Tok(), DataConfig(train="t.jsonl"), "m", rows, None)
    assert not cache.complete and not cache.ids  # too many rows to encode at the start
    for picks in ([0, 1], [1, 2], [3, 4], [4, 5, 6]):
        ids = cache.of_rows(picks)
        assert all(ids[i] == [1, i + 1] for i in picks)
        assert len(cache.ids) <= 3


def test_rollouts_and_results_pickle_and_copy_field_for_field():
    """They cross process boundaries every step, pickled by their fields (not dataclasses'
    slower getstate): every field, in order, must come back."""
    import copy
    import pickle

    row = {"prompt": "1+2=", "answer": "3"}
    rollout = Rollout(
        7,
        [1, 2],
        [5, 2],
        [-0.5, -0.25],
        [1, 0],
        3,
        "1+2=",
        "3",
        row,
        1.0,
        "failed",
        "boom",
        "length",
        2,
        {"episode_s": 0.5},
    )
    result = GenerationResult([[5, 2]], [[-0.5, -0.25]], ["length"], ["3"], 3, 0.25, {"a": 1.0})
    for thing in (rollout, result, Group.of_rollouts(7, 1, [rollout])):
        for back in (pickle.loads(pickle.dumps(thing, protocol=5)), copy.deepcopy(thing)):
            assert type(back) is type(thing) and back == thing and back is not thing
    shallow = copy.copy(rollout)
    assert shallow == rollout and shallow.row is rollout.row
    twins = pickle.loads(pickle.dumps([rollout, rollout]))
    assert twins[0] is twins[1]  # (memoized: a group's shared row and prompt pickle once)
