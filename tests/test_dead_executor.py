"""Executors are watched by process, not by pipe (issue 41, finding 7): an executor killed
while a process it forked still holds its pipe open is found dead in seconds, its pending
and later calls fail with the cause, and a whole job replaces a scorer killed that way."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import time

import pytest

from loomrl.job import Job
from loomrl.runtime.process import ExecutorDiedError, ProcessRuntime

pytestmark = pytest.mark.timeout(120)

_HELPERS: list[int] = []  # the forked helpers of this (executor) process


class Forker:
    """An executor whose ``fork_helper`` forks a child that sleeps with every inherited
    file descriptor open (the executor's pipes included), as a reward's helper would."""

    def fork_helper(self, sleep_s: float = 60.0) -> int:
        pid = os.fork()
        if pid == 0:  # the helper: holds the pipes, does nothing
            time.sleep(sleep_s)
            os._exit(0)
        _HELPERS.append(pid)
        return pid

    def pid(self) -> int:
        return os.getpid()

    def sleep(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds


def _kill_quietly(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def test_a_killed_executor_whose_child_holds_the_pipe_is_found_dead_in_seconds():
    runtime = ProcessRuntime()
    handle = runtime.start("w", Forker)
    helper = None
    try:
        pid = asyncio.run(handle.call("pid"))
        helper = asyncio.run(handle.call("fork_helper", 60.0))

        async def main():
            pending = asyncio.ensure_future(handle.call("sleep", 60.0))
            await asyncio.sleep(0.3)
            os.kill(pid, signal.SIGKILL)
            return await pending

        t0 = time.monotonic()
        with pytest.raises(ExecutorDiedError, match=r"'w' \(pid \d+\) killed by SIGKILL"):
            asyncio.run(main())
        assert time.monotonic() - t0 < 5  # the pipe is still open (the helper holds it)
        os.kill(helper, 0)  # (the helper is indeed still there)
        t0 = time.monotonic()
        with pytest.raises(ExecutorDiedError):  # a later call fails at once too
            asyncio.run(handle.call("pid"))
        assert time.monotonic() - t0 < 5
        assert not handle.alive
    finally:
        if helper is not None:
            _kill_quietly(helper)
        t0 = time.monotonic()
        runtime.shutdown()
        assert time.monotonic() - t0 < 10  # closing does not wait for the helper either


def forking_reward(prompt: str, completion: str, answer: str, **row) -> float:
    """exact_match, that forks one helper per scorer process holding its pipes open."""
    if not _HELPERS:
        pid = os.fork()
        if pid == 0:
            # past the call deadline below: only watching the process finds the death
            time.sleep(300)
            os._exit(0)
        _HELPERS.append(pid)
        with open(os.environ["LOOMRL_TEST_HELPERS"], "a") as f:
            f.write(f"{pid}\n")
    return 1.0 if completion.strip() == str(answer) else 0.0


def test_a_scorer_killed_while_its_forked_helper_holds_the_pipe_is_replaced_in_seconds(
    tiny_job, tmp_path, monkeypatch
):
    helpers_file = tmp_path / "helpers"
    monkeypatch.setenv("LOOMRL_TEST_HELPERS", str(helpers_file))
    # Deadlines far longer than the test may take: only watching the process finds the death.
    cfg = tiny_job(
        runtime="process",
        trainer={"num_steps": 4},
        checkpoint={"every_steps": 100},
        task={"reward": "test_dead_executor:forking_reward", "reward_timeout_s": 2.0},
        faults={"min_deadline_s": 120.0, "deadline_factor": 10.0},
    )
    killed = []

    def on_record(record):
        if record.get("step") == 2 and "train/loss" in record and not killed:
            (proc,) = [p for p in multiprocessing.active_children() if p.name == "loomrl-scorer0"]
            killed.append(time.monotonic())
            os.kill(proc.pid, signal.SIGKILL)

    try:
        result = Job(cfg).run(on_record=on_record)
    finally:
        for line in helpers_file.read_text().split() if helpers_file.exists() else []:
            _kill_quietly(int(line))
    assert killed
    assert time.monotonic() - killed[0] < 60  # not the 120 s call deadline (nor the helper's 300 s)
    s = result.summary
    assert s["steps"] == 4 and not s.get("job_failed")
    assert s["generated"] == s["trained"] + s["dropped_stale"] + s["failed"] + s["in_flight"]
    assert (
        s["faults"]["executor/scorer_failures"] == 1
        and s["faults"]["executor/scorer_restarts"] == 1
    )
    assert s["faults"]["executor/hung_kills"] == 0  # found dead, not waited out
