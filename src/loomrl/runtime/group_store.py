"""The rendezvous store a group of torch.distributed ranks meets at, made by loomrl.

torch's ``TCPStore`` server binds the wildcard address whatever host it is given, so every
host and every local user could list, read and overwrite the ranks' keys and push data into
rank 0. Each group that loomrl forms (the sharded trainer's, the weight transport's) goes
through here instead:

- on a loopback rendezvous (every rank on this host) rank 0 binds the listening socket to
  that address itself and hands it to the store (``master_listen_fd``): no other host can
  reach it;
- every key lives under a prefix derived from a per-job secret (``store_prefix``), so a
  client without the secret does not know where the keys are, and what it sets elsewhere is
  never read (on a cluster, where the store listens on the node's address, this is what
  keeps another party's keys out).

``docs/security.md`` has what is left open (another local user can still connect on
loopback).
"""

from __future__ import annotations

import hashlib
import ipaddress
import socket
from datetime import timedelta
from urllib.parse import urlparse

import torch.distributed as dist

# the keys of a group that ``init_process_group`` below forms (the trainer's ranks)
GROUP_NAMESPACE = "loomrl-group"


def is_loopback(host: str | None) -> bool:
    """Whether ``host`` names a loopback address (``127.0.0.1``, ``::1``, ``localhost``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host or "").is_loopback
    except ValueError:
        return False


def tcp_store(
    host: str, port: int, rank: int, world_size: int, timeout: timedelta
) -> dist.TCPStore:
    """The store at ``host:port``, hosted by rank 0: listening on ``host`` alone where it is
    a loopback address, on torch's wildcard address otherwise (a cluster)."""
    if rank != 0 or not is_loopback(host):
        return dist.TCPStore(host, port, world_size, rank == 0, timeout)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(max(128, world_size))
    except OSError as err:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port} for a group's store: {err}") from None
    # the store owns the listening socket from here on
    fd = sock.detach()
    return dist.TCPStore(host, port, world_size, True, timeout, master_listen_fd=fd)


def store_prefix(namespace: str, secret: str | None) -> str:
    """Keys under a name only the job's ranks can derive: not the secret itself (the
    store's traffic is plain text on a cluster, and a secret may also sign values)."""
    if secret is None:
        return namespace
    return f"{namespace}/{hashlib.sha256(f'prefix:{secret}'.encode()).hexdigest()[:32]}"


def group_store(
    rendezvous: str,
    rank: int,
    world_size: int,
    secret: str | None,
    timeout: timedelta,
    namespace: str,
) -> dist.Store:
    """The store of the group meeting at ``rendezvous`` (``tcp://host:port``), its keys under
    ``namespace`` and the secret's prefix; hand it to ``init_process_group(store=...)``."""
    url = urlparse(rendezvous)
    if url.scheme != "tcp" or url.hostname is None or url.port is None:
        raise ValueError(f"a group's rendezvous must be tcp://host:port, got {rendezvous!r}")
    store = tcp_store(url.hostname, url.port, rank, world_size, timeout)
    return dist.PrefixStore(store_prefix(namespace, secret), store)


def init_process_group(
    backend: str,
    rendezvous: str,
    rank: int,
    world_size: int,
    secret: str | None,
    timeout: timedelta,
) -> None:
    """``torch.distributed.init_process_group`` at ``rendezvous`` over the store above (keys
    under ``loomrl-group/<secret's prefix>``). torch offers no way to close a ``TCPStore``
    while its group holds it (NCCL makes communicators through it lazily); the server ends
    when the group is destroyed and the last reference to the store goes."""
    store = group_store(rendezvous, rank, world_size, secret, timeout, namespace=GROUP_NAMESPACE)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
