"""Typed executor handles: the controller calls ``await trainer.train_step(groups)``; a
misspelt method fails at start-up (an executor that lacks an endpoint) or at once at the
caller (a handle asked for a name its interface does not declare), on both runtimes."""

from __future__ import annotations

import asyncio
import time

import pytest

from loomrl.generation.base import Generator
from loomrl.runtime.base import UnknownEndpointError
from loomrl.runtime.endpoints import MissingEndpointError, endpoint, endpoints_of
from loomrl.runtime.local import LocalRuntime
from loomrl.runtime.process import ProcessRuntime
from loomrl.training.base import TrainerEndpoints
from loomrl.training.executor import TrainerExecutor

pytestmark = pytest.mark.timeout(180)


class Counter:
    """A small interface for the runtime tests."""

    @endpoint
    def add(self, n: int) -> int: ...

    @endpoint(concurrent=True)
    def nap(self, seconds: float) -> float: ...


class GoodCounter:
    def __init__(self) -> None:
        self.total = 0

    def add(self, n: int) -> int:
        self.total += n
        return self.total

    def nap(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds


class MisspeltCounter:
    """``add`` spelt ``ad``: the start must fail, not the first call to it."""

    def ad(self, n: int) -> int:  # pragma: no cover - never called
        return n

    def nap(self, seconds: float) -> float:  # pragma: no cover
        return seconds


def _runtime(kind: str):
    return ProcessRuntime() if kind == "process" else LocalRuntime()


async def _start(runtime, factory, interface):
    handle = runtime.start("counter", factory, interface)
    await runtime.wait_ready()
    return handle


@pytest.mark.parametrize("kind", ["local", "process"])
def test_an_executor_missing_an_endpoint_fails_at_start_up(kind):
    runtime = _runtime(kind)
    try:
        with pytest.raises(
            MissingEndpointError,
            match=r"MisspeltCounter does not implement Counter: no method 'add' \(did you mean 'ad'\?\)",
        ):
            asyncio.run(_start(runtime, MisspeltCounter, Counter))
    finally:
        runtime.shutdown()


@pytest.mark.parametrize("kind", ["local", "process"])
def test_a_handle_has_the_endpoints_as_methods_and_refuses_other_names_at_once(kind):
    runtime = _runtime(kind)
    try:

        async def scenario():
            handle = await _start(runtime, GoodCounter, Counter)
            assert await handle.add(2) == 2 and await handle.add(3) == 5
            assert await handle.call("add", 1) == 6  # by name: checked the same way
            with pytest.raises(
                UnknownEndpointError,
                match="Counter has no endpoint 'addd' \\(did you mean 'add'\\?\\)",
            ):
                handle.addd  # noqa: B018 - fails on lookup, before any call is made
            with pytest.raises(UnknownEndpointError):
                await handle.call("addd", 1)
            with pytest.raises(TypeError, match="Counter.add"):
                await handle.add(1, 2)  # wrong arguments fail here, not in the executor
            assert await handle.add(0) == 6  # none of the refused calls reached the executor

        asyncio.run(scenario())
    finally:
        runtime.shutdown()


def test_concurrent_endpoints_overlap_on_the_local_runtime():
    runtime = LocalRuntime()
    try:

        async def scenario():
            handle = await _start(runtime, GoodCounter, Counter)
            t0 = time.perf_counter()
            await asyncio.gather(*(handle.nap(0.3) for _ in range(4)))
            return time.perf_counter() - t0, handle.concurrent

        elapsed, concurrent = asyncio.run(scenario())
        assert concurrent == {"add": False, "nap": True}
        assert elapsed < 0.9  # four 0.3 s naps at once, not one after another (1.2 s)
    finally:
        runtime.shutdown()


def test_the_job_interfaces_declare_what_the_controller_calls():
    assert {
        "train_step",
        "publish",
        "save_checkpoint",
        "load_state_dict",
        "save_pretrained",
        "offload",
        "restore",
    } <= set(endpoints_of(TrainerEndpoints))
    assert {"generate", "apply_weights", "update_weights", "offload", "restore"} <= set(
        endpoints_of(Generator)
    )
    assert issubclass(TrainerExecutor, TrainerEndpoints)


def test_controller_and_session_call_only_declared_endpoints():
    """Every ``<handle>.<method>(`` the controller and session await is an endpoint, so a
    typo in them fails this test (and at once at run time), not deep in a job. Calls made
    inside a scheduler lease are passed as ``lambda: handle.method(...)`` or as the bound
    method itself (``on_device("weight_sync", trainer.publish)``): those count too, and so
    does the method named in ``handle.call_then(post, "method", ...)``."""
    import ast

    from conftest import ROOT

    declared = set(endpoints_of(TrainerEndpoints)) | set(endpoints_of(Generator))
    handles = {"trainer", "generator", "generators"}
    called = set()
    for name in ("controller.py", "session/run.py", "session/assembly.py"):
        tree = ast.parse((ROOT / "src/loomrl" / name).read_text())
        for node in ast.walk(tree):
            funcs = []
            if isinstance(node, ast.Await) and isinstance(node.value, ast.Call):
                funcs.append((node.value.func, node.value))
            elif isinstance(node, ast.Lambda) and isinstance(node.body, ast.Call):
                funcs.append((node.body.func, node.body))
            elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "on_device":
                funcs += [(a, None) for a in node.args if isinstance(a, ast.Attribute)]
            for func, call in funcs:
                if isinstance(func, ast.Attribute):
                    owner = func.value
                    if isinstance(owner, ast.Subscript):
                        owner = owner.value
                    owner_name = (
                        owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
                    )
                    if owner_name in handles:
                        if func.attr in ("call", "call_then") and call is not None:
                            names = [a.value for a in call.args if isinstance(a, ast.Constant)]
                            assert len(names) == 1, ast.unparse(node)  # the method, by name
                            called.add(names[0])
                        else:
                            called.add(func.attr)
    assert called and called <= declared, called - declared
    assert {"train_step", "publish", "generate"} <= called


class Recorder:
    def __init__(self) -> None:
        self.ran: list[str] = []

    def work(self, tag: str, seconds: float) -> str:
        time.sleep(seconds)
        self.ran.append(tag)
        return tag


def test_a_local_call_cancelled_before_it_starts_never_runs_and_on_done_still_runs():
    runtime = LocalRuntime()
    handle = runtime.start("w", Recorder)
    done: list[str] = []
    try:

        async def scenario():
            first = handle.submit("work", ("first", 0.3), {}, on_done=lambda: done.append("first"))
            queued = handle.submit(
                "work", ("queued", 0.0), {}, on_done=lambda: done.append("queued")
            )
            queued.cancel()
            failing = handle.submit("work", ("bad", "not seconds"), {})
            assert await first == "first"
            with pytest.raises(TypeError):
                await failing
            return await handle.call("work", "after", 0.0)

        assert asyncio.run(scenario()) == "after"
        assert handle.obj.ran == ["first", "after"] and sorted(done) == ["first", "queued"]
    finally:
        runtime.shutdown()


def test_closing_a_local_executor_cancels_the_calls_still_queued():
    runtime = LocalRuntime()
    handle = runtime.start("w", Recorder)

    async def scenario():
        running = handle.submit("work", ("running", 0.3), {})
        queued = handle.submit("work", ("queued", 0.0), {})
        await asyncio.sleep(0.05)
        await asyncio.get_running_loop().run_in_executor(None, runtime.shutdown)
        assert await running == "running"
        await asyncio.wait({queued}, timeout=5)
        assert queued.cancelled()

    asyncio.run(scenario())
    assert handle.obj.ran == ["running"]
