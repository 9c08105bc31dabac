"""The job's weight transport, built from its ``[weight_sync.transport]`` table.

``transport_args`` turns the table into the kind and keyword arguments every end of the
transport is built from (one branch per transport ``type``); ``transport_ends`` hands the
trainer and each generator its end: the one transport object where executors are threads
of this process, or ``(kind, kwargs)`` for an executor in another process to build its own.
"""

from __future__ import annotations

import secrets
import socket
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loomrl.weights.config import WeightSyncConfig
from loomrl.weights.transports.registry import TransportSpec, make_transport
from loomrl.weights.transports.tensor import choose_lane


def _free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _group_args(bucket_mb: int, backend: str, host: str, world_size: int) -> dict[str, Any]:
    """A torch_dist group of the trainer (rank 0) and the generators, meeting at ``host``."""
    return {
        "init_method": f"tcp://{host}:{_free_loopback_port()}",  # free here; elsewhere, likely free
        "world_size": world_size,
        "bucket_bytes": bucket_mb << 20,
        "backend": backend,
        # hides and signs the group's store keys (docs/security.md)
        "secret": secrets.token_hex(32),
    }


def transport_args(
    ws: WeightSyncConfig,
    *,
    run_dir: Path,
    num_generators: int,
    in_process: bool,
    device: str,
    host: str = "127.0.0.1",
) -> tuple[str, dict[str, Any]]:
    """The transport kind and the arguments shared by all its ends (the job's config already
    checked that the transport fits the runtime). ``in_process``: executors are threads of
    this process; ``device``: ``model.device``, which picks the tensor lane's mode."""
    t = ws.transport
    if t.type == "files":
        return "files", {
            "path": t.path or str(run_dir / "weight_updates"),
            "keep_fulls": t.keep_fulls,
        }
    if t.type == "shm":
        return "shm", {"name": uuid.uuid4().hex[:16]}
    if t.type == "torch_dist":
        return "torch_dist", _group_args(t.bucket_mb, t.backend, host, 1 + num_generators)
    # its mode (local, ipc, broadcast), or the byte lane where it cannot work
    if t.type == "tensor":
        kind, mode = choose_lane(t.mode, in_process=in_process, device=device)
        group = (
            _group_args(t.bucket_mb, t.backend, host, 1 + num_generators)
            if t.mode == "broadcast"
            else {}
        )
        return kind, {**group, **mode}
    return "inproc", {}


@dataclass(frozen=True)
class TransportEnds:
    """What each executor is built with: the trainer's end, generator ``rank``'s end
    (ranks from 1), and what cleans the transport up after them all."""

    trainer: TransportSpec
    generator: Callable[[int], TransportSpec]
    cleanup: Callable[[], None]


def transport_ends(kind: str, kwargs: dict[str, Any], *, in_process: bool) -> TransportEnds:
    """Threads of one process share one transport object; separate processes each build
    their own end from ``(kind, kwargs)`` (a group member with its rank)."""
    if in_process:
        transport = make_transport(kind, **kwargs)
        return TransportEnds(transport, lambda rank: transport, transport.close)

    def end(rank: int) -> TransportSpec:
        return (kind, {**kwargs, "rank": rank} if "world_size" in kwargs else kwargs)

    def unlink() -> None:  # a named channel (shm, an ipc mailbox) outlives its processes
        make_transport(kind, **kwargs).unlink()

    return TransportEnds(end(0), end, unlink if "name" in kwargs else (lambda: None))
