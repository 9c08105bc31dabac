"""The ``ray`` runtime: executors as Ray actors, same contract as ``process``.

All tests share one local Ray cluster (the session's ``ray_cluster`` fixture); every
RayRuntime here must find it, use it, and leave it running."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from functools import partial
from pathlib import Path

import pytest

from loomrl.config import ConfigError, RayConfig, build_config
from loomrl.job import Job
from loomrl.runtime.base import ExecutorDiedError
from loomrl.runtime.endpoints import MissingEndpointError, endpoint

from conftest import tiny_job_raw

pytestmark = [pytest.mark.ray, pytest.mark.timeout(180)]


class WorkerEndpoints:
    """The interface the test executors are started against."""

    @endpoint
    def record(self, tag: str, sleep_s: float = 0.0) -> list[str]: ...

    @endpoint
    def worker_pid(self) -> int: ...

    @endpoint
    def threads(self) -> int: ...


class Worker:
    """A test executor (built in its actor)."""

    def __init__(self, closed_marker: str | None = None) -> None:
        self.calls: list[str] = []
        self.closed_marker = closed_marker

    def worker_pid(self) -> int:
        return os.getpid()

    def record(self, tag: str, sleep_s: float = 0.0) -> list[str]:
        time.sleep(sleep_s)
        self.calls.append(tag)
        return list(self.calls)

    def threads(self) -> int:
        import torch

        return torch.get_num_threads()

    def fail(self) -> None:
        raise KeyError("no such thing")

    def fail_unpicklable(self) -> None:
        err = ValueError("carries a lock")
        err.lock = threading.Lock()
        raise err

    def close(self) -> None:
        if self.closed_marker:
            Path(self.closed_marker).write_text("closed")


class HalfWorker:
    """Lacks ``worker_pid``, so it does not implement WorkerEndpoints."""

    def record(self, tag: str, sleep_s: float = 0.0) -> list[str]:
        return [tag]


class GlooWorker:
    """Records, when built, the interfaces gloo and NCCL would bind to in its actor."""

    def __init__(self) -> None:
        self.at_build = [os.environ.get(v) for v in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")]

    def seen(self) -> list[str | None]:
        return self.at_build


def broken_factory() -> Worker:
    raise FileNotFoundError("model weights missing")


def run(coro):
    return asyncio.run(coro)


@pytest.fixture
def runtime(ray_cluster):
    from loomrl.runtime.ray import RayRuntime

    rt = RayRuntime(RayConfig(num_cpus={"trainer": 0.5, "generator": 0.5}))
    yield rt
    rt.shutdown()
    assert ray_cluster.is_initialized()  # the session's cluster, not the runtime's to end


def _job_actors(ray, tag: str) -> list[str]:
    return [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith(tag)
    ]


def _wait_no_actors(ray, tag: str, timeout_s: float = 20.0) -> bool:
    """True once no live named actor starts with ``tag`` (ray.kill ends actors asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while _job_actors(ray, tag):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_calls_run_in_an_actor_in_order_and_count_busy_time(runtime, tmp_path):
    marker = tmp_path / "closed"
    handle = runtime.start("generator0", partial(Worker, str(marker)), WorkerEndpoints)

    async def main():
        await runtime.wait_ready()
        slow = asyncio.ensure_future(handle.record("a", sleep_s=0.5))
        await asyncio.sleep(0.05)
        fast = [asyncio.ensure_future(handle.record(tag)) for tag in "bcd"]  # queued behind it
        return (
            await handle.worker_pid(),
            await slow,
            await asyncio.gather(*fast),
            await handle.call("threads"),
        )

    pid, first, rest, threads = run(main())
    assert pid != os.getpid() and handle.pid == pid and threads == 1
    assert handle.where.startswith("Ray actor ") and f"pid {pid} on node " in handle.where
    assert first == ["a"] and rest[-1] == ["a", "b", "c", "d"] and rest[0] == ["a", "b"]
    assert 0.5 <= handle.busy_s < 5.0 and not handle.calls.running()
    with pytest.raises(AttributeError):  # not an endpoint of the interface
        handle.no_such_endpoint  # noqa: B018
    runtime.shutdown()
    assert marker.read_text() == "closed"  # the executor's close() ran in its actor
    assert not handle.alive


def test_typed_calls_their_post_processing_and_replicas_on_actors(runtime):
    """``handle.record.call(..., then=post)`` resolves with ``post(result)`` (on the loop:
    an actor's reply has no thread of its own here); ``Replicas`` routes to the least busy
    actor and fans out to both."""
    from loomrl.runtime.replicas import Replicas

    first, second = (runtime.start(f"generator{i}", Worker, WorkerEndpoints) for i in range(2))
    replicas = Replicas([first, second])

    async def main():
        await runtime.wait_ready()
        posted = await first.record.call("a", then=lambda calls: calls + ["posted"])
        busy = asyncio.ensure_future(first.record("slow", sleep_s=1.0))
        await asyncio.sleep(0.2)
        routed = await replicas.record.route("b")  # the second actor: the first is busy
        await busy
        return posted, routed, await replicas.record.fanout("c")

    posted, routed, fanned = run(main())
    assert posted == ["a", "posted"] and routed == ["b"]
    assert fanned == [["a", "slow", "c"], ["b", "c"]]


def test_remote_exceptions_keep_their_type_and_traceback(runtime):
    handle = runtime.start("generator0", Worker)
    with pytest.raises(KeyError, match="no such thing") as info:
        run(handle.call("fail"))
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "raised in executor 'generator0' (Ray actor " in notes and "in fail" in notes
    with pytest.raises(RuntimeError, match="ValueError: carries a lock"):
        run(handle.call("fail_unpicklable"))
    with pytest.raises(AttributeError):
        run(handle.call("no_such_method"))
    assert run(handle.call("record", "still serving")) == ["still serving"]


def test_a_missing_endpoint_fails_the_start(runtime):
    handle = runtime.start("generator0", HalfWorker, WorkerEndpoints)
    with pytest.raises(
        MissingEndpointError,
        match="HalfWorker does not implement WorkerEndpoints: no method 'threads', 'worker_pid'",
    ):
        run(runtime.wait_ready())
    with pytest.raises(MissingEndpointError):
        run(handle.record("x"))


def test_a_factory_that_fails_is_reported_with_the_remote_traceback(runtime):
    handle = runtime.start("trainer", broken_factory)
    with pytest.raises(FileNotFoundError, match="model weights missing") as info:
        run(runtime.wait_ready())
    assert "in broken_factory" in "\n".join(info.value.__notes__)
    with pytest.raises(FileNotFoundError):
        run(handle.call("worker_pid"))


def test_a_killed_actor_fails_its_calls_and_restart_gives_a_fresh_executor(runtime, ray_cluster):
    handle = runtime.start("generator0", Worker, WorkerEndpoints)
    run(handle.record("before"))
    pid = handle.pid

    async def main():
        pending = asyncio.ensure_future(handle.record("x", sleep_s=30))
        await asyncio.sleep(0.3)
        os.kill(pid, signal.SIGKILL)
        return await pending

    t0 = time.monotonic()
    with pytest.raises(
        ExecutorDiedError,
        match=r"executor 'generator0' \(Ray actor \w+ pid \d+ on node .*\) died: .+",
    ):
        run(main())
    assert time.monotonic() - t0 < 20  # reported when it died, not after the call's 30 s
    assert not handle.alive
    with pytest.raises(ExecutorDiedError):
        run(handle.worker_pid())
    fresh = runtime.restart(handle)
    assert fresh is not handle and fresh.name == "generator0" and runtime.handles == [fresh]
    assert run(fresh.record("after")) == ["after"]  # a fresh object: none of the old state
    assert fresh.pid not in (None, pid)


def test_kill_ends_the_actor_and_its_pending_call(runtime):
    handle = runtime.start("scorer0", Worker)
    run(runtime.wait_ready())

    async def main():
        pending = asyncio.ensure_future(handle.call("record", "x", sleep_s=30))
        await asyncio.sleep(0.3)
        handle.kill()
        return await pending

    with pytest.raises(ExecutorDiedError, match="'scorer0'"):
        run(main())
    assert not handle.alive


def test_shutdown_leaves_no_actor_of_the_job(ray_cluster):
    from loomrl.runtime.ray import RayRuntime

    rt = RayRuntime(
        RayConfig(num_cpus={"generator": 0.5}, placement="pack"),
        executor_names=["generator0", "generator1"],
    )
    try:
        handles = [rt.start(f"generator{i}", Worker) for i in range(2)]
        assert [run(h.call("record", "x")) for h in handles] == [["x"], ["x"]]
        assert len(_job_actors(ray_cluster, rt.job_tag)) == 2
        with pytest.raises(
            ValueError, match="'trainer' has no bundle in the job's placement group"
        ):
            rt.start("trainer", Worker)
    finally:
        rt.shutdown()
    assert _wait_no_actors(ray_cluster, rt.job_tag)
    assert rt.placement_group is None and ray_cluster.is_initialized()


def test_roles_pick_the_resources():
    from loomrl.runtime.ray import role_of

    config = RayConfig(
        num_cpus={"trainer": 2}, num_gpus={"generator": 0.5}, memory_mb={"scorer": 256}
    )
    # the rest keep defaults
    assert config.num_cpus.generator == 1.0 and config.num_gpus.trainer == 0.0
    assert [role_of(n) for n in ("trainer", "generator12", "scorer0")] == [
        "trainer",
        "generator",
        "scorer",
    ]
    with pytest.raises(ValueError, match="executor name 'critic0' has no known role"):
        role_of("critic0")


def test_config_validation(tmp_path):
    raw = tiny_job_raw(tmp_path, tmp_path / "train.jsonl", runtime="ray")
    cfg = build_config(raw)
    assert (cfg.runtime, cfg.weight_sync.kind, cfg.ray.address) == ("ray", "shm", None)
    with pytest.raises(ConfigError, match="runtime='ray' needs 'shm'"):
        build_config({**raw, "weight_sync": {"transport": "inproc"}})
    for transport in ("files", "torch_dist"):
        assert (
            build_config({**raw, "weight_sync": {"transport": transport}}).weight_sync.kind
            == transport
        )
    with pytest.raises(ConfigError, match="ray.num_cpu: unknown key"):
        build_config({**raw, "ray": {"num_cpu": 2}})
    with pytest.raises(ConfigError, match="ray.num_gpus.critic: unknown key"):
        build_config({**raw, "ray": {"num_gpus": {"critic": 1}}})
    with pytest.raises(ConfigError, match="ray.placement"):
        build_config({**raw, "ray": {"placement": "strict"}})
    with pytest.raises(ConfigError, match="runtime"):
        build_config({**raw, "runtime": "slurm"})


@pytest.mark.timeout(300)
@pytest.mark.parametrize("transport", ["shm", "torch_dist"])
def test_a_tiny_job_runs_to_completion_on_ray(ray_cluster, tiny_job, tmp_path, transport):
    cfg = tiny_job(
        runtime="ray",
        output_dir=str(tmp_path / "run"),
        weight_sync={"transport": transport},
        ray={"num_cpus": {"trainer": 1, "generator": 1}},
    )
    result = Job(cfg).run()
    s = result.summary
    assert s["steps"] == 4 and not s["interrupted"]
    assert s["trained"] == 4 * cfg.algorithm.groups_per_step * cfg.algorithm.group_size
    assert s["generated"] == s["trained"] + s["dropped_stale"] + s["failed"] + s["in_flight"]
    rss = s["peak_rss_mb"]
    assert {"controller", "trainer", "generator0"} <= set(rss) and all(
        50 < mb < 8192 for mb in rss.values()
    )
    assert len(set(rss.values())) == len(rss)  # one process each
    assert (result.run_dir / "final").is_dir()
    # the job's are gone
    assert ray_cluster.is_initialized() and _wait_no_actors(ray_cluster, "loomrl-")


OWN_CLUSTER = """
import asyncio, ray
from loomrl.config import RayConfig
from loomrl.runtime.ray import RayRuntime
assert not ray.is_initialized()
rt = RayRuntime(RayConfig(object_store_mb=100), executor_names=["trainer", "generator0"])
assert rt.owns_cluster and ray.is_initialized()
assert ray.cluster_resources()["CPU"] >= 2  # at least what the planned executors ask for
handle = rt.start("trainer", dict)
print(asyncio.run(handle.call("__len__")))
rt.shutdown()
assert not ray.is_initialized()  # it started the cluster, so it shut it down
print("ok")
"""


@pytest.mark.timeout(120)
def test_a_runtime_that_starts_its_own_cluster_shuts_it_down(tmp_path):
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [str(Path(__file__).parents[1] / "src"), os.environ.get("PYTHONPATH", "")]
        ),
    }
    env.pop("RAY_ADDRESS", None)
    out = subprocess.run(
        [sys.executable, "-c", OWN_CLUSTER],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=110,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["0", "ok"]


def test_an_actor_binds_gloo_to_the_interface_of_its_nodes_address(runtime, ray_cluster):
    """Issue 54, item 3: before its executor is built, an actor with no GLOO_SOCKET_IFNAME
    (NCCL_SOCKET_IFNAME) of its own gets the interface that holds its Ray node's address
    (none for loopback)."""
    import psutil

    from loomrl.runtime.netif import interface_holding

    if os.environ.get("GLOO_SOCKET_IFNAME") or os.environ.get("NCCL_SOCKET_IFNAME"):
        pytest.skip("an interface is set here: actors keep it (tests/test_netif.py)")
    handle = runtime.start("trainer", GlooWorker)
    run(runtime.wait_ready())
    address = ray_cluster.util.get_node_ip_address()  # (the actor's node: this host)
    expected = interface_holding(address, psutil.net_if_addrs())
    assert run(handle.call("seen")) == [expected, expected]
    assert "GLOO_SOCKET_IFNAME" not in os.environ  # the controller's own is left alone
    assert "NCCL_SOCKET_IFNAME" not in os.environ
