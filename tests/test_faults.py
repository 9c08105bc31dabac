"""Self-healing: deadlines, restarts and re-queues (loomrl.runtime.supervision), and whole
jobs that lose a generator, a scorer or the trainer mid-run and still complete."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import time

import pytest

from loomrl.job import Job
from loomrl.runtime.base import ExecutorDiedError, ExecutorHandle, Runtime
from loomrl.runtime.supervision import (
    Deadlines,
    ExecutorLostError,
    FaultStats,
    RestartLimitError,
    Supervised,
    TrainerLostError,
)
from loomrl.runtime.threads import CallTracker
from loomrl.telemetry.metrics import read_metrics

pytestmark = pytest.mark.timeout(240)


# -- the supervision logic, with fake executors -----------------------------------------


class FakeHandle(ExecutorHandle):
    """An executor whose calls sleep ``delay`` s; ``die()`` makes its calls fail as a
    killed process's do."""

    def __init__(self, name: str, factory=None, delay: float = 0.0) -> None:
        self.name, self.factory, self.delay = name, factory, delay
        self.calls, self.dead, self.killed = CallTracker(), False, False
        self._one_at_a_time = None

    async def _invoke(self, method, args, kwargs):
        self._one_at_a_time = self._one_at_a_time or asyncio.Lock()
        async with self._one_at_a_time:  # as a process or an actor runs its calls
            await asyncio.sleep(kwargs.get("seconds", self.delay))
            if self.dead:
                raise ExecutorDiedError(f"executor {self.name!r} killed by SIGKILL")
            if method == "fail":
                raise TimeoutError("the executor's own timeout")
            return (method, args)

    @property
    def busy_s(self) -> float:
        return 1.0

    @property
    def alive(self) -> bool:
        return not self.dead

    def kill(self) -> None:
        self.killed = self.dead = True


class FakeRuntime(Runtime):
    def __init__(self) -> None:
        self.handles, self.started = [], 0

    def start(self, name, factory, interface=None):
        self.started += 1
        handle = FakeHandle(name, factory)
        self.handles.append(handle)
        return handle

    def shutdown(self) -> None:
        self.handles.clear()


def _slot(runtime, handle, stats=None, **kwargs):
    deadlines = Deadlines(factor=10.0, min_s=0.2, first_s=0.5, calls=2)
    return Supervised(runtime, handle, deadlines, stats or FaultStats(), **kwargs)


def _slot_over(handle):
    """A supervised slot over ``handle`` (made outside the runtime); its runtime and stats."""
    runtime, stats = FakeRuntime(), FaultStats()
    runtime.handles.append(handle)
    return runtime, handle, stats, _slot(runtime, handle, stats)


def test_deadlines_start_generous_then_follow_the_longest_call():
    d = Deadlines(factor=10.0, min_s=1.0, first_s=100.0, calls=3)
    assert d.limit("generator", "generate") == 100.0
    for seconds in (0.05, 0.3, 0.1):
        d.observe("generator", "generate", seconds)
    assert d.limit("generator", "generate") == pytest.approx(3.0)  # 10 x the longest
    assert d.limit("generator", "apply_weights") == 100.0  # per method
    d.observe("trainer", "train_step", 0.01)
    assert d.limit("trainer", "train_step") == 100.0  # per role, and too few calls yet
    for _ in range(3):
        d.observe("scorer", "score", 0.001)
    assert d.limit("scorer", "score") == 1.0  # never under min_s


def test_a_dead_executor_is_restarted_once_and_its_lost_calls_raise():
    runtime = FakeRuntime()
    old = runtime.start("generator0", factory=lambda: None)
    stats, refreshed = FaultStats(), []

    async def on_restart(slot):  # runs before calls reach the fresh executor
        refreshed.append(slot.incarnation)

    slot = _slot(runtime, old, stats, on_restart=on_restart)

    async def main():
        assert await slot.generate([1]) == ("generate", ([1],))
        old.dead = True
        lost = await asyncio.gather(slot.generate([2]), slot.generate([3]), return_exceptions=True)
        assert all(isinstance(e, ExecutorLostError) and e.restarted for e in lost)
        return await slot.generate([4])

    assert asyncio.run(main()) == ("generate", ([4],))
    assert (
        runtime.started == 2
        and slot.handle is not old
        and refreshed == [0]
        and slot.incarnation == 1
    )
    # two calls lost, one restart
    assert stats.failures["generator"] == 1 and stats.restarts["generator"] == 1
    assert slot.busy_s == 2.0  # both incarnations' busy time
    assert slot.handle.name == "generator0"


def test_a_heal_cancelled_mid_restart_counts_its_loss_once():
    # The run's teardown cancels a generation loop while its call heals the generator (the
    # fresh one still loading); the final evaluation then finds the old one dead and heals
    # again: one loss, counted once (seen on two Ray nodes: generator_failures 2 for one kill).
    runtime = FakeRuntime()
    old = runtime.start("generator0", factory=lambda: None)
    stats, loading = FaultStats(), asyncio.Event()

    async def on_restart(slot):  # the fresh executor is brought up to date: slow
        loading.set()
        await asyncio.sleep(30)

    slot = _slot(runtime, old, stats, on_restart=on_restart)

    async def main():
        assert await slot.generate([1]) == ("generate", ([1],))
        old.dead = True
        first = asyncio.ensure_future(slot.generate([2]))
        await loading.wait()
        first.cancel()  # mid-restart
        await asyncio.gather(first, return_exceptions=True)
        slot.on_restart = None
        with pytest.raises(ExecutorLostError) as lost:
            await slot.generate([3])  # finds it dead again: heals it, this time to the end
        assert lost.value.restarted
        return await slot.generate([4])

    assert asyncio.run(main()) == ("generate", ([4],))
    assert stats.failures["generator"] == 1, stats.failures
    assert stats.restarts["generator"] == 1, stats.restarts


def test_a_hung_call_is_killed_at_its_deadline_and_replaced():
    runtime, hung, stats, slot = _slot_over(FakeHandle("scorer0", factory=lambda: None, delay=30.0))

    async def main():
        with pytest.raises(ExecutorLostError, match="ran past its deadline of 0.5 s"):
            await slot.score([])
        return await slot.score([])

    assert asyncio.run(main()) == ("score", ([],))
    assert hung.killed and stats.hung_kills == 1 and stats.restarts["scorer"] == 1


def test_the_deadline_check_survives_a_closed_loop_and_a_cancelled_caller_leaves_its_call_running():
    runtime, handle, stats, slot = _slot_over(
        FakeHandle("generator0", factory=lambda: None, delay=0.0)
    )

    async def quick():  # ends long before the check it armed (0.5 s) fires: that loop closes armed
        return await slot.generate([0])

    assert asyncio.run(quick()) == ("generate", ([0],))

    async def cancel_then_hang():
        waiting = asyncio.ensure_future(slot.generate([1], seconds=0.3))
        await asyncio.sleep(0.05)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        # the cancelled call still runs (0.3 s): the next one waits behind it, uncounted, and
        # then runs past its own deadline (0.5 s) on this new loop, where it is caught
        with pytest.raises(ExecutorLostError, match="ran past its deadline of 0.5 s"):
            await slot.generate([2], seconds=30.0)

    t0 = time.monotonic()
    asyncio.run(cancel_then_hang())
    assert time.monotonic() - t0 < 5.0
    assert handle.killed and stats.hung_kills == 1 and runtime.started == 1


def test_waiting_behind_other_calls_does_not_count_against_a_deadline():
    runtime = FakeRuntime()
    stats = FaultStats()
    slot = _slot(runtime, runtime.start("generator0", factory=lambda: None), stats)
    slot.deadlines = Deadlines(factor=10.0, min_s=0.4, first_s=0.4, calls=1)

    async def main():
        # six 0.3 s calls queued at once: the last waits 1.5 s, each runs 0.3 s (< 0.4 s)
        return await asyncio.gather(*(slot.generate([i], seconds=0.3) for i in range(6)))

    assert [r[1] for r in asyncio.run(main())] == [([i],) for i in range(6)]
    assert stats.hung_kills == 0 and runtime.started == 1


def test_an_executors_own_timeout_error_is_its_error_not_a_hang():
    runtime = FakeRuntime()
    stats = FaultStats()
    slot = _slot(runtime, runtime.start("generator0", factory=lambda: None), stats)
    with pytest.raises(TimeoutError, match="the executor's own timeout"):
        asyncio.run(slot.fail())
    assert stats.hung_kills == 0 and stats.failures["generator"] == 0 and runtime.started == 1


def test_deadlines_are_kept_per_batch_size():
    from loomrl.runtime.supervision import call_key

    assert call_key("generate", ([0] * 8,)) == call_key("generate", ([0] * 15,))
    assert call_key("generate", ([0] * 8,)) != call_key("generate", ([0] * 200,))
    d = Deadlines(factor=10.0, min_s=1.0, first_s=100.0, calls=1)
    d.observe("generator", call_key("generate", ([0] * 8,)), 0.5)
    assert d.limit("generator", call_key("generate", ([0] * 8,))) == 5.0
    # eval's big batch: its own
    assert d.limit("generator", call_key("generate", ([0] * 200,))) == 100.0
    # checkpoint I/O: warned about, never killed
    assert d.limit("trainer", "save_checkpoint") is None


def test_restarts_stop_at_the_limit():
    runtime = FakeRuntime()
    stats = FaultStats(max_executor_restarts=1)
    slot = _slot(runtime, runtime.start("generator0", factory=lambda: None), stats)

    async def main():
        slot.handle.dead = True
        with pytest.raises(ExecutorLostError):
            await slot.generate([])
        slot.handle.dead = True
        with pytest.raises(RestartLimitError, match="max_executor_restarts=1"):
            await slot.generate([])

    asyncio.run(main())
    assert stats.restarts["generator"] == 1 and stats.failures["generator"] == 2


def test_fault_metrics_show_every_change_though_they_are_cached():
    stats = FaultStats()
    first = stats.metrics()
    assert first["executor/restarts"] == 0 and first["executor/trainer_failures"] == 0
    first["executor/restarts"] = 99  # (a copy: the caller may change it)
    assert stats.metrics()["executor/restarts"] == 0
    for change, key, value in [
        (lambda: stats.failures.update(["scorer"]), "executor/scorer_failures", 1),
        (lambda: stats.restarts.update(["scorer"]), "executor/restarts", 1),
        (lambda: stats.restarts.update(["judge"]), "executor/judge_restarts", 1),
        (lambda: setattr(stats, "hung_kills", 2), "executor/hung_kills", 2),
        (lambda: setattr(stats, "requeued_prompts", 3), "executor/requeued_prompts", 3),
        (lambda: setattr(stats, "rescored_rollouts", 4), "executor/rescored_rollouts", 4),
        (lambda: setattr(stats, "lost_rollouts", 5), "executor/lost_rollouts", 5),
        (lambda: setattr(stats, "trainer_restarts", 6), "executor/trainer_restarts", 6),
    ]:
        change()
        assert stats.metrics()[key] == value, key
    assert stats.metrics()["executor/restarts"] == 2 and stats.metrics() == stats._build_metrics()


def test_a_lost_trainer_is_not_restarted_in_place():
    runtime = FakeRuntime()
    stats = FaultStats()
    trainer = runtime.start("trainer", factory=lambda: None)
    slot = _slot(runtime, trainer, stats, restart=False)

    async def main():
        trainer.dead = True
        with pytest.raises(TrainerLostError) as first:
            await slot.train_step([])
        with pytest.raises(TrainerLostError):  # later calls fail at once, counted once
            await slot.save_checkpoint("x", 1, {}, 1)
        return first.value

    err = asyncio.run(main())
    assert not err.restarted and runtime.started == 1 and trainer.killed
    assert stats.failures["trainer"] == 1 and stats.total_restarts == 0


# -- whole jobs on the process runtime ------------------------------------------------


RUNTIMES = ["process", pytest.param("ray", marks=pytest.mark.ray)]


def _executor_pid(runtime: str, name: str) -> int:
    """The pid of executor ``name`` of the running job (a child process, or a Ray actor's
    worker process on this machine)."""
    if runtime == "process":
        (proc,) = [p for p in multiprocessing.active_children() if p.name == f"loomrl-{name}"]
        return proc.pid
    import ray

    (actor,) = [
        a for a in ray.util.list_named_actors(all_namespaces=True) if f"-{name}-" in a["name"]
    ]
    handle = ray.get_actor(actor["name"], namespace=actor["namespace"])
    status, (_, where), _, _ = ray.get(handle.ready.remote(), timeout=60)
    return where["pid"]


@pytest.fixture(params=RUNTIMES)
def runtime(request):
    """Each job test on ``process`` and (marked ``ray``, on the session's cluster) ``ray``."""
    if request.param == "ray":
        request.getfixturevalue("ray_cluster")
    return request.param


def _fault_job(tiny_job, tmp_path, runtime, weight_sync=None, **faults):
    # Sync rewards on one scorer, 8 steps, a checkpoint every 2; short deadlines so that a
    # stopped executor is found in seconds. Delta weight sync with no periodic full: a
    # restarted generator has only the full snapshot published for it.
    return tiny_job(
        runtime=runtime,
        trainer={"num_steps": 8},
        checkpoint={"every_steps": 2},
        faults={"min_deadline_s": 3.0, "deadline_factor": 10.0, **faults},
        weight_sync={"codec": "delta", "full_every": 1000, **(weight_sync or {})},
        output_dir=str(tmp_path / "run"),
    )


def _kill_at(step: int, runtime: str, name: str, sig: int = signal.SIGKILL):
    done = []

    def on_record(record):
        if record.get("step") == step and "train/loss" in record and not done:
            done.append(_executor_pid(runtime, name))
            os.kill(done[0], sig)

    return on_record, done


def _assert_complete_and_accounted(result, cfg):
    s = result.summary
    assert s["steps"] == cfg.trainer.num_steps and not s.get("job_failed")
    assert s["generated"] == s["trained"] + s["dropped_stale"] + s["failed"] + s["in_flight"]
    assert (
        s["trained"]
        == cfg.trainer.num_steps * cfg.algorithm.groups_per_step * cfg.algorithm.group_size
    )
    assert s["prompts_trained_twice"] == 0
    assert not multiprocessing.active_children()  # (on ray: the tests' cluster keeps its workers)
    return s["faults"]


@pytest.mark.parametrize("name", ["generator0", "scorer0"])
def test_a_killed_generator_or_scorer_is_replaced_and_the_job_completes(
    tiny_job, tmp_path, runtime, name
):
    cfg = _fault_job(tiny_job, tmp_path, runtime)
    on_record, killed = _kill_at(3, runtime, name)
    result = Job(cfg).run(on_record=on_record)
    assert killed
    faults = _assert_complete_and_accounted(result, cfg)
    role = name.rstrip("0")
    assert faults[f"executor/{role}_failures"] == 1 and faults[f"executor/{role}_restarts"] == 1
    assert faults["executor/trainer_failures"] == 0 and faults["executor/trainer_restarts"] == 0
    train_records = [r for r in read_metrics(result.run_dir) if "train/loss" in r]
    fulls = train_records[-1]["weight_sync/num_fulls"]
    if role == "generator":  # its next call was lost: its prompts went out again, once
        assert faults["executor/requeued_prompts"] > 0
        assert fulls == 2  # the first publish, and one for the fresh generator
    else:
        assert fulls == 1
    if role == "scorer":
        assert faults["executor/rescored_rollouts"] > 0 and faults["executor/lost_rollouts"] == 0
    records = read_metrics(result.run_dir)
    assert [r["step"] for r in records if "train/loss" in r] == list(range(1, 9))
    assert [r for r in records if "train/loss" in r][-1]["executor/restarts"] == 1


def test_a_generator_that_stops_answering_is_replaced_after_its_deadline(
    tiny_job, tmp_path, runtime
):
    cfg = _fault_job(tiny_job, tmp_path, runtime)
    # alive, but never answers
    on_record, stopped = _kill_at(3, runtime, "generator0", signal.SIGSTOP)
    result = Job(cfg).run(on_record=on_record)
    assert stopped
    faults = _assert_complete_and_accounted(result, cfg)
    assert faults["executor/hung_kills"] == 1 and faults["executor/generator_restarts"] == 1
    # the stopped process was killed, not left behind (Ray reaps it a bit later)
    for _ in range(100):
        try:
            os.kill(stopped[0], 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the stopped generator (pid {stopped[0]}) is still there")


def test_a_killed_trainer_restarts_the_job_from_its_checkpoint(tiny_job, tmp_path, runtime, caplog):
    cfg = _fault_job(tiny_job, tmp_path, runtime)
    on_record, killed = _kill_at(5, runtime, "trainer")  # checkpoints at 2 and 4
    with caplog.at_level("WARNING"):
        result = Job(cfg).run(on_record=on_record)
    assert killed
    faults = _assert_complete_and_accounted(result, cfg)
    assert faults["executor/trainer_restarts"] == 1 and faults["executor/trainer_failures"] == 1
    assert "restarting the job from step_000004" in caplog.text and "'trainer'" in caplog.text
    records = read_metrics(result.run_dir)
    assert [r for r in records if r.get("event") == "resume"][0]["resume/from_step"] == 4
    # 5 ran again, once
    assert [r["step"] for r in records if "train/loss" in r] == list(range(1, 9))


def test_a_killed_torch_dist_generator_restarts_the_job_from_its_checkpoint(
    tiny_job, tmp_path, runtime, caplog
):
    # A member of a torch_dist weight group cannot be replaced alone (a fresh process cannot
    # join the group): whichever call finds the loss first (the trainer's broadcast, reset by
    # its dead peer, or the generator's own call), the job restarts from its newest
    # checkpoint, the step trained before the loss kept (checkpointed first), and completes.
    cfg = _fault_job(tiny_job, tmp_path, runtime, weight_sync={"transport": "torch_dist"})
    on_record, killed = _kill_at(3, runtime, "generator0")
    with caplog.at_level("WARNING"):
        result = Job(cfg).run(on_record=on_record)
    assert killed
    faults = _assert_complete_and_accounted(result, cfg)
    assert faults["executor/trainer_restarts"] == 1, faults
    # found by the trainer's broadcast, the generator's own call, or both (a race)
    found = faults["executor/weight_group_failures"] + faults["executor/generator_failures"]
    assert found >= 1, faults
    assert "restarting the job from step_" in caplog.text
    records = read_metrics(result.run_dir)
    resumed = [r for r in records if r.get("event") == "resume"]
    assert len(resumed) == 1 and resumed[0]["resume/from_step"] >= 2
    # every step once, in order; a step whose publish failed was trained and checkpointed
    # before the restart, so its record alone may be missing (the job resumes after it)
    steps = [r["step"] for r in records if "train/loss" in r]
    assert steps == sorted(set(steps))
    assert set(range(1, 9)) - set(steps) <= {resumed[0]["resume/from_step"]}


def test_the_job_stops_when_it_may_not_restart(tiny_job, tmp_path):
    cfg = _fault_job(tiny_job, tmp_path, "process", max_restarts=0)
    on_record, _ = _kill_at(3, "process", "trainer")
    with pytest.raises(TrainerLostError, match="'trainer'.*killed by SIGKILL"):
        Job(cfg).run(on_record=on_record)
    assert not multiprocessing.active_children()


def test_the_stream_counts_a_prompt_trained_twice_in_one_epoch():
    from loomrl.data import PromptStream

    stream = PromptStream(4, seed=0)
    epoch, index = stream.next()
    stream.mark_trained(epoch, index)
    assert stream.trained_twice == 0
    stream.mark_trained(epoch, index)  # what a re-queue bug would do
    assert stream.trained_twice == 1
