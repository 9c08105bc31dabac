"""Colocated generators and trainer on one device (``generation.colocate``): the two sides
take turns, each offloaded while the other computes; a colocated job trains exactly as the
same job without colocation."""

from __future__ import annotations

import asyncio

import pytest

from loomrl.config import build_config
from loomrl.device.colocate import ColocatedPhases
from loomrl.job import Job
from loomrl.runtime.supervision import ExecutorLostError, was_replaced
from loomrl.telemetry.metrics import read_metrics
from tests.conftest import tiny_job_raw


class FakeExecutor:
    """An executor handle whose offload/restore are recorded into a shared log."""

    def __init__(self, name: str, log: list, on_device: set) -> None:
        self.name, self.log, self.on_device = name, log, on_device

    async def offload(self) -> float:
        await asyncio.sleep(0.001)
        self.log.append(("offload", self.name))
        self.on_device.discard(self.name)
        return 0.5

    async def restore(self) -> float:
        await asyncio.sleep(0.001)
        self.log.append(("restore", self.name))
        self.on_device.add(self.name)
        return 0.25


def _phases(num_generators: int = 2):
    log: list = []
    on_device = {"trainer", *(f"gen{i}" for i in range(num_generators))}  # as loaded
    trainer = FakeExecutor("trainer", log, on_device)
    gens = [FakeExecutor(f"gen{i}", log, on_device) for i in range(num_generators)]
    return ColocatedPhases(trainer, gens, replaced=was_replaced), log, on_device


def test_the_sides_take_turns_and_only_the_side_computing_is_on_the_device():
    phases, log, on_device = _phases()
    running = {"generate": 0, "train": 0}
    overlaps = []

    async def phase(name: str, seconds: float):
        side = "generate" if name == "generate" else "train"

        async def call():
            running[side] += 1
            other = "train" if side == "generate" else "generate"
            overlaps.append(running[other])
            want = {"trainer"} if side == "train" else {"gen0", "gen1"}
            assert on_device == want, (name, on_device)
            await asyncio.sleep(seconds)
            running[side] -= 1
            return name

        return await phases.run(name, call)

    async def main():
        async def generation_loop(k):
            for _ in range(6):
                await phase("generate", 0.002 * (k + 1))

        async def training_loop():
            for _ in range(4):
                await asyncio.sleep(0.003)
                await phase("train", 0.004)
                await phase("weight_sync", 0.001)

        await asyncio.gather(generation_loop(0), generation_loop(1), training_loop())

    asyncio.run(main())
    assert overlaps and max(overlaps) == 0  # no phase ever ran beside the other side's
    switches = phases.metrics()["colocate/switches"]
    assert switches >= 8  # each of the 4 train turns was entered and left at least once
    # every switch offloaded one side and restored the other: never both on the device
    assert sum(1 for op, _ in log if op == "offload") >= switches
    m = phases.metrics()
    assert m["colocate/offload_s"] > 0 and m["colocate/restore_s"] > 0


def test_two_generators_generate_at_the_same_time():
    phases, _, _ = _phases()
    inside, most = [0], [0]

    async def call():
        inside[0] += 1
        most[0] = max(most[0], inside[0])
        await asyncio.sleep(0.01)
        inside[0] -= 1

    async def main():
        await asyncio.gather(*(phases.run("generate", call) for _ in range(3)))

    asyncio.run(main())
    assert most[0] == 3  # one side's phases overlap; only the sides alternate
    assert phases.metrics()["colocate/switches"] == 1  # the trainer left once, at the start


def test_a_waiting_trainer_is_not_starved_by_generation_loops():
    phases, _, _ = _phases(num_generators=1)
    events: list[str] = []

    async def generation_loop(stop: asyncio.Event):
        async def call():
            events.append("generate")
            await asyncio.sleep(0.001)

        while not stop.is_set():
            await phases.run("generate", call)

    async def main():
        stop = asyncio.Event()
        loops = [asyncio.create_task(generation_loop(stop)) for _ in range(2)]
        await asyncio.sleep(0.01)

        async def train():
            events.append("train")

        async def request_train():  # the request and the phase's entry in one step
            events.append("train requested")
            await phases.run("train", train)

        await asyncio.wait_for(request_train(), timeout=2.0)
        stop.set()
        await asyncio.gather(*loops)

    asyncio.run(main())
    between = events[events.index("train requested") + 1 : events.index("train")]
    assert between == []  # no generate phase started once the trainer asked for its turn


def test_a_phase_cancelled_while_waiting_leaves_the_turns_working():
    phases, _, _ = _phases(num_generators=1)

    async def main():
        release = asyncio.Event()
        generating = asyncio.create_task(phases.run("generate", release.wait))
        await asyncio.sleep(0.01)
        waiting = asyncio.create_task(phases.run("train", lambda: asyncio.sleep(0)))
        await asyncio.sleep(0.01)
        waiting.cancel()
        release.set()
        await generating
        with pytest.raises(asyncio.CancelledError):
            await waiting
        # both sides still get their turns
        await asyncio.wait_for(phases.run("train", lambda: asyncio.sleep(0)), 1.0)
        await asyncio.wait_for(phases.run("generate", lambda: asyncio.sleep(0)), 1.0)

    asyncio.run(main())


def test_a_failed_offload_fails_the_phase_and_the_next_one_moves_both_sides():
    phases, log, on_device = _phases(num_generators=1)
    gen = phases.handles["generate"][0]
    real_offload, calls = gen.offload, [0]

    async def flaky_offload():
        calls[0] += 1
        if calls[0] == 1:  # the first: when the trainer takes its first turn
            raise RuntimeError("offload failed")
        return await real_offload()

    gen.offload = flaky_offload

    async def main():
        await phases.run("generate", lambda: asyncio.sleep(0))  # trainer leaves (first switch)
        with pytest.raises(RuntimeError, match="offload failed"):
            await phases.run("train", lambda: asyncio.sleep(0))
        assert phases.holder is None
        await phases.run("train", lambda: asyncio.sleep(0))
        assert on_device == {"trainer"}

    asyncio.run(main())


def test_an_executor_lost_and_replaced_has_nothing_to_move():
    phases, _, _ = _phases(num_generators=1)

    async def lost():
        raise ExecutorLostError("generator0 died", "generator", restarted=True)

    phases.handles["generate"][0].offload = lost

    async def main():
        await phases.run("generate", lambda: asyncio.sleep(0))
        await phases.run("train", lambda: asyncio.sleep(0))  # no error: the fresh one is empty

    asyncio.run(main())


def test_an_executor_lost_and_not_replaced_fails_the_phase():
    phases, _, _ = _phases(num_generators=1)

    async def lost():
        raise ExecutorLostError("generator0 died", "generator", restarted=False)

    phases.handles["generate"][0].offload = lost

    async def main():
        await phases.run("generate", lambda: asyncio.sleep(0))
        with pytest.raises(ExecutorLostError, match="generator0 died"):
            await phases.run("train", lambda: asyncio.sleep(0))

    asyncio.run(main())


def test_colocate_refuses_what_it_cannot_share(tmp_path, tiny_data):
    train, evals = tiny_data

    def build(**sections):
        return build_config(tiny_job_raw(tmp_path, train, evals, **sections))

    with pytest.raises(ValueError, match="scheduler.url"):
        build(generation={"colocate": True}, scheduler={"url": "http://127.0.0.1:1"})
    with pytest.raises(ValueError, match="prefetch"):
        build(generation={"colocate": True}, weight_sync={"prefetch": True})
    with pytest.raises(ValueError, match="parallel.type='single'"):
        build(
            generation={"colocate": True},
            runtime="process",
            trainer={"parallel": {"type": "fsdp2", "dp_shard": 2}},
        )


def _losses(run_dir):
    return [
        (r["train/loss"], r["train/grad_norm"], r["rollout/reward_mean"])
        for r in read_metrics(run_dir)
        if "train/loss" in r
    ]


@pytest.mark.parametrize("runtime", ["local", "process"])
def test_a_colocated_sync_job_trains_exactly_as_without_colocation(tiny_job, tmp_path, runtime):
    sync = {"algorithm": {"max_staleness": 0}, "task": {"reward": "test_job:length_reward"}}
    plain = Job(tiny_job(**sync, runtime=runtime, output_dir=str(tmp_path / "plain"))).run()
    shared = Job(
        tiny_job(
            **sync,
            runtime=runtime,
            output_dir=str(tmp_path / "colocated"),
            generation={"colocate": True, "max_new_tokens": 3, "prompts_per_request": 2},
        )
    ).run()
    assert len(_losses(plain.run_dir)) == 4
    assert _losses(shared.run_dir) == _losses(plain.run_dir)  # offload/restore are bit for bit
    last = [r for r in read_metrics(shared.run_dir) if "colocate/switches" in r][-1]
    # the trainer's turn at least once a step, and the generators' between steps
    assert last["colocate/switches"] >= 2 * 4
    assert last["colocate/offload_s"] > 0 and last["colocate/restore_s"] > 0
    assert shared.summary["trained"] == plain.summary["trained"]


def test_a_colocated_async_job_completes_with_its_accounting_exact(tiny_job, tmp_path):
    result = Job(
        tiny_job(
            output_dir=str(tmp_path / "async"),
            generation={"colocate": True, "max_new_tokens": 3, "prompts_per_request": 2},
            trainer={"num_steps": 6},
        )
    ).run()
    s = result.summary
    assert s["steps"] == 6 and s["trained"] == 6 * 4 * 4
    assert s["generated"] == s["trained"] + s["dropped_stale"] + s["failed"] + s["in_flight"]
    assert s["prompts_trained_twice"] == 0
    last = [r for r in read_metrics(result.run_dir) if "colocate/switches" in r][-1]
    assert last["colocate/switches"] >= 2 * 6
