"""The ``process`` runtime: executors in spawned processes, same contract as ``local``."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import signal
import threading
import time
from functools import partial
from pathlib import Path

import pytest

from loomrl.config import ConfigError, build_config
from loomrl.job import Job, resume_job
from loomrl.runtime.endpoints import endpoint
from loomrl.runtime.process import ExecutorDiedError, ProcessRuntime, RemoteError
from loomrl.runtime.supervision import RestartLimitError
from loomrl.telemetry.metrics import read_metrics

from conftest import tiny_job_raw

pytestmark = pytest.mark.timeout(180)


class Worker:
    """A picklable executor for the runtime tests (built in the child process)."""

    def __init__(self, closed_marker: str | None = None) -> None:
        self.calls: list[str] = []
        self.closed_marker = closed_marker

    def pid(self) -> int:
        return os.getpid()

    def record(self, tag: str, sleep_s: float = 0.0) -> list[str]:
        time.sleep(sleep_s)
        self.calls.append(tag)
        return list(self.calls)

    def warn(self, text: str) -> None:
        logging.getLogger("loomrl.test_worker").warning("worker says %s", text)

    def fail(self) -> None:
        raise KeyError("no such thing")

    def fail_unpicklable(self) -> None:
        err = ValueError("carries a lock")
        err.lock = threading.Lock()  # exceptions holding unpicklable state still arrive
        raise err

    def close(self) -> None:
        if self.closed_marker:
            Path(self.closed_marker).write_text("closed")


def broken_factory() -> Worker:
    raise FileNotFoundError("model weights missing")


def run(coro):
    return asyncio.run(coro)


def test_calls_run_in_a_separate_process_in_order_and_count_busy_time(tmp_path):
    runtime = ProcessRuntime()
    marker = tmp_path / "closed"
    try:
        handle = runtime.start("w", partial(Worker, str(marker)))

        async def main():
            await runtime.wait_ready()
            slow = asyncio.ensure_future(handle.call("record", "a", sleep_s=0.5))
            deadline = time.monotonic() + 10
            while not handle.calls.running() and time.monotonic() < deadline:
                await asyncio.sleep(0.01)  # until the slow call is under way
            fast = asyncio.ensure_future(handle.call("record", "b"))  # queued behind it
            await asyncio.sleep(0.05)
            running = [method for _, method, _ in handle.calls.running()]
            return await handle.call("pid"), await slow, await fast, running

        pid, first, second, running = run(main())
        assert running == ["record"]  # the stall watchdog sees the slow call, not the queued one
        assert handle.where == f"pid {pid}" and not handle.calls.running()
        assert pid != os.getpid() and pid == handle.process.pid
        assert first == ["a"] and second == ["a", "b"]
        assert 0.5 <= handle.busy_s < 5.0
    finally:
        runtime.shutdown()
    assert marker.read_text() == "closed"  # the executor's close() ran in its process
    assert not handle.process.is_alive()


def test_executor_logs_reach_the_controllers_handlers(caplog):
    runtime = ProcessRuntime()
    try:
        handle = runtime.start("w", Worker)
        with caplog.at_level(logging.INFO):
            run(handle.call("warn", "hello"))
            runtime.shutdown()  # flushes the executors' records
    finally:
        runtime.shutdown()
    records = [r for r in caplog.records if r.name == "loomrl.test_worker"]
    assert [r.getMessage() for r in records] == ["[w] worker says hello"]
    assert records[0].levelno == logging.WARNING and records[0].process == handle.process.pid


def test_remote_exceptions_keep_their_type_and_traceback():
    runtime = ProcessRuntime()
    try:
        handle = runtime.start("w", Worker)
        with pytest.raises(KeyError, match="no such thing") as info:
            run(handle.call("fail"))
        notes = "\n".join(getattr(info.value, "__notes__", []))
        assert "raised in executor 'w'" in notes and "in fail" in notes
        with pytest.raises(RemoteError, match="ValueError: carries a lock"):
            run(handle.call("fail_unpicklable"))
        with pytest.raises(AttributeError):
            run(handle.call("no_such_method"))
        assert run(handle.call("record", "still serving")) == ["still serving"]
    finally:
        runtime.shutdown()


def test_a_factory_that_fails_is_reported_on_the_first_call():
    runtime = ProcessRuntime()
    try:
        handle = runtime.start("w", broken_factory)
        with pytest.raises(FileNotFoundError, match="model weights missing"):
            run(runtime.wait_ready())
        with pytest.raises(FileNotFoundError):
            run(handle.call("pid"))
    finally:
        runtime.shutdown()


def test_calls_to_a_closed_or_failed_handle_fail_through_submit_too():
    """``submit`` (the future ``Supervised`` watches) reports what ``call`` does: a start
    that failed raises its own error; a closed handle fails with ExecutorDiedError."""
    runtime = ProcessRuntime()
    try:
        broken, closed = runtime.start("b", broken_factory), runtime.start("c", Worker)
        run(closed.call("pid"))
        closed.close()

        async def main():
            with pytest.raises(FileNotFoundError, match="model weights missing"):
                await broken.submit("pid", (), {})
            with pytest.raises(ExecutorDiedError, match="'c' .* was closed"):
                await closed.submit("pid", (), {})

        run(main())
    finally:
        runtime.shutdown()


def test_a_factory_that_cannot_reach_a_process_is_a_clear_error():
    runtime = ProcessRuntime()
    with pytest.raises(TypeError, match="factory of executor 'w' must pickle"):
        runtime.start("w", lambda: Worker())
    assert not runtime.handles and not multiprocessing.active_children()


def test_a_killed_executor_fails_its_calls_with_the_cause():
    runtime = ProcessRuntime()
    try:
        handle = runtime.start("w", Worker)
        pid = run(handle.call("pid"))

        async def main():
            pending = asyncio.ensure_future(handle.call("record", "x", sleep_s=30))
            await asyncio.sleep(0.3)
            os.kill(pid, signal.SIGKILL)
            return await pending

        t0 = time.monotonic()
        with pytest.raises(ExecutorDiedError, match=r"'w' \(pid \d+\) killed by SIGKILL"):
            run(main())
        assert time.monotonic() - t0 < 10  # reported at once, not after the call's 30 s
        with pytest.raises(ExecutorDiedError):
            run(handle.call("pid"))
    finally:
        runtime.shutdown()


def test_config_picks_a_transport_that_crosses_processes(tmp_path):
    raw = tiny_job_raw(tmp_path, tmp_path / "train.jsonl", runtime="process")
    assert build_config(raw).weight_sync.kind == "shm"  # the default follows the runtime
    job = Job(dataset=str(tmp_path / "train.jsonl"), reward="m:f", runtime="process")
    assert (job.config.runtime, job.config.weight_sync.kind) == ("process", "shm")
    with pytest.raises(ConfigError, match="runtime='process' needs 'shm'"):
        build_config({**raw, "weight_sync": {"transport": "inproc"}})
    with pytest.raises(ConfigError, match="needs one process per executor"):
        build_config({**raw, "runtime": "local", "weight_sync": {"transport": "torch_dist"}})


def _shm_files() -> set[str]:
    return (
        {p.name for p in Path("/dev/shm").glob("loomrl-*")} if Path("/dev/shm").is_dir() else set()
    )


@pytest.mark.parametrize("transport", ["shm", "torch_dist"])
def test_sync_job_gives_the_same_losses_as_the_local_runtime(tiny_job, tmp_path, transport):
    sync = {"algorithm": {"max_staleness": 0}, "task": {"reward": "test_job:length_reward"}}
    shm_before = _shm_files()
    local = Job(tiny_job(**sync, output_dir=str(tmp_path / "local"))).run()
    spawned = Job(
        tiny_job(
            **sync,
            runtime="process",
            output_dir=str(tmp_path / "process"),
            weight_sync={"transport": transport, "codec": "delta"},
        )
    ).run()

    def losses(run_dir):
        return [
            (r["train/loss"], r["train/grad_norm"], r["rollout/reward_mean"])
            for r in read_metrics(run_dir)
            if "train/loss" in r
        ]

    assert len(losses(local.run_dir)) == 4 and losses(local.run_dir)[0][0] != 0.0
    assert losses(spawned.run_dir) == losses(local.run_dir)  # bit-identical at fp32 on CPU
    assert spawned.summary["trained"] == local.summary["trained"]
    # every executor's peak memory, its own process's on `process`, the shared one on `local`
    for result in (local, spawned):
        assert set(result.summary["peak_rss_mb"]) == {
            "controller",
            "trainer",
            "generator0",
            "scorer0",
        }
        assert all(50 < mb < 8192 for mb in result.summary["peak_rss_mb"].values())
        assert 0 < result.summary["controller_overhead"] < 1
    rss = local.summary["peak_rss_mb"]
    assert max(rss.values()) - min(rss.values()) <= 0.01 * max(rss.values())  # one process
    assert len(set(spawned.summary["peak_rss_mb"].values())) > 1  # three processes, three peaks
    assert not multiprocessing.active_children()
    assert _shm_files() <= shm_before  # the channel's files are gone


def test_a_generator_killed_mid_job_is_reported_and_the_job_resumes(tiny_job, tmp_path):
    # No restarts allowed: the job fails (with a checkpoint of what it trained) and resumes.
    cfg = tiny_job(
        runtime="process",
        trainer={"num_steps": 6},
        checkpoint={"every_steps": 2},
        faults={"max_executor_restarts": 0},
        output_dir=str(tmp_path / "run"),
    )

    def kill_generator(record):
        if record.get("step") == 3:
            (gen,) = [p for p in multiprocessing.active_children() if p.name == "loomrl-generator0"]
            os.kill(gen.pid, signal.SIGKILL)

    with pytest.raises(
        RestartLimitError, match="'generator0'.*killed by SIGKILL.*max_executor_restarts=0"
    ):
        Job(cfg).run(on_record=kill_generator)
    assert not multiprocessing.active_children()
    result = resume_job(tmp_path / "run")
    records = [r for r in read_metrics(result.run_dir) if "train/loss" in r]
    assert records[-1]["step"] == 6
    assert result.summary["trained"] == 6 * cfg.algorithm.groups_per_step * cfg.algorithm.group_size


class Recording:
    """``Worker``'s one endpoint, for the tests of typed calls."""

    @endpoint
    def record(self, tag: str, sleep_s: float = 0.0) -> list[str]: ...


def _tagged(loop_thread: int, calls: list[str]) -> tuple[list[str], bool]:
    """A ``post``: the result, and whether it ran off the loop's thread."""
    if calls[-1] == "boom":
        raise ValueError("post failed")
    return calls + ["posted"], threading.get_ident() != loop_thread


@pytest.mark.parametrize("runtime_name", ["local", "process"])
@pytest.mark.parametrize("supervised", [False, True])
def test_a_post_runs_where_the_call_ended_off_the_loop_and_its_value_or_error_is_the_calls(
    runtime_name, supervised
):
    """``post`` (what the controller makes of a result: groups from a generate call,
    rewards into them from a score call) runs on the executor's or the transport's
    thread, not the loop's; the caller gets its value, or its error. A call made before
    the executor was built gets them too (its ``post`` may run on the loop); a call
    without one gets the result."""
    from loomrl.runtime.local import LocalRuntime
    from loomrl.runtime.supervision import Deadlines, FaultStats, Supervised

    runtime = LocalRuntime() if runtime_name == "local" else ProcessRuntime()
    try:
        handle = runtime.start("worker0", Worker, Recording)
        stats = FaultStats()
        target = Supervised(runtime, handle, Deadlines(), stats) if supervised else handle

        async def main():
            post = partial(_tagged, threading.get_ident())
            fresh = runtime.start("worker1", Worker, Recording)  # called before it is built
            assert (await fresh.record.call("x", then=post))[0] == ["x", "posted"]
            with pytest.raises(ValueError, match="post failed"):
                await runtime.start("worker2", Worker, Recording).record.call("boom", then=post)
            await handle.ready()
            assert await target.record.call("a", then=post) == (["a", "posted"], True)
            assert await target.record.call("b") == ["a", "b"]
            with pytest.raises(ValueError, match="post failed"):
                await target.record.call("boom", then=post)
            # the executor lives on
            assert await target.record("c") == ["a", "b", "boom", "c"]
            # (a post's error is no executor's loss)
            assert not stats.failures and not stats.restarts

        run(main())
    finally:
        runtime.shutdown()
