"""Quick proofs, run on the cluster's nodes, that the job's weights can travel between them,
so that a job which cannot work fails in seconds with the reason instead of waiting at step 0:

- ``files_blind_nodes``: which nodes do not see a folder the controller wrote in (the
  ``files`` transport's folder: a marker file read back by a task on each node);
- ``unreachable_nodes``: which nodes cannot open a TCP connection to the trainer's node
  address (where a ``torch_dist`` group meets): a listener on the trainer's node, a
  connection from each other node;
- ``node_down``: why a node that lost an executor is dead or dying (Ray marks it dead, or a
  task pinned to it does not answer in seconds), before its replacement is placed.

Tasks and the listener ask for no CPU, so they run even where the job's actors hold every
CPU of a node, and are pinned to their node (``NodeAffinitySchedulingStrategy``).
"""

from __future__ import annotations

import socket
import threading
import time
import uuid
from collections.abc import Iterable
from pathlib import Path

import ray

from loomrl.runtime.group import free_port

PROBE_TIMEOUT_S = 60.0  # a probe task's start on a loaded node included
CONNECT_TIMEOUT_S = 10.0  # a node that cannot connect within this, retrying, cannot reach
NODE_ANSWER_S = 15.0  # a node whose pinned task does not answer within this is dying


def _pinned(node_id: str) -> dict:
    # lazy: ray is optional (the ray extra)
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=False)}


@ray.remote(num_cpus=0)
def _reads(path: str, token: str) -> bool:
    try:
        return Path(path).read_text() == token
    except OSError:
        return False


def files_blind_nodes(
    folder: str, node_ids: Iterable[str], timeout_s: float = PROBE_TIMEOUT_S
) -> list[str]:
    """The nodes of ``node_ids`` that do not see the controller's ``folder``: it writes a
    marker there and a task on each other node reads it back."""
    here = ray.get_runtime_context().get_node_id()
    others = sorted(set(node_ids) - {here})
    if not others:
        return []
    token = uuid.uuid4().hex
    marker = Path(folder) / f".loomrl-node-probe-{token[:8]}"
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(token)
    try:
        probes = [_reads.options(**_pinned(n)).remote(str(marker), token) for n in others]
        seen = ray.get(probes, timeout=timeout_s)
    finally:
        marker.unlink(missing_ok=True)
    return [node for node, ok in zip(others, seen, strict=True) if not ok]


def connect_error(host: str, port: int, timeout_s: float = CONNECT_TIMEOUT_S) -> str | None:
    """Why a TCP connection to ``host:port`` fails, retried until ``timeout_s``; None once
    one opens."""
    deadline, why = time.monotonic() + timeout_s, "no attempt"
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(2.0, left))):
                return None
        except OSError as err:
            why = f"{type(err).__name__}: {err}"
        if time.monotonic() + 0.2 >= deadline:
            return why
        time.sleep(0.2)


@ray.remote(num_cpus=0)
def _connects(host: str, port: int, timeout_s: float) -> str | None:
    return connect_error(host, port, timeout_s)


class _Listener:
    """Accepts (and closes) connections on ``host``, on a port of its own."""

    def __init__(self, host: str) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        try:  # the rendezvous' own range (below the ephemeral ports), as the group uses
            self.sock.bind((host, free_port(host)))
        except OSError:  # taken since the check: any port still proves the route
            self.sock.bind((host, 0))
        self.sock.listen(128)
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            conn.close()

    def port(self) -> int:
        return self.sock.getsockname()[1]


_LISTENER = ray.remote(num_cpus=0)(_Listener)


def unreachable_nodes(
    host_node: str, host: str, node_ids: Iterable[str], timeout_s: float = PROBE_TIMEOUT_S
) -> dict[str, str]:
    """``{node: why}`` for each node of ``node_ids`` that cannot open a TCP connection to
    ``host`` (the address of node ``host_node``, where a listener runs for the probe)."""
    others = sorted(set(node_ids) - {host_node})
    if not others:
        return {}
    listener = _LISTENER.options(**_pinned(host_node)).remote(host)
    try:
        port = ray.get(listener.port.remote(), timeout=timeout_s)
        probes = [
            _connects.options(**_pinned(n)).remote(host, port, CONNECT_TIMEOUT_S) for n in others
        ]
        answers = ray.get(probes, timeout=timeout_s)
    finally:
        ray.kill(listener, no_restart=True)
    return {node: why for node, why in zip(others, answers, strict=True) if why is not None}


@ray.remote(num_cpus=0)
def _answers() -> bool:
    return True


def node_down(node_id: str, timeout_s: float = NODE_ANSWER_S) -> str | None:
    """Why node ``node_id`` is dead or dying, or None where it answers: Ray's own view
    first (a node it marked dead), then a task pinned to it (a raylet that died moments ago
    is still listed alive for Ray's health-check period, and a replacement scheduled there
    would wait for it, then die with it)."""
    for node in ray.nodes():
        if node["NodeID"] == node_id and not node["Alive"]:
            return "Ray marks it dead"
    try:
        ray.get(_answers.options(**_pinned(node_id)).remote(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        return f"a task pinned to it did not answer within {timeout_s:g} s"
    except Exception as err:  # noqa: BLE001 - unschedulable, or the node died under it
        return f"a task pinned to it failed ({type(err).__name__}: {err})"
    return None
