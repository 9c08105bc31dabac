"""Which weight transport a job's placement allows, on a runtime whose executors may sit on
several nodes (``runtime = "ray"``).

Pure decisions over node ids, so that they are tested without a cluster; the ray runtime
(``loomrl.runtime.ray``) feeds them where its actors are, or will be:

- ``choose_transport``: before the executors start, a job that named no transport gets
  ``shm`` where the trainer and the generators share one node, and one that crosses
  machines where they may not (``torch_dist``; ``files`` beside a sharded trainer, whose
  ranks cannot join a weight group).
- ``refusal``: once they started, why the transport cannot reach the generators from the
  trainer's node (shared memory or CUDA IPC between nodes, a ``files`` folder a node does not
  see), naming the nodes and the transport to use; None where it can.

Only the trainer and the generators hold weight-transport ends; scorers may sit anywhere.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from loomrl.runtime.base import role_of

WEIGHT_ROLES = ("trainer", "generator")


class PlacementError(RuntimeError):
    """The job's executors sit where its weight transport cannot reach them."""


def weight_nodes(placement: Mapping[str, str]) -> dict[str, str]:
    """``{executor: node}`` of the executors that hold an end of the weight transport."""
    return {name: node for name, node in placement.items() if role_of(name) in WEIGHT_ROLES}


def spans_nodes(placement: Mapping[str, str]) -> bool:
    """Whether the trainer and the generators of ``placement`` sit on more than one node."""
    return len(set(weight_nodes(placement).values())) > 1


def choose_transport(
    kind: str,
    *,
    defaulted: bool,
    planned: Mapping[str, str] | None,
    alive_nodes: int,
    trainer_group: bool = False,
) -> str:
    """The transport a job runs with: ``kind``, unless the job named none (``defaulted``,
    so ``kind`` is the one-host default ``shm``) and its executors may land on several
    nodes: those of ``planned`` (``{executor: node}``, from a placement group), or, with no
    plan, any of the cluster's ``alive_nodes``. Then ``torch_dist``, or ``files`` with a
    sharded trainer (``trainer_group``: its ranks cannot also join a weight group)."""
    if not defaulted or kind != "shm":
        return kind
    may_span = spans_nodes(planned) if planned is not None else alive_nodes > 1
    if not may_span:
        return kind
    return "files" if trainer_group else "torch_dist"


def _one_host_reason(kind: str, kwargs: Mapping[str, Any], blind: Collection[str]) -> str | None:
    if kind == "shm":
        return "shared memory reaches one machine only"
    if kind == "tensor" and kwargs.get("mode") in ("ipc", "local"):
        return "CUDA IPC reaches one machine only"
    if kind == "files" and blind:
        return (
            f"its folder {kwargs.get('path')} is not seen from node(s) {', '.join(sorted(blind))}"
        )
    return None


def one_host_only(kind: str, kwargs: Mapping[str, Any]) -> bool:
    """Whether transport ``kind`` reaches executors on its sender's machine alone (``shm``,
    CUDA IPC), so that a replaced generator must start on the node the others use."""
    return _one_host_reason(kind, kwargs, ()) is not None


def transport_label(kind: str, kwargs: Mapping[str, Any]) -> str:
    """``'shm'``, ``"tensor (mode 'ipc')"``, ``"files (path '/runs/x/weight_updates')"``."""
    if kind == "tensor":
        return f"tensor (mode {kwargs.get('mode')!r})"
    if kind == "files":
        return f"files (path {kwargs.get('path')!r})"
    return kind


def refusal(
    kind: str,
    kwargs: Mapping[str, Any],
    placement: Mapping[str, str],
    blind: Collection[str] = (),
) -> str | None:
    """Why transport ``kind`` (its ``kwargs``, as ``transport_args`` built them) cannot carry
    weights between the executors of ``placement`` (``{executor: node}``); None where it can.
    ``blind``: the nodes that do not see a ``files`` folder (the runtime probes them)."""
    nodes = weight_nodes(placement)
    if len(set(nodes.values())) < 2:
        return None
    reason = _one_host_reason(kind, kwargs, blind)
    if reason is None:
        return None
    where = ", ".join(f"{name} on node {node}" for name, node in nodes.items())
    return (
        f"weight_sync.transport={transport_label(kind, kwargs)} cannot reach the generators: {reason}, "
        f"and the trainer and the generators sit on {len(set(nodes.values()))} nodes ({where}); use "
        "weight_sync.transport='torch_dist' (or leave it unset on runtime 'ray' to have it chosen), "
        "or 'files' with a weight_sync.transport.path every node sees (docs/cluster.md)"
    )
