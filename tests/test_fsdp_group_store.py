"""The sharded trainer's rendezvous store as another party sees it (issue 49, item 2).

torch's own store (``init_method="tcp://..."``) listens on the wildcard address, so every
host and local user could list and overwrite the ranks' keys. The trainer's ranks now meet
at a store loomrl makes (``loomrl.runtime.group_store``): on loopback when every rank is on
this host, its keys under a prefix derived from a per-job secret."""

from __future__ import annotations

import secrets
import socket
from datetime import timedelta
from types import SimpleNamespace

import psutil
import pytest
from spawned import end_rank

pytestmark = pytest.mark.timeout(120)


def _non_loopback_addresses() -> list[str]:
    return [
        a.address
        for addrs in psutil.net_if_addrs().values()
        for a in addrs
        if a.family == socket.AF_INET and not a.address.startswith("127.")
    ]


def _probe(port: int) -> dict:
    """What another party finds at the store's port, seen from rank 0's process."""
    import torch.distributed as dist

    listening = [
        c.laddr.ip
        for c in psutil.Process().net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port
    ]
    reached = []
    for address in _non_loopback_addresses():
        try:
            socket.create_connection((address, port), timeout=2).close()
            reached.append(address)
        except OSError:
            pass
    client = dist.TCPStore(
        "127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=5)
    )
    return {
        "listening": sorted(set(listening)),
        "tried": _non_loopback_addresses(),
        "reached": reached,
        "keys": client.list_keys(),
    }


def _rank(rank: int, rendezvous: str, secret: str, out: str) -> None:
    """One rank (torch.multiprocessing.spawn) joining as the sharded trainer's ranks do."""
    import json

    from loomrl.training.fsdp import ShardedTrainerExecutor

    executor = ShardedTrainerExecutor.__new__(ShardedTrainerExecutor)
    executor.rank, executor.world_size, executor.group_secret = rank, 2, secret
    cfg = SimpleNamespace(
        model=SimpleNamespace(device="cpu"),
        runtime="process",
        trainer=SimpleNamespace(parallel=SimpleNamespace(collective_timeout_s=60)),
    )
    executor._join_group(cfg, rendezvous)
    if rank == 0:
        found = _probe(int(rendezvous.rsplit(":", 1)[1]))
        with open(out, "w") as f:
            json.dump(found, f)
    end_rank()


def test_the_trainer_group_store_is_on_loopback_with_secret_keys(tmp_path):
    import json

    import torch.multiprocessing as mp

    from loomrl.runtime.group import new_rendezvous
    from loomrl.runtime.group_store import GROUP_NAMESPACE, store_prefix

    secret, out = secrets.token_hex(32), tmp_path / "rank0.json"
    mp.spawn(_rank, (new_rendezvous("127.0.0.1"), secret, str(out)), nprocs=2)
    found = json.loads(out.read_text())
    assert found["listening"] == ["127.0.0.1"], found
    assert found["reached"] == [], "the store answered on a non-loopback address"
    prefix = store_prefix(GROUP_NAMESPACE, secret) + "/"
    assert found["keys"], "the group left no key to look at"
    assert all(key.startswith(prefix) for key in found["keys"]), found["keys"]
    assert not any(secret in key for key in found["keys"])
    if not found["tried"]:
        pytest.skip("this host has no non-loopback IPv4 address to connect from")


def test_each_trainer_group_gets_a_fresh_secret(monkeypatch):
    from loomrl.training import fsdp

    factories = []
    monkeypatch.setattr(
        fsdp, "start_group", lambda rt, name, factory, *a: factories.append(factory)
    )
    cfg = SimpleNamespace(trainer=SimpleNamespace(parallel=SimpleNamespace(dp_shard=2)))
    for _ in range(2):
        fsdp.start_trainer_group(None, cfg, None)
    secrets_given = {factory(1, 2, "tcp://127.0.0.1:1").args[2] for factory in factories}
    assert len(secrets_given) == 2
    assert all(isinstance(s, str) and len(s) == 64 for s in secrets_given)
