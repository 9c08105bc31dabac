"""The torch_dist rendezvous store as seen by another local user (issue 41, finding 1).

The store listens on loopback only when every rank is local, its keys live under a prefix
derived from a per-job secret, and a receiver treats what it reads there as untrusted: a
forged ``ready/<n> = close`` never stops it, and an announcement that does not match the
broadcast that follows is refused.
"""

from __future__ import annotations

import secrets
import socket
import threading
import time
from datetime import timedelta

import psutil
import pytest
import torch
import torch.distributed as dist

from loomrl.weights import encode_update
from loomrl.weights.transports import make_transport


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pair(port: int, secret: str | None):
    """A sender (rank 0, hosting the store) and one receiver (rank 1) over gloo."""
    kwargs = {
        "world_size": 2,
        "init_method": f"tcp://127.0.0.1:{port}",
        "backend": "gloo",
        "bucket_bytes": 4096,
        "timeout_s": 20.0,
        "secret": secret,
    }
    sides: list = [None, None]

    def join(rank: int) -> None:
        t = make_transport("torch_dist", rank=rank, **kwargs)
        sides[rank] = (t, t.sender() if rank == 0 else t.receiver())

    threads = [threading.Thread(target=join, args=(r,)) for r in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    return sides


def _state(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(16, 8, generator=gen), "b": torch.randn(8, generator=gen)}


def _wait_for(receiver, version: int, timeout_s: float = 20.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        update = receiver.receive(None)
        if update is not None and update.version >= version:
            return update
        time.sleep(0.02)
    return None


@pytest.fixture
def pair():
    port = _free_port()
    sides = _pair(port, secrets.token_hex(16))
    yield port, sides
    for t, _ in sides:
        t.close()


def test_store_listens_on_loopback_only_when_every_rank_is_local(pair):
    port, _ = pair
    listening = [
        c
        for c in psutil.Process().net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port
    ]
    assert listening, f"nothing of this process listens on port {port}"
    assert {c.laddr.ip for c in listening} == {"127.0.0.1"}, listening
    others = [
        a.address
        for addrs in psutil.net_if_addrs().values()
        for a in addrs
        if a.family == socket.AF_INET and not a.address.startswith("127.")
    ]
    for address in others:  # from a non-loopback address of this host: refused
        with pytest.raises(OSError), socket.create_connection((address, port), timeout=2):
            pass


def test_forged_close_keys_do_not_stop_the_receiver(pair):
    port, ((_, sender), (_, receiver)) = pair
    sender.send(encode_update(None, _state(0), version=0, base_version=None))
    assert _wait_for(receiver, 0) is not None
    # Another local user connects to the store and sets "close" where a receiver could look:
    # at the bare keys, under the transport's public prefix, and even under the receiver's
    # own (secret) prefix, as if that had leaked.
    intruder = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=5))
    for n in range(1, 8):
        intruder.set(f"ready/{n}", "close")
        intruder.set(f"loomrl-weights/ready/{n}", "close")
        receiver.group.store.set(f"ready/{n}", "close")
    time.sleep(0.5)
    assert receiver.thread.is_alive(), (
        f"the receiver stopped on a forged key (error: {receiver.error})"
    )
    sender.send(encode_update(None, _state(1), version=1, base_version=None))
    got = _wait_for(receiver, 1)
    assert got is not None and got.version == 1
    assert receiver.rejected_keys >= 1


def test_a_forged_update_key_cannot_slip_in_a_broadcast_it_does_not_match(pair):
    port, ((_, sender), (_, receiver)) = pair
    receiver.group.store.set("ready/1", "update")  # forged, unauthenticated: ignored
    time.sleep(0.3)
    sender.send(encode_update(None, _state(2), version=5, base_version=None))
    got = _wait_for(receiver, 5)
    assert got is not None and got.version == 5 and receiver.error is None


def test_the_senders_own_close_still_stops_the_receiver(pair):
    _, ((t0, _), (_, receiver)) = pair
    t0.close()  # the sender announces close, authenticated with the job's secret
    receiver.thread.join(timeout=5)
    assert not receiver.thread.is_alive() and receiver.error is None


def test_session_passes_a_fresh_secret_to_every_rank(tiny_job, tmp_path):
    from loomrl.weights.transports.setup import transport_args

    cfg = tiny_job(runtime="process", weight_sync={"transport": "torch_dist"})
    (_, a), (_, b) = (
        transport_args(
            cfg.weight_sync, run_dir=tmp_path, num_generators=1, in_process=False, device="cpu"
        )
        for _ in range(2)
    )
    assert isinstance(a["secret"], str) and len(a["secret"]) >= 32 and a["secret"] != b["secret"]
