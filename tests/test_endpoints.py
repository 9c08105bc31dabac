"""Typed executor handles: the controller calls ``await trainer.train_step(groups)``; a
misspelt method fails at start-up (an executor that lacks an endpoint) or at once at the
caller (a handle asked for a name its interface does not declare), on both runtimes."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

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


# ``handle.generate.call(...)``, ``scorers.score.route(...)``
VARIANTS = ("call", "route", "fanout")
# the replica group's own methods (runtime/replicas.py), not endpoints of its members
GROUP_METHODS = ("least_busy",)


def _endpoint_called(func: Any, handles: set[str]) -> str | None:
    """The endpoint ``func`` names on one of ``handles``: ``trainer.publish``,
    ``generator.generate.call``, ``self.generators[0].generate``; else None."""
    import ast

    if not isinstance(func, ast.Attribute):
        return None
    owner, name = func.value, func.attr
    if name in VARIANTS and isinstance(owner, ast.Attribute):
        owner, name = owner.value, owner.attr
    if isinstance(owner, ast.Subscript):
        owner = owner.value
    owner_name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
    return name if owner_name in handles else None


def test_controller_and_session_call_only_declared_endpoints_and_none_by_name():
    """Every endpoint of a handle the controller and session call (``trainer.train_step``,
    ``generator.generate.call``, or a bound endpoint passed to a lease:
    ``on_device("weight_sync", trainer.publish)``) is declared, so a typo fails this test
    (and at once at run time), not deep in a job; and none is called by name
    (``handle.call("generate", ...)``)."""
    import ast

    from conftest import ROOT

    declared = set(endpoints_of(TrainerEndpoints)) | set(endpoints_of(Generator))
    handles = {"trainer", "generator", "generators"}
    called = set()
    src = ROOT / "src/loomrl"
    paths = [*sorted((src / "session").glob("*.py")), *sorted((src / "control").glob("*.py"))]
    for path in filter(Path.exists, paths):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            funcs = [node.func]
            if getattr(node.func, "attr", "") == "on_device":  # a bound endpoint, called there
                funcs += [a for a in node.args if isinstance(a, ast.Attribute)]
            for func in funcs:
                name = _endpoint_called(func, handles)
                by_name = name in ("call", "call_then", "submit")
                assert not by_name, f"{path.name}: {ast.unparse(node)} names its method by a string"
                if name is not None and name not in (*VARIANTS, *GROUP_METHODS):
                    called.add(name)
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


class Thenful:
    @endpoint
    def add(self, n: int, then: int = 0) -> int: ...


def test_an_interface_whose_endpoint_takes_then_is_refused_at_start_up():
    """``then`` is the keyword of a call's post-processing: an endpoint parameter of that
    name would be shadowed, so the start fails and names it."""
    runtime = LocalRuntime()
    try:
        with pytest.raises(TypeError, match="Thenful.add takes a parameter 'then'"):
            runtime.start("counter", GoodCounter, Thenful)
    finally:
        runtime.shutdown()


@pytest.mark.parametrize("supervised", [False, True])
def test_replicas_route_to_the_least_busy_and_fan_out_to_all(supervised):
    from loomrl.runtime.replicas import Replicas
    from loomrl.runtime.supervision import FaultStats, Supervised

    runtime = LocalRuntime()
    try:

        async def scenario():
            handles = [await _start(runtime, GoodCounter, Counter) for _ in range(3)]
            members = (
                [Supervised(None, h, None, FaultStats()) for h in handles]
                if supervised
                else handles
            )
            replicas = Replicas(members)
            with pytest.raises(UnknownEndpointError, match="did you mean 'add'"):
                replicas.addd  # noqa: B018 - fails on lookup, on every replica's interface
            napping = asyncio.ensure_future(replicas[0].nap(0.3))  # replica 0 is busy
            await asyncio.sleep(0.05)
            assert replicas.least_busy() is members[1]
            assert await replicas.add.route(5) == 5  # on replica 1 (0 is busy, 1 comes first)
            assert await replicas.add.route(2, then=lambda total: -total) == -7  # on replica 1
            assert [h.obj.total for h in handles] == [0, 7, 0]
            assert await replicas.add.fanout(1) == [1, 8, 1]
            assert await replicas.add.fanout(1, then=str) == ["2", "9", "2"]
            await napping
            with pytest.raises(TypeError, match="Counter.add"):
                await replicas.add.fanout(1, 2)  # checked before anything is sent
            return [h.obj.total for h in handles]

        assert asyncio.run(scenario()) == [2, 9, 2]
    finally:
        runtime.shutdown()
