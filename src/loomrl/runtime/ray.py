"""The ``ray`` runtime: every executor is a Ray actor, on this machine or across a cluster.

Same contract as ``process``: calls to one executor run one at a time, in submission
order (a Ray actor with ``max_concurrency=1`` runs the calls of one caller in order);
different executors run in parallel. Each actor asks for the resources of its role (the
executor name's prefix: ``trainer``, ``generator<i>``, ``scorer<i>``; ``[ray]`` in the job),
optionally inside one placement group with a bundle per executor (``placement``).

Calls and results travel through Ray (pickled; large ones through its object store); weights
travel through the job's transport (``torch_dist`` or ``files`` across nodes, ``shm`` on one
node), never through the calls. An exception raised by a method is re-raised in the
controller as itself, with its remote traceback as a note. An actor that dies (its process
killed, out of memory, its node lost, ``kill()``) fails its pending and later calls with
``ExecutorDiedError`` saying how Ray saw it die. Actors are owned by this process: when it
dies, Ray ends them.

``RayRuntime`` uses the Ray this process already initialized, connects to ``address``, or
starts a local cluster; it shuts Ray down at the end only in the last case.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time
import traceback
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import ray
import ray.exceptions

from loomrl.runtime.base import (
    BusyClock,
    CallTracker,
    ExecutorDiedError,
    ExecutorHandle,
    RemoteError,
    Runtime,
)
from loomrl.runtime.base import role_of as base_role
from loomrl.runtime.endpoints import check_implements
from loomrl.safe_text import SafeFormatter
from loomrl.telemetry import trace

if TYPE_CHECKING:
    from loomrl.config import RayConfig

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0  # building an executor loads a model; waiting for resources counts too
PLACEMENT_TIMEOUT_S = 120.0  # a placement group that cannot be placed in this long never will
CLOSE_TIMEOUT_S = 30.0
ROLES = ("trainer", "generator", "scorer")
# Ray errors that mean the actor is gone (or unreachable, which with no restarts is the same)
_DIED = tuple(
    getattr(ray.exceptions, name)
    for name in (
        "RayActorError",
        "ActorUnavailableError",
        "NodeDiedError",
        "WorkerCrashedError",
        "OwnerDiedError",
        "ObjectLostError",
        "LocalRayletDiedError",
    )
    if hasattr(ray.exceptions, name)
)


def role_of(name: str) -> str:
    """``"generator3"`` -> ``"generator"``: the role whose resources an executor gets (a name of no known role is refused)."""
    role = base_role(name)
    if role not in ROLES:
        raise ValueError(
            f"executor name {name!r} has no known role; expected one of {', '.join(ROLES)} (+ index)"
        )
    return role


def _error_reply(err: BaseException, busy_s: float) -> tuple:
    tb = "".join(traceback.format_exception(err))
    try:  # an exception that does not pickle still arrives, as its text
        ray.cloudpickle.dumps(err)
    except Exception:  # noqa: BLE001
        err = RemoteError(f"{type(err).__name__}: {err}")
    return ("error", err, tb, busy_s)


class _ExecutorActor:
    """The actor every executor lives in: builds the object with ``factory`` in its
    constructor and answers ``call(method, args, kwargs)`` with ``(status, value, tb, busy_s)``.
    A factory that raises is remembered and reported by ``ready()`` (as itself), so that the
    controller sees the original error, not Ray's ``ActorDiedError``."""

    def __init__(
        self,
        name: str,
        factory: Callable[[], Any],
        interface: type | None,
        torch_threads: int,
        log_level: int,
    ) -> None:
        root = logging.getLogger()
        handler = logging.StreamHandler()  # Ray forwards the actor's stderr to the driver
        handler.setFormatter(SafeFormatter(f"%(levelname)s [{name}] %(name)s: %(message)s"))
        root.handlers[:] = [handler]
        root.setLevel(log_level)
        trace.configure_from_env(name)
        import torch

        torch.set_num_threads(torch_threads)
        self.obj: Any = None
        self.failure: tuple | None = None
        self.concurrent: dict[str, bool] = {}
        try:  # building is not a call: it does not count as busy time
            self.obj = factory()
            if interface is not None:
                self.concurrent = check_implements(self.obj, interface)
        except BaseException as err:  # noqa: BLE001 - reported by ready()
            self.failure = _error_reply(err, 0.0)

    def ready(self) -> tuple:
        if self.failure is not None:
            return self.failure
        context = ray.get_runtime_context()
        where = {
            "pid": os.getpid(),
            "node_id": context.get_node_id(),
            "actor_id": context.get_actor_id(),
            "ip": ray.util.get_node_ip_address(),
        }
        return ("ok", (self.concurrent, where), None, 0.0)

    def call(self, method: str, args: tuple, kwargs: dict) -> tuple:
        if self.failure is not None:
            return self.failure
        t0 = time.perf_counter()
        try:
            with trace.span(method, "executor"):
                result = getattr(self.obj, method)(*args, **kwargs)
        except BaseException as err:  # noqa: BLE001 - every failure goes back to the caller
            return _error_reply(err, time.perf_counter() - t0)
        return ("ok", result, None, time.perf_counter() - t0)

    def close(self) -> None:
        closer = getattr(self.obj, "close", None)
        if callable(closer):
            closer()


_REMOTE_ACTOR = ray.remote(max_restarts=0, max_task_retries=0)(_ExecutorActor)


def how_it_died(err: BaseException) -> str:
    """Ray's long death notice cut to the sentence that says how the actor died."""
    text = " ".join(str(err).split())
    found = re.search(r"The actor is dead because (.*?)(?: Some common causes|$)", text)
    how = found.group(1) if found else text
    return how if len(how) <= 400 else how[:400] + "..."


class RayHandle(ExecutorHandle):
    def __init__(
        self,
        name: str,
        factory: Callable[[], Any],
        actor_name: str,
        options: dict[str, Any],
        torch_threads: int,
        interface: type | None = None,
    ) -> None:
        self.name, self.factory, self.actor_name = name, factory, actor_name
        self._bind_interface(interface)
        self.calls = CallTracker(self.name)
        self._busy = BusyClock()
        self._dead: ExecutorDiedError | None = None
        self._info: dict[str, Any] = {}
        self.concurrent: dict[str, bool] = {}
        self._driver_node = ray.get_runtime_context().get_node_id()
        self.actor = _REMOTE_ACTOR.options(name=actor_name, max_concurrency=1, **options).remote(
            name, factory, interface, torch_threads, logging.getLogger().getEffectiveLevel()
        )
        # Building the object (loading a model) runs in the background; calls queue behind
        # it, so executors that must meet (a torch_dist group) start together.
        self._ready: Future = Future()
        self.actor.ready.remote().future().add_done_callback(self._on_ready)

    def _on_ready(self, done: Future) -> None:
        """Runs on a Ray thread, which must not call back into Ray (it would deadlock)."""
        try:
            concurrent, info = self._unpack(done)
        except BaseException as err:  # noqa: BLE001 - the start's failure, for wait_ready and calls
            self._ready.set_exception(err)
            return
        self._info, self.concurrent = info, concurrent
        self._ready.set_result(concurrent)

    def _died(self, err: BaseException) -> ExecutorDiedError:
        if self._dead is None:
            self._dead = ExecutorDiedError(
                f"executor {self.name!r} ({self.where}) died: {how_it_died(err)}; its call was lost"
            )
        return self._dead

    def _unpack(self, done: Future) -> Any:
        """A reply, as its value or its raised error."""
        try:
            status, value, tb, busy_s = done.result()
        except (
            ray.exceptions.RayTaskError
        ) as err:  # the reply itself failed (a result that does not pickle)
            raise err.as_instanceof_cause() from None
        except _DIED as err:
            raise self._died(err) from err
        self._busy.add(busy_s)
        if status == "error":
            value.add_note(f"raised in executor {self.name!r} ({self.where}):\n{tb}")
            raise value
        return value

    async def wait_started(self, timeout_s: float = START_TIMEOUT_S) -> dict[str, bool]:
        """The executor's ``{endpoint: concurrent}`` once it is built; its build error else."""
        try:
            return await asyncio.wait_for(
                asyncio.shield(asyncio.wrap_future(self._ready)), timeout_s
            )
        except TimeoutError:
            raise TimeoutError(
                f"executor {self.name!r} did not start within {timeout_s:.0f}s (still loading, or the "
                f"cluster lacks the resources it asks for; free now: {ray.available_resources()})"
            ) from None
        finally:
            if self._ready.done() and self._ready.exception() is not None and self._dead is None:
                self.close()  # a failed start: its actor's resources go back to the cluster

    async def ready(self) -> None:
        """Wait until the executor is built (its model loaded); raises if building failed."""
        await self.wait_started()

    async def _invoke(self, method: str, args: tuple, kwargs: dict) -> Any:
        if self._ready.done() and self._ready.exception() is not None:
            raise self._ready.exception()  # why it never started, not that it was ended since
        if self._dead is not None:
            raise self._dead
        with self.calls.track(method):
            reply = self.actor.call.remote(
                method, args, kwargs
            ).future()  # submitted now: order kept
            await self.wait_started()
            try:
                await asyncio.wrap_future(reply)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - unpacked below, as the executor's error
                pass
            return self._unpack(reply)

    @property
    def busy_s(self) -> float:
        return self._busy.seconds

    @property
    def where(self) -> str:
        if not self._info:
            return f"Ray actor {self.actor_name} (starting)"
        info = self._info
        return f"Ray actor {info['actor_id']} pid {info['pid']} on node {info['ip']}"

    @property
    def pid(self) -> int | None:
        """The actor's process id, where that process is on this host (else None)."""
        if not self._info or self._info["node_id"] != self._driver_node:
            return None
        return self._info["pid"]

    @property
    def alive(self) -> bool:
        return self._dead is None

    def kill(self) -> None:
        """``ray.kill`` the actor: its pending and later calls fail with ``ExecutorDiedError``."""
        ray.kill(self.actor, no_restart=True)
        if self._dead is None:
            self._dead = ExecutorDiedError(f"executor {self.name!r} ({self.where}) was killed")

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Let the executor release what it holds (its ``close()``), then end its actor."""
        started = self._ready.done() and self._ready.exception() is None
        if started and self._dead is None:
            try:
                ray.get(self.actor.close.remote(), timeout=timeout_s)
            except Exception as err:  # noqa: BLE001 - closing must go on; the cause is logged
                logger.warning("executor %r did not close cleanly: %s", self.name, err)
        ray.kill(self.actor, no_restart=True)
        if self._dead is None:
            self._dead = ExecutorDiedError(f"executor {self.name!r} ({self.where}) was closed")


def _connect(config: RayConfig, num_cpus: float) -> bool:
    """Make sure this process is connected to Ray; True if it started the cluster itself
    (and so must shut it down at the end)."""
    if ray.is_initialized():
        return False
    kwargs: dict[str, Any] = {"namespace": config.namespace, "runtime_env": config.runtime_env}
    if config.address is not None or os.environ.get("RAY_ADDRESS"):
        ray.init(address=config.address, **kwargs)
        logger.info(
            "connected to the Ray cluster at %s", config.address or os.environ["RAY_ADDRESS"]
        )
        return False
    object_store = config.object_store_mb << 20 if config.object_store_mb else None
    ray.init(
        address="local",
        num_cpus=max(os.cpu_count() or 1, num_cpus),
        object_store_memory=object_store,
        include_dashboard=False,
        **kwargs,
    )  # ("local": a new cluster, never a found one)
    logger.info("started a local Ray cluster for this job")
    return True


class RayRuntime(Runtime):
    """Executors as Ray actors. ``executor_names`` are the executors the job will start: a
    local cluster gets at least the CPUs they ask for, and with ``placement`` set each gets a
    bundle of one placement group, reserved before the first starts. ``transport`` is the
    job's weight transport: on a cluster of several nodes, ``shm`` cannot reach other nodes
    (warned), and for ``torch_dist`` the trainer hosts the group's rendezvous at
    ``rendezvous_host``, its node's address (the controller's node unless placed)."""

    in_process = False

    def __init__(
        self,
        config: RayConfig | None = None,
        torch_threads: int = 1,
        executor_names: Sequence[str] = (),
        transport: str | None = None,
    ) -> None:
        import torch

        from loomrl.config import RayConfig

        torch.set_num_threads(torch_threads)
        self.config = config if config is not None else RayConfig()
        self.torch_threads = torch_threads
        self.handles: list[RayHandle] = []
        self.job_tag = f"loomrl-{uuid.uuid4().hex[:8]}"
        self._starts = 0
        self.executor_names = list(executor_names)
        self.owns_cluster = _connect(
            self.config, sum(self.resources(n)["num_cpus"] for n in self.executor_names)
        )
        self.placement_group = None
        self._bundles: dict[str, int] = {}
        self._trainer_node: str | None = None
        try:
            self._plan(transport)
        except BaseException:
            self.shutdown()
            raise

    def resources(self, name: str) -> dict[str, Any]:
        """The actor options (``num_cpus``, ``num_gpus``, ``memory``) of executor ``name``."""
        role, c = role_of(name), self.config
        memory_mb = getattr(c.memory_mb, role)
        options = {"num_cpus": getattr(c.num_cpus, role), "num_gpus": getattr(c.num_gpus, role)}
        if memory_mb is not None:
            options["memory"] = memory_mb << 20
        return options

    def _plan(self, transport: str | None) -> None:
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        if transport == "shm" and len(nodes) > 1:
            logger.warning(
                "weight_sync.transport='shm' reaches only executors on the controller's node, and this Ray "
                "cluster has %d nodes: pin the job to one node (ray.placement='pack' with room for it), or use "
                "'torch_dist' or 'files' (docs/cluster.md)",
                len(nodes),
            )
        if self.config.placement is not None and self.executor_names:
            self._reserve(self.executor_names)
        multi_node = len(nodes) > 1
        self.rendezvous_host = "127.0.0.1"
        if transport == "torch_dist" and multi_node:
            node_id = self._trainer_node or ray.get_runtime_context().get_node_id()
            if self._trainer_node is None:
                self._trainer_node = node_id  # pinned there below: the trainer hosts the rendezvous
            self.rendezvous_host = next(
                n["NodeManagerAddress"] for n in nodes if n["NodeID"] == node_id
            )

    def _reserve(self, names: list[str]) -> None:
        from ray.util.placement_group import placement_group, placement_group_table

        bundles = []
        for name in names:
            res = self.resources(name)
            bundle = {
                "CPU": res["num_cpus"],
                "GPU": res["num_gpus"],
                "memory": res.get("memory", 0),
            }
            bundle = {k: v for k, v in bundle.items() if v}
            if not bundle:
                raise ValueError(
                    f"ray.placement needs every executor to ask for something; {name!r} asks for no "
                    f"CPU, GPU or memory (ray.num_cpus.{role_of(name)} = 0)"
                )
            bundles.append(bundle)
        strategy = self.config.placement.upper()
        self.placement_group = placement_group(
            bundles, strategy=strategy, name=f"{self.job_tag}-pg"
        )
        try:
            ray.get(self.placement_group.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(
                f"Ray could not place the job's {len(bundles)} executors ({strategy}, bundles {bundles}) within "
                f"{PLACEMENT_TIMEOUT_S:.0f}s; the cluster has {ray.cluster_resources()}"
            ) from None
        self._bundles = {name: i for i, name in enumerate(names)}
        trainer = next(
            (n for n in names if base_role(n) == "trainer"), None
        )  # (or a trainer group's rank 0)
        if trainer is not None:
            self._trainer_node = placement_group_table(self.placement_group)["bundles_to_node_id"][
                self._bundles[trainer]
            ]

    def _scheduling(self, name: str) -> dict[str, Any]:
        from ray.util.scheduling_strategies import (
            NodeAffinitySchedulingStrategy,
            PlacementGroupSchedulingStrategy,
        )

        if self.placement_group is not None:
            if name not in self._bundles:
                raise ValueError(
                    f"executor {name!r} has no bundle in the job's placement group "
                    f"(planned: {', '.join(self._bundles)})"
                )
            return {
                "scheduling_strategy": PlacementGroupSchedulingStrategy(
                    self.placement_group, placement_group_bundle_index=self._bundles[name]
                )
            }
        if (
            base_role(name) == "trainer" and self._trainer_node is not None
        ):  # (the trainer, or its ranks)
            return {
                "scheduling_strategy": NodeAffinitySchedulingStrategy(
                    self._trainer_node, soft=False
                )
            }
        return {}

    def start(
        self, name: str, factory: Callable[[], Any], interface: type | None = None
    ) -> RayHandle:
        options = {**self.resources(name), **self._scheduling(name)}
        if self.config.namespace is not None:
            options["namespace"] = self.config.namespace
        self._starts += (
            1  # a restarted executor gets a fresh actor name: the old one may not be gone yet
        )
        handle = RayHandle(
            name,
            factory,
            f"{self.job_tag}-{name}-{self._starts}",
            options,
            self.torch_threads,
            interface,
        )
        self.handles.append(handle)
        return handle

    async def wait_ready(self) -> None:
        await asyncio.gather(*(h.wait_started() for h in self.handles))

    def shutdown(self) -> None:
        """Close the job's actors, remove its placement group, and shut Ray down if this
        runtime started it (never a cluster it connected to or found initialized)."""
        for handle in self.handles:
            handle.close()
        self.handles.clear()
        if self.placement_group is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.placement_group)
            self.placement_group = None
        if self.owns_cluster and ray.is_initialized():
            ray.shutdown()
            self.owns_cluster = False
