"""The network interface gloo (and NCCL) bind to on a Ray node.

Without ``GLOO_SOCKET_IFNAME`` gloo binds to the address the machine's hostname resolves to,
``127.0.0.1`` in many containers and Debian-style hosts: a group across nodes then fails
``Gloo connectFullMesh failed ... Connection refused``. Ray already knows the address other
nodes reach this one at (the raylet's ``--node-ip-address``); every Ray executor actor names
the interface that holds it before any group forms (``bind_groups_to_node_address``), the
same for the weight transport's group and a sharded trainer's ranks, in ``GLOO_SOCKET_IFNAME``
and, for NCCL's bootstrap on GPUs, ``NCCL_SOCKET_IFNAME``. A value the user set is kept (each
variable on its own); a loopback node address (a one-node cluster) leaves both as they are.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

import psutil

logger = logging.getLogger(__name__)

GLOO_IFNAME = "GLOO_SOCKET_IFNAME"
NCCL_IFNAME = "NCCL_SOCKET_IFNAME"  # NCCL's bootstrap and socket transport (GPUs)
IFNAME_VARS = (GLOO_IFNAME, NCCL_IFNAME)


def interface_holding(address: str, table: Mapping[str, Sequence[Any]]) -> str | None:
    """The name of the interface in ``table`` (``psutil.net_if_addrs()``: name -> addresses
    with ``.family`` and ``.address``) that holds ``address``; None where none does or the
    address is a loopback one."""
    if _is_loopback(address):
        return None
    try:
        wanted = ipaddress.ip_address(address)
    except ValueError:
        return None
    for name in sorted(table):
        for entry in table[name]:
            if entry.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            try:  # (an IPv6 link-local address carries its zone: fe80::1%eth0)
                held = ipaddress.ip_address(str(entry.address).split("%")[0])
            except ValueError:
                continue
            if held == wanted:
                return name
    return None


def bind_groups_to_node_address(
    address: str,
    environ: MutableMapping[str, str] = os.environ,
    table: Mapping[str, Sequence[Any]] | None = None,
) -> dict[str, str]:
    """Set ``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME`` in ``environ``, each where the
    user set none, to the interface that holds ``address``, this Ray node's
    (``ray.util.get_node_ip_address()``; interfaces from ``psutil.net_if_addrs()``); the
    variables set, with the interface."""
    unset = [var for var in IFNAME_VARS if not environ.get(var)]
    if not unset:
        return {}
    name = interface_holding(address, psutil.net_if_addrs() if table is None else table)
    if name is None:
        if not _is_loopback(address):
            logger.warning(
                "no network interface holds this Ray node's address %s: gloo and NCCL keep their "
                "own choice (set %s on each `ray start` if groups across nodes fail to connect)",
                address,
                " and ".join(unset),
            )
        return {}
    chosen = dict.fromkeys(unset, name)
    environ.update(chosen)
    logger.info(
        "%s bind to %s, the interface of this Ray node's address %s",
        ", ".join(unset),
        name,
        address,
    )
    return chosen


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return address == "localhost"
