"""The torch_dist weight group forms in two stages (issue 54, item 2): every rank arrives at
the store, waiting as long as the transfer timeout allows (a generator may load its model
for minutes), then gloo connects the ranks within ``CONNECT_TIMEOUT_S``. A group whose
store is reached but whose gloo ports are not fails in seconds, naming the stage."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from loomrl.runtime.group import free_port
from loomrl.weights.transports import torch_dist
from loomrl.weights.transports.base import TransportError

pytestmark = pytest.mark.timeout(120)


def _stores(n: int) -> list[dist.Store]:
    port = free_port("127.0.0.1")
    timeout = timedelta(seconds=60)
    host = dist.TCPStore("127.0.0.1", port, None, True, timeout, wait_for_workers=False)
    return [host] + [dist.TCPStore("127.0.0.1", port, None, False, timeout) for _ in range(n - 1)]


def _in_threads(*calls):
    """Run each call in a thread; their results (or the exception each raised)."""
    out: list = [None] * len(calls)

    def run(i, call):
        try:
            out[i] = call()
        except Exception as err:  # noqa: BLE001 - handed to the test
            out[i] = err

    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(calls)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=100)
    return out


def _group(store: dist.Store, rank: int, timeout_s: float) -> torch_dist._Group:
    t = torch_dist.TorchDistTransport(
        rank=rank, world_size=2, store=store, backend="gloo", timeout_s=timeout_s
    )
    return torch_dist._Group(t)


def test_a_rank_later_than_the_connect_bound_still_joins_and_a_slow_transfer_completes(
    monkeypatch,
):
    monkeypatch.setattr(torch_dist, "CONNECT_TIMEOUT_S", 1.0)
    stores = _stores(2)

    def late_rank():
        time.sleep(3.0)  # past the connect bound: a generator still loading its model
        return _group(stores[1], 1, 30.0)

    g0, g1 = _in_threads(lambda: _group(stores[0], 0, 30.0), late_rank)
    assert isinstance(g0, torch_dist._Group) and isinstance(g1, torch_dist._Group)
    sent, got = torch.arange(6.0), torch.zeros(6)

    def late_receive():
        time.sleep(3.0)  # a transfer longer than the group's connect bound
        g1.broadcast(got)

    assert _in_threads(lambda: g0.broadcast(sent), late_receive) == [None, None]
    assert torch.equal(got, sent)


def test_a_rank_that_reaches_the_store_but_not_gloo_fails_in_seconds(monkeypatch):
    monkeypatch.setattr(torch_dist, "CONNECT_TIMEOUT_S", 2.0)
    stores = _stores(2)
    prefix = torch_dist._store_prefix(None)
    dist.PrefixStore(prefix, stores[1]).set("arrived/1", "1")  # arrives, never connects
    t0 = time.monotonic()
    (err,) = _in_threads(lambda: _group(stores[0], 0, 60.0))
    waited = time.monotonic() - t0
    assert isinstance(err, TransportError), err
    assert "reached its store, but gloo could not connect rank 0" in str(err)
    assert "GLOO_SOCKET_IFNAME" in str(err)
    assert waited < 30.0  # the connect bound, not the 60 s transfer timeout


def test_a_rank_that_never_arrives_is_named():
    stores = _stores(2)
    t0 = time.monotonic()
    (err,) = _in_threads(lambda: _group(stores[0], 0, 2.0))
    assert isinstance(err, TransportError), err
    assert "rank(s) [1] of the weight group did not reach its store within 2 s" in str(err)
    assert time.monotonic() - t0 < 30.0
