"""gloo bound to the interface that holds the Ray node's address (issue 54, item 3;
``loomrl.runtime.netif``), over a mocked ``psutil.net_if_addrs()`` table."""

from __future__ import annotations

import socket
from collections import namedtuple

import psutil
import pytest

from loomrl.runtime.netif import (
    GLOO_IFNAME,
    NCCL_IFNAME,
    bind_groups_to_node_address,
    interface_holding,
)

Addr = namedtuple("Addr", "family address netmask broadcast ptp")

TABLE = {
    "lo": [
        Addr(socket.AF_INET, "127.0.0.1", None, None, None),
        Addr(socket.AF_INET6, "::1", None, None, None),
    ],
    "eth0": [
        Addr(psutil.AF_LINK, "02:fc:00:00:00:01", None, None, None),
        Addr(socket.AF_INET, "10.1.2.3", "255.255.0.0", None, None),
        Addr(socket.AF_INET6, "fe80::fc:ff:fe00:1%eth0", None, None, None),
    ],
    "ib0": [Addr(socket.AF_INET, "10.9.0.7", None, None, None)],
}


@pytest.fixture
def fake_psutil(monkeypatch):
    monkeypatch.setattr(psutil, "net_if_addrs", lambda: TABLE)


def test_the_interface_holding_the_node_address_is_chosen(fake_psutil):
    environ: dict[str, str] = {}
    both = {GLOO_IFNAME: "eth0", NCCL_IFNAME: "eth0"}
    assert bind_groups_to_node_address("10.1.2.3", environ) == both
    assert environ == both
    environ = {}
    assert bind_groups_to_node_address("10.9.0.7", environ) == {
        GLOO_IFNAME: "ib0",
        NCCL_IFNAME: "ib0",
    }
    assert environ == {GLOO_IFNAME: "ib0", NCCL_IFNAME: "ib0"}
    # an IPv6 address held with its zone
    assert interface_holding("fe80::fc:ff:fe00:1", TABLE) == "eth0"


def test_a_loopback_node_address_leaves_gloo_unset(fake_psutil):
    for address in ("127.0.0.1", "::1", "localhost"):
        environ: dict[str, str] = {}
        assert bind_groups_to_node_address(address, environ) == {}
        assert environ == {}


def test_the_users_interface_is_never_overridden(fake_psutil):
    environ = {GLOO_IFNAME: "bond0"}  # each variable on its own: NCCL's is still set
    assert bind_groups_to_node_address("10.1.2.3", environ) == {NCCL_IFNAME: "eth0"}
    assert environ == {GLOO_IFNAME: "bond0", NCCL_IFNAME: "eth0"}
    environ = {GLOO_IFNAME: "bond0", NCCL_IFNAME: "ib0"}
    assert bind_groups_to_node_address("10.1.2.3", environ) == {}
    assert environ == {GLOO_IFNAME: "bond0", NCCL_IFNAME: "ib0"}


def test_an_address_no_interface_holds_leaves_gloo_unset_with_a_warning(fake_psutil, caplog):
    environ: dict[str, str] = {}
    with caplog.at_level("WARNING", logger="loomrl.runtime.netif"):
        assert bind_groups_to_node_address("192.168.5.5", environ) == {}
    assert environ == {} and "192.168.5.5" in caplog.text and GLOO_IFNAME in caplog.text
    assert interface_holding("not-an-address", TABLE) is None
