"""Publish time per step: ``torch_dist`` with the trainer and the generator on two Ray nodes,
against ``shm`` (and ``torch_dist``) with both on one node, measured in the same run.

Starts a two-node Ray cluster on this host (``ray.cluster_utils.Cluster``: two raylets, node
B's from its own working folder, as ``tests/test_ray_two_nodes.py`` does), then runs the
arithmetic job on a ``tiny:`` Llama of the size asked for, full weight updates in bf16, three
ways, interleaved over the repeats:

- ``shm, 1 node``: every executor on node A, the default one-host transport;
- ``torch_dist, 1 node``: every executor on node A, the gloo broadcast;
- ``torch_dist, 2 nodes``: the trainer on node B, the generator and scorer on node A, the
  transport left unset (placement picks ``torch_dist``).

Per configuration: the median of the steps' ``timing/publish_s`` (the trainer's whole publish:
cast, encode, send; the first step's is left out), the bytes sent per step, and the ratio to
``shm, 1 node``. Both nodes are on one host here, so "2 nodes" crosses the node boundary
(another raylet, the node's address rather than loopback) but not a NIC: on two machines the
wire's bandwidth adds to it. With ``--netns`` (root) node B runs in a network namespace of
its own (``tests/netns.py``): the broadcast then goes between two addresses over a veth pair,
through the kernel's network stack, still not a NIC.

    python bench/cross_node_publish.py                     # ~12 M parameters, 12 steps, 2 repeats
    python bench/cross_node_publish.py --hidden 512 --layers 8 --steps 8 --repeats 1
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # netns.py, the namespaced node B of the Ray tests

CONFIGS = {
    "shm, 1 node": ("node_a", "shm"),
    "torch_dist, 1 node": ("node_a", "torch_dist"),
    "torch_dist, 2 nodes": ("node_b", None),
}


def job_raw(args: argparse.Namespace, trainer_node: str, transport: str | None, out: Path) -> dict:
    spec = (
        f"tiny:llama?hidden_size={args.hidden}&num_layers={args.layers}"
        f"&num_heads={max(2, args.hidden // 64)}&intermediate_size={args.hidden * 4}"
    )
    raw = {
        "name": "cross-node-publish",
        "seed": 0,
        "runtime": "ray",
        "output_dir": str(out),
        "model": {"path": spec, "dtype": "float32"},
        "data": {"train": str(ROOT / "examples/arithmetic/train.jsonl")},
        "task": {"reward": "examples.arithmetic.reward:exact_match"},
        "generation": {"max_new_tokens": 4, "prompts_per_request": 4},
        "algorithm": {"group_size": 4, "groups_per_step": 4, "max_staleness": 1},
        "trainer": {"num_steps": args.steps, "lr": 1e-4, "micro_batch_size": 16},
        "checkpoint": {"every_steps": 10_000},
        "eval": {"every_steps": 10_000},
        "logging": {"report": False},
        "weight_sync": {"codec": "full"},
        "ray": {
            "num_cpus": {"trainer": 1, "generator": 1, "scorer": 1},
            "resources": {
                "trainer": {trainer_node: 1},
                "generator": {"node_a": 1},
                "scorer": {"node_a": 1},
            },
        },
    }
    if transport is not None:
        raw["weight_sync"]["transport"] = transport
    return raw


def run_once(args: argparse.Namespace, name: str, out: Path) -> dict[str, float]:
    from loomrl.config import build_config
    from loomrl.job import Job
    from loomrl.telemetry.metrics import read_metrics

    node, transport = CONFIGS[name]
    result = Job(build_config(job_raw(args, node, transport, out))).run(progress=False)
    steps = [r for r in read_metrics(result.run_dir) if "timing/publish_s" in r]
    later = [r for r in steps if r["step"] >= 2]  # the first publish warms the group up
    return {
        "publish_s": statistics.median(r["timing/publish_s"] for r in later),
        "bytes": statistics.median(r["weight_sync/bytes_sent"] for r in later),
        "steps": len(later),
    }


def start_cluster(base: Path, node=None):
    """Two raylets on this host, node B's started from a folder of its own; with ``node``
    (``tests/netns.py``'s ``NodeB``) node B runs in its own network namespace, at its own
    address, with its own ``/dev/shm``. Returns the cluster and node B's ``ray start``
    process (None without ``node``)."""
    import time

    import ray
    from ray.cluster_utils import Cluster

    head = {"num_cpus": 3, "resources": {"node_a": 8}, "include_dashboard": False}
    if node is not None:
        head["node_ip_address"] = node.a_ip
    cluster = Cluster(initialize_head=True, head_node_args=head)
    (base / "b").mkdir()
    node_b = None
    if node is not None:
        cmd = node.ray_start(cluster.address, str(base / "b"), 2, json.dumps({"node_b": 8}))
        node_b = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.DEVNULL)
    else:
        here = os.getcwd()
        os.chdir(base / "b")
        cluster.add_node(num_cpus=2, resources={"node_b": 8})
        os.chdir(here)
    cluster.wait_for_nodes()
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)]), "OMP_NUM_THREADS": "1"}
    ray.init(address=cluster.address, namespace="cross-node-publish", runtime_env={"env_vars": env})
    deadline = time.monotonic() + 120
    while sum(n["Alive"] for n in ray.nodes()) < 2:
        if time.monotonic() > deadline or (node_b is not None and node_b.poll() is not None):
            raise RuntimeError(f"node B never joined the cluster: {ray.nodes()}")
        time.sleep(0.5)
    return cluster, node_b


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", type=Path, help="write the per-run results here too")
    parser.add_argument(
        "--netns",
        action="store_true",
        help="node B in its own network namespace and /dev/shm (root; tests/netns.py)",
    )
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="lrxn-", dir="/tmp"))  # short: Ray's socket paths
    os.environ["RAY_TMPDIR"] = str(base / "ray")
    os.environ.pop("RAY_ADDRESS", None)
    import ray

    from loomrl.models.loading import tiny_num_params

    params = tiny_num_params(
        {
            "hidden_size": args.hidden,
            "num_layers": args.layers,
            "intermediate_size": args.hidden * 4,
        }
    )
    from netns import isolated_node_b, why_not  # tests/netns.py: node B's namespaces

    runs: dict[str, list[dict[str, float]]] = {name: [] for name in CONFIGS}
    with isolated_node_b() if args.netns else contextlib.nullcontext() as node:
        if args.netns and node is None:
            raise SystemExit(f"--netns: this host cannot isolate node B: {why_not()}")
        cluster, node_b = start_cluster(base, node)
        try:
            for repeat in range(args.repeats):
                for name in CONFIGS:
                    out = base / f"run-{repeat}-{name.replace(', ', '-').replace(' ', '')}"
                    runs[name].append(run_once(args, name, out))
                    print(f"repeat {repeat + 1}: {name}: {runs[name][-1]}", flush=True)
        finally:
            ray.shutdown()
            if node_b is not None:
                os.killpg(node_b.pid, signal.SIGTERM)
                node_b.wait(timeout=60)
            cluster.shutdown()
    if args.json:
        args.json.write_text(json.dumps(runs, indent=1))
    base_s = statistics.median(r["publish_s"] for r in runs["shm, 1 node"])
    print(
        f"\n~{params / 1e6:.1f} M parameters (bf16 published: {params * 2 / 1e6:.1f} MB), "
        f"{args.steps} steps x {args.repeats} repeats; medians over steps 2.. and the repeats"
    )
    print("| transport, placement | publish ms / step | MB sent / step | vs shm, 1 node |")
    print("| --- | --- | --- | --- |")
    for name, results in runs.items():
        s = statistics.median(r["publish_s"] for r in results)
        mb = statistics.median(r["bytes"] for r in results) / 1e6
        print(f"| {name} | {s * 1e3:.1f} | {mb:.2f} | {s / base_s:.2f}x |")


if __name__ == "__main__":
    main()
