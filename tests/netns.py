"""A second machine on one host for the two-node Ray tests, where the host allows it.

Node B's raylet starts in a network namespace of its own, joined to the host by a veth pair
(node A's address on the host's end, node B's on its own: two addresses, traffic between
them crosses an interface as it would a wire), and in a mount namespace with a private
``/dev/shm`` (a shared-memory segment made on one node is not there on the other), from a
working folder of its own. Everything else (the filesystem, the install) is shared, as the
run folder on shared storage of a real cluster is.

It needs root (``CAP_NET_ADMIN`` and ``CAP_SYS_ADMIN``), iproute2's ``ip`` and util-linux's
``unshare``; ``why_not()`` says which is missing, and the tests then run both raylets in
the host's namespaces (one address, one ``/dev/shm``) and say so. ``isolated_node_b()``
removes the namespace, its processes (the test's own: node B's raylet and workers) and the
veth pair on exit.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class NodeB:
    """Where node B lives: its namespace, the two ends' addresses and the host's veth."""

    ns: str
    a_ip: str
    b_ip: str
    veth_a: str
    veth_b: str

    def ray_start(self, address: str, cwd: str, num_cpus: int, resources: str) -> list[str]:
        """The command that runs node B's raylet (``ray start --block``, in the foreground:
        ending its process group ends the node) inside the namespaces, from ``cwd``."""
        ray = shutil.which("ray", path=os.path.dirname(sys.executable)) or "ray"  # the venv's
        inner = (
            "mount -t tmpfs -o size=1g tmpfs /dev/shm && "
            f"cd {shlex.quote(cwd)} && exec {shlex.quote(ray)} start --block --address={shlex.quote(address)} "
            f"--node-ip-address={self.b_ip} --num-cpus={num_cpus} --resources={shlex.quote(resources)} "
            "--object-store-memory=200000000 --disable-usage-stats"
        )
        unshare = ["unshare", "-m", "--propagation", "private", "sh", "-c", inner]
        return ["ip", "netns", "exec", self.ns, *unshare]

    def to_json(self) -> dict[str, str]:
        return asdict(self)


def _run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), capture_output=True, text=True, check=False)


def why_not() -> str | None:
    """None where this host can isolate node B; else what is missing."""
    if os.geteuid() != 0:
        return "not root (network and mount namespaces need CAP_NET_ADMIN and CAP_SYS_ADMIN)"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"no `{tool}` on PATH"
    probe = _run("unshare", "-m", "-n", "true")
    if probe.returncode != 0:
        return f"unshare -m -n refused: {probe.stderr.strip()}"
    return None


def _addresses(pid: int) -> tuple[str, str]:
    """A /30 of 10.231.0.0/16 for this process (two test sessions on one host differ)."""
    block = pid % 16384
    third, fourth = block // 64, (block % 64) * 4
    return f"10.231.{third}.{fourth + 1}", f"10.231.{third}.{fourth + 2}"


@contextmanager
def isolated_node_b() -> Iterator[NodeB | None]:
    """Node B's namespace for the block, or None (and nothing made) where ``why_not()``."""
    if why_not() is not None:
        yield None
        return
    pid = os.getpid()
    a_ip, b_ip = _addresses(pid)
    node = NodeB(f"loomrl-b-{pid}", a_ip, b_ip, f"lra{pid % 10**8}", f"lrb{pid % 10**8}")
    steps = [
        ("ip", "netns", "add", node.ns),
        ("ip", "link", "add", node.veth_a, "type", "veth", "peer", "name", node.veth_b),
        ("ip", "link", "set", node.veth_b, "netns", node.ns),
        ("ip", "addr", "add", f"{a_ip}/30", "dev", node.veth_a),
        ("ip", "link", "set", node.veth_a, "up"),
        ("ip", "netns", "exec", node.ns, "ip", "addr", "add", f"{b_ip}/30", "dev", node.veth_b),
        ("ip", "netns", "exec", node.ns, "ip", "link", "set", node.veth_b, "up"),
        ("ip", "netns", "exec", node.ns, "ip", "link", "set", "lo", "up"),
    ]
    try:
        for step in steps:
            done = _run(*step)
            if done.returncode != 0:
                raise RuntimeError(f"{' '.join(step)}: {done.stderr.strip()}")
        yield node
    finally:
        _remove(node)


def _remove(node: NodeB) -> None:
    """Ends what still runs in node B's namespace (only this test's processes live there),
    then removes the namespace and the host's end of the veth pair."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = [int(p) for p in _run("ip", "netns", "pids", node.ns).stdout.split()]
        for p in pids:
            try:
                os.kill(p, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10
        while pids and time.monotonic() < deadline:
            if not _run("ip", "netns", "pids", node.ns).stdout.split():
                break
            time.sleep(0.2)
    _run("ip", "netns", "del", node.ns)
    _run("ip", "link", "del", node.veth_a)
