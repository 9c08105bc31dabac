"""runtime = "ray" across nodes, without a cluster: the transport decided by placement
(``loomrl.runtime.placement``, and the ray runtime over fake node lists), custom resources
per role reaching the actor options, and the job's paths made absolute on the controller.
The same on a real two-node cluster: tests/test_ray_two_nodes.py."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import pytest

from loomrl.config import ConfigError, build_config
from loomrl.runtime.placement import PlacementError, choose_transport, refusal, spans_nodes
from loomrl.session.paths import absolute_paths

from conftest import tiny_job_raw

A, B = "node-a", "node-b"
# Ray node ids are hex (a scheduling strategy checks)
HA, HB = "a" * 56, "b" * 56


def test_an_unset_transport_crosses_nodes_only_where_the_executors_may():
    one = {"trainer": A, "generator0": A, "scorer0": B}  # scorers hold no transport end
    two = {"trainer": A, "generator0": B}
    assert not spans_nodes(one) and spans_nodes(two)
    pick = choose_transport
    assert pick("shm", defaulted=True, planned=one, alive_nodes=2) == "shm"
    assert pick("shm", defaulted=True, planned=two, alive_nodes=2) == "torch_dist"
    # a sharded trainer's ranks cannot join a weight group too
    assert pick("shm", defaulted=True, planned=two, alive_nodes=2, trainer_group=True) == "files"
    # with no plan, Ray places each actor where it fits: any node of the cluster may get one
    assert pick("shm", defaulted=True, planned=None, alive_nodes=2) == "torch_dist"
    assert pick("shm", defaulted=True, planned=None, alive_nodes=1) == "shm"
    # a transport the job named is kept (refused later if it cannot reach)
    assert pick("shm", defaulted=False, planned=two, alive_nodes=2) == "shm"
    assert pick("files", defaulted=False, planned=None, alive_nodes=3) == "files"


def test_one_host_transports_across_nodes_are_refused_naming_the_nodes():
    two = {"trainer": A, "generator0": B, "generator1": A}
    why = refusal("shm", {"name": "x"}, two)
    assert "weight_sync.transport=shm" in why and "shared memory" in why
    assert "trainer on node node-a" in why and "generator0 on node node-b" in why
    assert "'torch_dist'" in why
    ipc = refusal("tensor", {"mode": "ipc"}, two)
    assert "CUDA IPC" in ipc and "mode 'ipc'" in ipc
    files = refusal("files", {"path": "/runs/x/weight_updates"}, two, blind=[B])
    assert "/runs/x/weight_updates" in files and "not seen from node(s) node-b" in files
    # what crosses machines, or what sits on one node, passes
    assert refusal("files", {"path": "/nfs/w"}, two, blind=[]) is None
    assert refusal("torch_dist", {}, two) is None
    assert refusal("tensor", {"mode": "broadcast"}, two) is None
    assert refusal("shm", {}, {"trainer": A, "generator0": A, "scorer0": B}) is None


def test_the_config_knows_an_unset_transport_and_leaves_it_out_of_config_json(tmp_path):
    raw = tiny_job_raw(tmp_path, tmp_path / "train.jsonl", runtime="ray")
    cfg = build_config(raw)
    assert cfg.weight_sync.kind == "shm" and cfg.transport_defaulted
    assert "transport" not in json.loads(cfg.to_json())["weight_sync"]
    cfg.output_dir = str(tmp_path / "other")  # an assignment keeps it
    assert cfg.transport_defaulted
    # rebuilt from its dump (config.json, Job(cfg, **keywords)): unset again
    assert build_config(cfg.dump()).transport_defaulted
    named = build_config({**raw, "weight_sync": {"transport": "shm"}})
    assert not named.transport_defaulted
    assert json.loads(named.to_json())["weight_sync"]["transport"] == {"type": "shm"}
    assert not build_config({**raw, "runtime": "process"}).transport_defaulted


class _FakeContext:
    def get_node_id(self) -> str:
        return HA


@pytest.fixture
def fake_cluster(monkeypatch):
    """``ray.nodes()`` answers with two alive nodes; nothing connects to Ray."""
    ray = pytest.importorskip("ray")
    import loomrl.runtime.ray as ray_runtime

    nodes = [
        {"NodeID": HA, "Alive": True, "NodeManagerAddress": "10.0.0.1", "Resources": {"CPU": 2}},
        {
            "NodeID": HB,
            "Alive": True,
            "NodeManagerAddress": "10.0.0.2",
            "Resources": {"CPU": 2, "box_b": 1},
        },
    ]
    monkeypatch.setattr(ray, "nodes", lambda: nodes)
    monkeypatch.setattr(ray, "get_runtime_context", lambda: _FakeContext())
    monkeypatch.setattr(ray_runtime, "_connect", lambda config, num_cpus: False)
    # every node reaches the rendezvous (tested below with real sockets)
    monkeypatch.setattr(ray_runtime, "unreachable_nodes", lambda host_node, host, nodes: {})
    return ray_runtime


class _Recorder:
    """Stands in for RayHandle: records what the actor would be created with."""

    def __init__(self, name, factory, actor_name, options, torch_threads, interface=None):
        self.name, self.options, self.node_id = name, options, None


def test_custom_resources_per_role_reach_the_actor_options(fake_cluster, monkeypatch):
    from loomrl.runtime.config import RayConfig

    monkeypatch.setattr(fake_cluster, "RayHandle", _Recorder)
    config = RayConfig(
        num_cpus={"generator": 2}, resources={"generator": {"gpu_box": 1}, "trainer": {"big": 0.5}}
    )
    rt = fake_cluster.RayRuntime(config, executor_names=["trainer", "generator0", "scorer0"])
    opts = {n: rt.start(n, dict).options for n in ("trainer", "generator0", "scorer0")}
    assert opts["generator0"]["resources"] == {"gpu_box": 1.0}
    assert opts["generator0"]["num_cpus"] == 2.0
    assert opts["trainer"]["resources"] == {"big": 0.5}
    assert "resources" not in opts["scorer0"]
    with pytest.raises(ValueError, match="'GPU' is one of Ray's own resources"):
        RayConfig(resources={"generator": {"GPU": 1}})
    raw = tiny_job_raw(Path("/tmp"), Path("/tmp/train.jsonl"), runtime="ray")
    with pytest.raises(ConfigError, match="an amount must be above 0"):
        build_config({**raw, "ray": {"resources": {"scorer": {"box": 0}}}})
    with pytest.raises(ConfigError, match="ray.resources.critic"):
        build_config({**raw, "ray": {"resources": {"critic": {"box": 1}}}})


def test_the_runtime_picks_torch_dist_on_several_nodes_and_refuses_shm_once_placed(fake_cluster):
    from loomrl.runtime.config import RayConfig

    names = ["trainer", "generator0"]
    unset = fake_cluster.RayRuntime(
        RayConfig(), executor_names=names, transport="shm", transport_defaulted=True
    )
    assert unset.transport == "torch_dist" and unset.rendezvous_host == "10.0.0.1"
    # a trainer that asks for what only node B has hosts the rendezvous there
    on_b = fake_cluster.RayRuntime(
        RayConfig(resources={"trainer": {"box_b": 1}}), executor_names=names, transport="torch_dist"
    )
    assert on_b.rendezvous_host == "10.0.0.2"
    forced = fake_cluster.RayRuntime(RayConfig(), executor_names=names, transport="shm")
    assert forced.transport == "shm"
    forced.uses_transport("shm", {"name": "abc"})
    forced.handles = [
        _Recorder("trainer", None, "", {}, 1),
        _Recorder("generator0", None, "", {}, 1),
    ]
    forced.handles[0].node_id, forced.handles[1].node_id = HA, HA
    forced.check_placement()  # one node: shm reaches
    # and a replaced generator is started on that node, where shm reaches it
    replaced = forced._scheduling("generator0")["scheduling_strategy"]
    assert (replaced.node_id, replaced.soft) == (HA, False)
    forced.handles[1].node_id = HB
    with pytest.raises(PlacementError, match=r"generator0 on node bbbbbbbbbbbb \(10\.0\.0\.2\)"):
        forced.check_placement()


def test_paths_are_made_absolute_from_the_controllers_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    raw = tiny_job_raw(
        tmp_path,
        Path("data/train.jsonl"),
        Path("data/eval.jsonl"),
        runtime="ray",
        output_dir=None,
        model={"path": ".cache/warm"},
        weight_sync={"transport": {"type": "files", "path": "w"}},
        task={
            "reward": None,
            "scorer": {"type": "model", "path": "rm", "device": "cpu"},
        },
    )
    cfg = build_config(raw)
    out = absolute_paths(cfg, Path("runs/tiny-1"))
    here = str(tmp_path)
    assert out.output_dir == os.path.join(here, "runs/tiny-1")
    assert out.model.path == os.path.join(here, ".cache/warm")
    assert (out.data.train, out.data.eval) == (
        os.path.join(here, "data/train.jsonl"),
        os.path.join(here, "data/eval.jsonl"),
    )
    assert out.weight_sync.transport.path == os.path.join(here, "w")
    assert out.task.scorer.path == os.path.join(here, "rm")
    assert cfg.model.path == ".cache/warm"  # a copy; the config itself is unchanged
    # what is not a local path stays as written
    remote = build_config(
        {
            **raw,
            "model": {"path": "tiny:llama"},
            "weight_sync": {"transport": {"type": "files", "path": "s3://b/w"}},
        }
    )
    kept = absolute_paths(remote, Path("/abs/run"))
    assert kept.model.path == "tiny:llama" and kept.weight_sync.transport.path == "s3://b/w"
    assert kept.output_dir == "/abs/run"


def test_a_rendezvous_some_node_cannot_reach_is_refused_before_any_actor_starts(
    fake_cluster, monkeypatch
):
    from loomrl.runtime.config import RayConfig

    asked = []

    def unreachable(host_node, host, nodes):
        asked.append((host_node, host, set(nodes)))
        return {
            n: "ConnectionRefusedError: [Errno 111] Connection refused" for n in nodes if n == HB
        }

    monkeypatch.setattr(fake_cluster, "unreachable_nodes", unreachable)
    with pytest.raises(
        PlacementError, match=r"node bbbbbbbbbbbb \(10\.0\.0\.2\) cannot connect"
    ) as err:
        fake_cluster.RayRuntime(
            RayConfig(), executor_names=["trainer", "generator0"], transport="torch_dist"
        )
    assert "rendezvous at 10.0.0.1" in str(err.value) and "Connection refused" in str(err.value)
    assert asked == [(HA, "10.0.0.1", {HA, HB})]
    # only the nodes a generator may go to are asked: here none but the trainer's
    asked.clear()
    fake_cluster.RayRuntime(
        RayConfig(resources={"generator": {"box_a": 1}}),
        executor_names=["trainer", "generator0"],
        transport="torch_dist",
    )
    assert asked == [(HA, "10.0.0.1", set())]


def test_a_connection_probe_answers_in_seconds():
    pytest.importorskip("ray")
    from loomrl.runtime.ray_probe import _Listener, connect_error

    listener = _Listener("127.0.0.1")
    try:
        assert connect_error("127.0.0.1", listener.port(), timeout_s=5) is None
    finally:
        listener.sock.close()
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        closed = sock.getsockname()[1]
    t0 = time.monotonic()
    why = connect_error("127.0.0.1", closed, timeout_s=1.0)
    assert why is not None and "ConnectionRefusedError" in why
    assert time.monotonic() - t0 < 3


def test_a_run_folder_the_trainers_node_cannot_see_is_refused(fake_cluster, monkeypatch):
    from loomrl.runtime.config import RayConfig

    probed = []

    def blind(folder, nodes):
        probed.append((folder, set(nodes)))
        return [n for n in nodes if n == HB]

    monkeypatch.setattr(fake_cluster, "files_blind_nodes", blind)
    rt = fake_cluster.RayRuntime(
        RayConfig(), executor_names=["trainer", "generator0"], run_dir="/runs/x"
    )
    rt.handles = [_Recorder("trainer", None, "", {}, 1), _Recorder("generator0", None, "", {}, 1)]
    rt.handles[0].node_id, rt.handles[1].node_id = HA, HB
    rt.check_placement()  # the trainer sees it (a generator writes nothing there)
    assert probed == [("/runs/x", {HA})]
    rt.handles[0].node_id = HB
    with pytest.raises(
        PlacementError, match="output_dir must be on storage every node sees"
    ) as err:
        rt.check_placement()
    assert "bbbbbbbbbbbb (10.0.0.2) does not see /runs/x" in str(err.value)


def test_a_files_folder_a_generators_node_cannot_see_is_refused(fake_cluster, monkeypatch):
    from loomrl.runtime.config import RayConfig

    probed = []

    def blind(folder, nodes):
        probed.append((folder, set(nodes)))
        return [n for n in nodes if n == HB]

    monkeypatch.setattr(fake_cluster, "files_blind_nodes", blind)
    names = ["trainer", "generator0", "scorer0"]
    rt = fake_cluster.RayRuntime(RayConfig(), executor_names=names, transport="files")
    rt.uses_transport("files", {"path": "/w", "keep_fulls": 2})
    rt.handles = [_Recorder(n, None, "", {}, 1) for n in names]
    for handle, node in zip(rt.handles, (HA, HA, HB), strict=True):
        handle.node_id = node
    rt.check_placement()  # the scorer on B reads no weights: B is not asked
    assert probed == [("/w", {HA})]
    rt.handles[1].node_id = HB
    with pytest.raises(PlacementError, match=r"folder /w is not seen from node\(s\) bbbbbbbbbbbb"):
        rt.check_placement()
    # a URL is not a local folder: nothing to probe, and it crosses machines
    rt.uses_transport("files", {"path": "s3://bucket/w", "keep_fulls": 2})
    probed.clear()
    rt.check_placement()
    assert probed == []


def test_a_trainer_asking_for_resources_no_node_offers_is_refused_not_left_pending(fake_cluster):
    from loomrl.runtime.config import RayConfig

    with pytest.raises(PlacementError, match=r"ray.resources.trainer asks for \{'gpu_box': 1.0\}"):
        fake_cluster.RayRuntime(
            RayConfig(resources={"trainer": {"gpu_box": 1}}),
            executor_names=["trainer", "generator0"],
            transport="torch_dist",
        )
    # a node that offers them hosts the trainer (and the rendezvous): no error
    rt = fake_cluster.RayRuntime(
        RayConfig(resources={"trainer": {"box_b": 1}}),
        executor_names=["trainer", "generator0"],
        transport="torch_dist",
    )
    assert rt.rendezvous_host == "10.0.0.2"


def test_a_sharded_trainers_ranks_meet_at_rank_0s_node_address(fake_cluster, monkeypatch):
    """Issue 54, item 3: on several nodes the trainer's ranks meet at rank 0's node address
    (rank 0 pinned there, the other ranks free to go to other nodes), for every transport."""
    from loomrl.runtime.config import RayConfig

    asked = []

    def unreachable(host_node, host, nodes):
        asked.append((host_node, host, set(nodes)))
        return {}

    monkeypatch.setattr(fake_cluster, "unreachable_nodes", unreachable)
    names = ["trainer.rank0", "trainer.rank1", "generator0"]
    rt = fake_cluster.RayRuntime(
        RayConfig(), executor_names=names, transport="files", trainer_group=True
    )
    assert rt.rendezvous_host == "10.0.0.1"  # the controller's node (A) hosts rank 0
    rank0 = rt._scheduling("trainer.rank0")["scheduling_strategy"]
    assert (rank0.node_id, rank0.soft) == (HA, False)
    assert rt._scheduling("trainer.rank1") == {}  # Ray places it, on any node
    assert asked == [(HA, "10.0.0.1", {HA, HB})]  # every node a rank may go to reaches it
    # rank 0 asking for what only node B has: the ranks meet at B's address
    on_b = fake_cluster.RayRuntime(
        RayConfig(resources={"trainer": {"box_b": 1}}),
        executor_names=names,
        transport="files",
        trainer_group=True,
    )
    assert on_b.rendezvous_host == "10.0.0.2"
    monkeypatch.setattr(
        fake_cluster, "unreachable_nodes", lambda host_node, host, nodes: {HB: "timed out"}
    )
    with pytest.raises(
        PlacementError, match=r"fsdp2'.*trainer ranks' rendezvous at 10\.0\.0\.1.*bbbbbbbbbbbb"
    ):
        fake_cluster.RayRuntime(
            RayConfig(), executor_names=names, transport="files", trainer_group=True
        )
    # one node: loopback, as before
    monkeypatch.setattr(fake_cluster.ray, "nodes", lambda: [{"NodeID": HA, "Alive": True}])
    single = fake_cluster.RayRuntime(
        RayConfig(), executor_names=names, transport="shm", trainer_group=True
    )
    assert single.rendezvous_host == "127.0.0.1" and single._scheduling("trainer.rank0") == {}


class _Lost(_Recorder):
    """A lost executor's handle, as ``Runtime.restart`` sees it."""

    alive = False

    def starter(self, runtime):
        return lambda: runtime.start(self.name, dict)

    def close(self) -> None:
        pass


def _lost(name: str, node: str) -> _Lost:
    handle = _Lost(name, None, "", {}, 1)
    handle.node_id = node
    return handle


def test_a_replacement_never_goes_to_a_node_that_is_dead_or_dying(fake_cluster, monkeypatch):
    """Issue 54, item 5: the node of a lost executor is checked (``ray_probe.node_down``)
    before its replacement is placed; a dead or dying one is left out of that and every
    later placement by Ray's node-id label, and a replacement pinned to it is refused."""
    from ray._private.label_utils import validate_label_selector

    from loomrl.runtime.config import RayConfig

    monkeypatch.setattr(fake_cluster, "RayHandle", _Recorder)
    probed, answers = [], True

    def node_down(node):
        probed.append(node)
        return None if answers else "a task pinned to it did not answer within 15 s"

    monkeypatch.setattr(fake_cluster, "node_down", node_down)
    rt = fake_cluster.RayRuntime(RayConfig(), executor_names=["trainer", "generator0", "scorer0"])
    assert "label_selector" not in rt.start("generator0", dict).options
    # A, the controller's node, is never judged; B answers, then does not
    assert "label_selector" not in rt.restart(_lost("scorer0", HA)).options
    assert "label_selector" not in rt.restart(_lost("scorer0", HB)).options
    answers = False
    fresh = rt.restart(_lost("generator0", HB))
    selector = {"ray.io/node-id": f"!in({HB})"}
    assert fresh.options["label_selector"] == selector
    assert validate_label_selector(selector) is None  # a selector Ray takes
    assert rt.start("scorer0", dict).options["label_selector"] == selector  # later ones too
    rt.restart(_lost("generator0", HB))
    assert probed == [HB, HB]  # a node found down is not probed again
    rt._weights_home = HB  # a one-host transport's home: the replacement can only go there
    with pytest.raises(
        PlacementError, match=r"'generator0' must run on node bbbbbbbbbbbb.*dead or dying"
    ):
        rt.restart(_lost("generator0", HA))
