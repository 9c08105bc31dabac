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

The actor an executor lives in and its handle are in ``loomrl.runtime.ray_actor``; this
module connects to Ray and places the actors. ``RayRuntime`` uses the Ray this process
already initialized, connects to ``address``, or starts a local cluster; it shuts Ray down
at the end only in the last case.
"""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import ray
import ray.exceptions

from loomrl.runtime.base import ExecutorHandle, Runtime
from loomrl.runtime.base import role_of as base_role
from loomrl.runtime.group import rank_name
from loomrl.runtime.placement import (
    PlacementError,
    choose_transport,
    one_host_only,
    refusal,
    weight_nodes,
)
from loomrl.runtime.ray_actor import RayHandle
from loomrl.runtime.ray_probe import files_blind_nodes, node_down, unreachable_nodes

if TYPE_CHECKING:
    from loomrl.runtime.config import RayConfig

logger = logging.getLogger(__name__)

NODE_ID_LABEL = "ray.io/node-id"  # a label Ray gives every node: its id

PLACEMENT_TIMEOUT_S = 120.0  # a placement group that cannot be placed in this long never will
ROLES = ("trainer", "generator", "scorer")


def role_of(name: str) -> str:
    """``"generator3"`` -> ``"generator"``: the role whose resources an executor gets (a name of no known role is refused)."""
    role = base_role(name)
    if role not in ROLES:
        raise ValueError(
            f"executor name {name!r} has no known role; expected one of {', '.join(ROLES)} (+ index)"
        )
    return role


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
    # ("local": a new cluster, never a found one)
    ray.init(
        address="local",
        num_cpus=max(os.cpu_count() or 1, num_cpus),
        object_store_memory=object_store,
        include_dashboard=False,
        **kwargs,
    )
    logger.info("started a local Ray cluster for this job")
    return True


def node_label(node_id: str) -> str:
    """A node as messages name it: its id's start and its address."""
    address = next((n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node_id), "?")
    return f"{node_id[:12]} ({address})"


class RayRuntime(Runtime):
    """Executors as Ray actors. ``executor_names`` are the executors the job will start: a
    local cluster gets at least the CPUs they ask for, and with ``placement`` set each gets a
    bundle of one placement group, reserved before the first starts. ``transport`` is the
    job's weight transport; where the job named none (``transport_defaulted``) and its
    executors may sit on several nodes, the runtime picks one that crosses machines
    (``self.transport``, ``loomrl.runtime.placement``). Once the executors started,
    ``wait_ready`` refuses a transport that cannot reach the generators from where the
    trainer landed (``PlacementError``, naming the nodes). For ``torch_dist`` the trainer
    hosts the group's rendezvous at ``rendezvous_host``, its node's address (the
    controller's node unless placed)."""

    in_process = False

    def __init__(
        self,
        config: RayConfig | None = None,
        torch_threads: int = 1,
        executor_names: Sequence[str] = (),
        transport: str | None = None,
        transport_defaulted: bool = False,
        trainer_group: bool = False,
        run_dir: str | None = None,
    ) -> None:
        # lazy: torch loads in the runtime's own process, not when ray.py is imported
        import torch

        from loomrl.runtime.config import RayConfig

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
        self._planned: dict[str, str] | None = None  # {executor: node id}, with placement
        # the one node a one-host transport (shm) found the trainer and generators on
        self._weights_home: str | None = None
        self._down: dict[str, str] = {}  # {node id: why}: nodes no executor starts on again
        self.transport = transport
        self.run_dir = run_dir  # checked to be seen from the trainer's node, once placed
        self._transport_args: dict[str, Any] = {}
        try:
            self._plan(transport, transport_defaulted, trainer_group)
        except BaseException:
            self.shutdown()
            raise

    def resources(self, name: str) -> dict[str, Any]:
        """The actor options (``num_cpus``, ``num_gpus``, ``memory``, custom ``resources``)
        of executor ``name``."""
        role, c = role_of(name), self.config
        memory_mb = getattr(c.memory_mb, role)
        options = {"num_cpus": getattr(c.num_cpus, role), "num_gpus": getattr(c.num_gpus, role)}
        if memory_mb is not None:
            options["memory"] = memory_mb << 20
        custom = getattr(c.resources, role)
        if custom:
            options["resources"] = dict(custom)
        return options

    def _plan(self, transport: str | None, defaulted: bool, trainer_group: bool) -> None:
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        if self.config.placement is not None and self.executor_names:
            self._reserve(self.executor_names)
        if transport is not None:
            self.transport = choose_transport(
                transport,
                defaulted=defaulted,
                planned=self._planned,
                alive_nodes=len(nodes),
                trainer_group=trainer_group,
            )
            if self.transport != transport:
                logger.info(
                    "weight_sync.transport is unset and the job's executors may sit on several of the "
                    "cluster's %d nodes: using %r, which crosses machines (docs/cluster.md)",
                    len(nodes),
                    self.transport,
                )
        if self._planned is not None and self.transport is not None:
            why = refusal(self.transport, {}, self._labels(self._planned))
            if why is not None:  # (before any actor starts)
                raise PlacementError(why)
        self._plan_rendezvous(nodes, trainer_group)

    def _plan_rendezvous(self, nodes: list[dict[str, Any]], trainer_group: bool) -> None:
        """Where groups of ranks meet: on a cluster of several nodes, at the address of the
        node that hosts the rendezvous (the trainer's, or a sharded trainer's rank 0's, which
        is pinned there) for a torch_dist weight group and for a sharded trainer's ranks;
        loopback on one node."""
        multi_node = len(nodes) > 1
        self.rendezvous_host = "127.0.0.1"
        if multi_node and (self.transport == "torch_dist" or trainer_group):
            node_id = self._trainer_node or self._trainer_home(nodes)
            if self._trainer_node is None:
                self._trainer_node = node_id  # pinned there below: the trainer hosts the rendezvous
            self.rendezvous_host = next(
                n["NodeManagerAddress"] for n in nodes if n["NodeID"] == node_id
            )
            if self.transport == "torch_dist":
                self._check_reach(node_id, nodes, "generator", "the weight group's")
            if trainer_group:
                self._check_reach(node_id, nodes, "trainer", "the trainer ranks'")

    def _check_reach(
        self, trainer_node: str, nodes: list[dict[str, Any]], role: str, whose: str
    ) -> None:
        """Refuse, before any actor starts, a group whose rendezvous (the trainer's node
        address) some node that may hold one of its ``role`` executors cannot connect to."""
        if self._planned is not None:
            candidates = {n for name, n in self._planned.items() if base_role(name) == role}
        else:  # (the nodes with the custom resources the role asks for)
            candidates = set(self._nodes_for(role, nodes))
        bad = unreachable_nodes(trainer_node, self.rendezvous_host, candidates)
        if not bad and candidates - {trainer_node}:
            logger.info(
                "the %d other node(s) reach %s rendezvous at %s",
                len(candidates - {trainer_node}),
                whose,
                self.rendezvous_host,
            )
        elif bad:
            what = (
                "weight_sync.transport='torch_dist'"
                if role == "generator"
                else "trainer.parallel.type='fsdp2'"
            )
            raise PlacementError(
                f"{what}: the trainer's node {node_label(trainer_node)} hosts "
                f"{whose} rendezvous at {self.rendezvous_host}, and "
                + "; ".join(
                    f"node {node_label(n)} cannot connect to it ({why})" for n, why in bad.items()
                )
                + ": open TCP between the nodes, or start each raylet with a --node-ip-address the "
                "others can reach (docs/cluster.md)"
            )

    def _trainer_home(self, nodes: list[dict[str, Any]]) -> str:
        """The node an unplaced trainer is pinned to: the controller's, unless the trainer
        asks for custom resources (``ray.resources.trainer``) that only other nodes have
        (then the first of those); none offering them is an error, not an actor that waits
        for ever."""
        here = ray.get_runtime_context().get_node_id()
        fits = self._nodes_for("trainer", nodes)
        if not fits:
            wanted = self.resources("trainer").get("resources", {})
            raise PlacementError(
                f"ray.resources.trainer asks for {wanted}, which no live node of the cluster "
                "offers: start a raylet with them (ray start --resources '{...}') or change "
                "ray.resources.trainer"
            )
        return here if here in fits else fits[0]

    def _nodes_for(self, name: str, nodes: list[dict[str, Any]]) -> list[str]:
        """The nodes that offer the custom resources executor ``name`` asks for."""
        wanted = self.resources(name).get("resources", {})
        return [
            n["NodeID"]
            for n in nodes
            if all(n.get("Resources", {}).get(k, 0) >= v for k, v in wanted.items())
        ]

    def _reserve(self, names: list[str]) -> None:
        # lazy: ray is optional (the ray extra)
        from ray.util.placement_group import placement_group, placement_group_table

        bundles = []
        for name in names:
            res = self.resources(name)
            bundle = {
                "CPU": res["num_cpus"],
                "GPU": res["num_gpus"],
                "memory": res.get("memory", 0),
                **res.get("resources", {}),
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
        to_node = placement_group_table(self.placement_group)["bundles_to_node_id"]
        self._planned = {name: to_node[i] for name, i in self._bundles.items()}
        # (or a trainer group's rank 0)
        trainer = next((n for n in names if base_role(n) == "trainer"), None)
        if trainer is not None:
            self._trainer_node = self._planned[trainer]

    def _scheduling(self, name: str) -> dict[str, Any]:
        # lazy: ray is optional (the ray extra)
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
        pinned = self._pinned_node(name)
        if pinned is not None:
            return {"scheduling_strategy": NodeAffinitySchedulingStrategy(pinned, soft=False)}
        if self._down:  # anywhere but a node that lost an executor with itself
            return {"label_selector": {NODE_ID_LABEL: f"!in({','.join(sorted(self._down))})"}}
        return {}

    def restart(self, handle: ExecutorHandle) -> ExecutorHandle:
        """Replace a lost executor (``Runtime.restart``), never on a node that is dead or
        dying: where the lost one's node is (``ray_probe.node_down``), that node is left out
        of this and every later placement of the job; a replacement that can only go there
        (pinned to it) is refused by name. (A placement group's bundles on a dead node are
        Ray's to place again.)"""
        node = getattr(handle, "node_id", None)
        # (the controller's own node is never judged: while the controller runs, it is up, and
        # a slow answer there must not leave a one-node cluster with nowhere to place)
        here = ray.get_runtime_context().get_node_id()
        if node is not None and node not in self._down and node != here:
            why = node_down(node)
            if why is not None:
                self._down[node] = why
                logger.warning(
                    "node %s is dead or dying (%s): executor %r is replaced on another node, "
                    "and no executor of this job starts there again",
                    node_label(node),
                    why,
                    handle.name,
                )
        pinned = self._pinned_node(handle.name)
        if pinned in self._down:
            raise PlacementError(
                f"executor {handle.name!r} must run on node {node_label(pinned)} (it hosts "
                f"{'the rendezvous' if base_role(handle.name) == 'trainer' else 'the one-host weight transport'}), "
                f"which is dead or dying ({self._down[pinned]})"
            )
        return super().restart(handle)

    def _pinned_node(self, name: str) -> str | None:
        """The one node executor ``name`` may run on, outside a placement group: the
        trainer's (or a sharded trainer's rank 0's: it hosts the rendezvous; its other ranks
        go where Ray places them) and, for a generator, the one node a one-host transport
        found the trainer and generators on."""
        if self.placement_group is not None:
            return None
        if name in ("trainer", rank_name("trainer", 0)):
            return self._trainer_node
        return self._weights_home if base_role(name) == "generator" else None

    def start(
        self, name: str, factory: Callable[[], Any], interface: type | None = None
    ) -> RayHandle:
        options = {**self.resources(name), **self._scheduling(name)}
        if self.config.namespace is not None:
            options["namespace"] = self.config.namespace
        # a restarted executor gets a fresh actor name: the old one may not be gone yet
        self._starts += 1
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

    def uses_transport(self, kind: str, kwargs: dict[str, Any]) -> None:
        self.transport, self._transport_args = kind, dict(kwargs)

    async def wait_ready(self) -> None:
        """Wait until every executor is built; then refuse a weight transport that cannot
        reach the generators from where the trainer landed (``PlacementError``)."""
        await asyncio.gather(*(h.wait_started() for h in self.handles))
        self.check_placement()

    def check_placement(self) -> None:
        """Raise ``PlacementError`` where the started executors sit on nodes that the job's
        weight transport cannot connect (``loomrl.runtime.placement.refusal``), or where the
        trainer does not see the run folder it writes checkpoints into."""
        placement = {h.name: h.node_id for h in self.handles if h.node_id is not None}
        self._check_run_dir(placement)
        if self.transport is None:
            return
        if len(set(placement.values())) > 1:
            logger.info(
                "executors on %d nodes: %s",
                len(set(placement.values())),
                ", ".join(f"{n} on {node_label(node)}" for n, node in placement.items()),
            )
        kwargs = self._transport_args
        blind: list[str] = []
        if self.transport == "files" and "://" not in str(kwargs.get("path", "://")):
            blind = files_blind_nodes(kwargs["path"], set(weight_nodes(placement).values()))
        why = refusal(
            self.transport, kwargs, self._labels(placement), [node_label(n) for n in blind]
        )
        if why is not None:
            raise PlacementError(why)
        homes = set(weight_nodes(placement).values())
        if one_host_only(self.transport, kwargs) and len(homes) == 1:
            self._weights_home = homes.pop()  # a replaced generator starts there too

    def _check_run_dir(self, placement: dict[str, str]) -> None:
        trainers = {node for name, node in placement.items() if base_role(name) == "trainer"}
        if self.run_dir is None or not trainers:
            return
        blind = files_blind_nodes(self.run_dir, trainers)
        if blind:
            raise PlacementError(
                f"output_dir must be on storage every node sees: the trainer's node "
                f"{', '.join(map(node_label, blind))} does not see {self.run_dir} (its checkpoints and "
                "final/ would land on that node's disk, out of the controller's reach); put output_dir "
                "on a shared filesystem, or keep the trainer on the controller's node (docs/cluster.md)"
            )

    def _labels(self, placement: dict[str, str]) -> dict[str, str]:
        return {name: node_label(node) for name, node in placement.items()}

    def shutdown(self) -> None:
        """Close the job's actors, remove its placement group, and shut Ray down if this
        runtime started it (never a cluster it connected to or found initialized)."""
        for handle in self.handles:
            handle.close()
        self.handles.clear()
        if self.placement_group is not None:
            # lazy: ray is optional (the ray extra)
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.placement_group)
            self.placement_group = None
        if self.owns_cluster and ray.is_initialized():
            ray.shutdown()
            self.owns_cluster = False
