"""One contract suite that every weight transport passes, plus cross-process checks."""

from __future__ import annotations

import socket
import threading
import time
import uuid

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from loomrl.weights import (
    WeightUpdate,
    WeightUpdateError,
    apply_update,
    encode_update,
    prepare_update,
    state_digest,
)
from loomrl.weights.manifest import bits_view
from loomrl.weights.publisher import Publisher, Subscriber
from loomrl.weights.tensors import pack_update
from loomrl.weights.transports import make_transport, select_update
from loomrl.weights.transports.base import UpdateRef

KINDS = ["inproc", "shm", "torch_dist", "files", "files-fsspec", "tensor-local", "tensor-gloo"]
NUM_RECEIVERS = 2


class Channel:
    """A sender and NUM_RECEIVERS receivers of one transport kind. The tensor lane carries
    full snapshots only (``full_only``): what the byte lanes get as a delta it gets whole."""

    def __init__(self, kind: str, tmp_path) -> None:
        self.kind = kind
        self.full_only = kind.startswith("tensor")
        self.transports = []
        if kind in ("torch_dist", "tensor-gloo"):
            self._build_dist()
            return
        if kind == "files":
            t = make_transport("files", path=str(tmp_path / "updates"))
        elif kind == "files-fsspec":
            t = make_transport("files", path=f"memory://loomrl-test-{uuid.uuid4().hex}")
        elif kind == "tensor-local":
            t = make_transport("tensor", mode="local")
        else:
            t = make_transport(kind)
        self.transports = [t]
        self.sender = t.sender()
        self.receivers = [t.receiver(rank) for rank in range(NUM_RECEIVERS)]

    def _build_dist(self) -> None:
        store, world = dist.HashStore(), NUM_RECEIVERS + 1
        sides: list = [None] * world

        def join(rank: int) -> None:
            lane = {"mode": "broadcast"} if self.kind == "tensor-gloo" else {}
            t = make_transport(
                "tensor" if lane else "torch_dist",
                rank=rank,
                world_size=world,
                store=store,
                backend="gloo",
                bucket_bytes=4096,
                **lane,
            )
            sides[rank] = (t, t.sender() if rank == 0 else t.receiver())

        threads = [threading.Thread(target=join, args=(r,)) for r in range(world)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        self.transports = [t for t, _ in sides]
        self.sender = sides[0][1]
        self.receivers = [side for _, side in sides[1:]]

    def encode(self, base, new, version: int, base_version: int | None):
        """``new`` as this lane sends it: a delta against ``base`` (byte lanes) or whole."""
        if self.full_only:
            return pack_update(new, torch.bfloat16, version)
        return encode_update(base, new, version=version, base_version=base_version)

    def close(self) -> None:
        for t in self.transports:
            t.close()
            if self.kind == "files-fsspec":
                t.fs.rm(t.root, recursive=True)

    def settle(self, version: int, timeout_s: float = 10.0) -> None:
        """Wait until every receiver sees ``version`` (torch_dist files updates from a thread)."""
        deadline = time.monotonic() + timeout_s
        for r in self.receivers:
            while max((ref.version for ref in r._list()), default=None) != version:
                assert time.monotonic() < deadline, f"version {version} never arrived"
                time.sleep(0.005)


def apply_any(state, update, have=None):
    """Verify and apply either lane's update (what a subscriber does)."""
    return update.prepare(state, have_version=None if update.is_full else have).commit(state)


@pytest.fixture(params=KINDS)
def channel(request, tmp_path):
    ch = Channel(request.param, tmp_path)
    yield ch
    ch.close()


def states(num: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Consecutive bf16 states: about 2% of the elements change per version."""
    rng = np.random.default_rng(seed)
    out = [
        {
            "w": torch.randn(64, 48, dtype=torch.float32).to(torch.bfloat16),
            "b": torch.randn(48).to(torch.bfloat16),
            "s": torch.tensor(0.5).to(torch.bfloat16),
        }
    ]
    for _ in range(num - 1):
        nxt = {k: v.clone() for k, v in out[-1].items()}
        bits = bits_view(nxt["w"])
        mask = rng.random(bits.size) < 0.02
        bits[mask] ^= rng.integers(1, 8, size=int(mask.sum()), dtype=bits.dtype)
        nxt["s"] = nxt["s"] + 1
        out.append(nxt)
    return out


def publish(channel, seq, plan: str) -> list[WeightUpdate]:
    """Send ``seq[v]`` as version v for each letter of ``plan`` (F: full, D: delta) through
    a ``Channel`` or a byte lane's bare sender."""
    updates = []
    sender = getattr(channel, "sender", channel)
    for v, kind in enumerate(plan):
        base, base_version = (seq[v - 1], v - 1) if kind == "D" else (None, None)
        if isinstance(channel, Channel):
            u = channel.encode(base, seq[v], v, base_version)
        else:
            u = encode_update(base, seq[v], version=v, base_version=base_version)
        sender.send(u)
        updates.append(u)
    return updates


def catch_up(receiver, state, have, target, timeout_s: float = 10.0):
    """Receive and apply until ``target``; every delta must be for the version we hold."""
    deadline = time.monotonic() + timeout_s
    while have != target and time.monotonic() < deadline:
        u = receiver.receive(have, timeout_s=0.2)
        if u is None:
            continue
        if not u.is_full:
            assert u.base_version == have, f"delta {u.base_version}->{u.version} handed to {have}"
        apply_any(state, u, have)
        have = u.version
    return have


def test_nothing_before_the_first_send(channel):
    for r in channel.receivers:
        assert r.receive(None) is None


def test_full_then_deltas_reach_every_receiver(channel):
    seq = states(5)
    publish(channel, seq, "FDDDD")
    for r in channel.receivers:
        state: dict[str, torch.Tensor] = {}
        assert catch_up(r, state, None, 4) == 4
        assert state_digest(state) == state_digest(seq[4])
        assert r.receive(4) is None  # up to date


def test_step_by_step_each_receiver_gets_the_delta_for_its_version(channel):
    seq = states(4)
    holders = [({}, None) for _ in channel.receivers]
    for v, kind in enumerate("FDDD"):
        publish_one = channel.encode(
            seq[v - 1] if kind == "D" else None, seq[v], v, v - 1 if kind == "D" else None
        )
        channel.sender.send(publish_one)
        for i, r in enumerate(channel.receivers):
            state, have = holders[i]
            u = r.receive(have, timeout_s=10)
            whole = kind == "F" or channel.full_only
            assert u is not None and u.version == v and u.base_version == (None if whole else have)
            apply_any(state, u, have)
            holders[i] = (state, v)
            assert state_digest(state) == state_digest(seq[v])


def test_missed_versions_fall_back_to_the_latest_full_snapshot(channel):
    seq = states(7)
    publish(channel, seq, "FDDFDDD")
    channel.settle(6)
    r = channel.receivers[0]
    latest_full = 6 if channel.full_only else 3
    first = r.receive(None, timeout_s=10)
    assert first is not None and first.is_full and first.version == latest_full
    ahead = r.receive(42)  # a receiver ahead of the sender (restarted trainer): snapshot
    assert ahead is not None and ahead.is_full and ahead.version == latest_full
    for have in (None, 0, 1, 2, 3, 4, 5, 17):
        u = r.receive(have)
        assert u is not None
        assert u.is_full or u.base_version == have
    assert r.receive(6) is None
    state = {k: v.clone() for k, v in seq[1].items()}
    assert catch_up(r, state, 1, 6) == 6
    assert state_digest(state) == state_digest(seq[6])


def test_stats_count_bytes_updates_and_seconds(channel):
    updates = publish(channel, states(3), "FDD")
    s = channel.sender.stats
    fulls = 3 if channel.full_only else 1
    assert s.bytes_sent == sum(u.nbytes for u in updates)
    assert (s.num_updates, s.num_fulls, s.failures) == (3, fulls, 0) and s.seconds > 0
    channel.settle(2)
    r = channel.receivers[0]
    assert catch_up(r, {}, None, 2) == 2
    if channel.full_only:  # the latest snapshot only: what it missed it never needs
        assert r.stats.num_updates == 1 and r.stats.bytes_received == updates[-1].nbytes
        return
    assert r.stats.num_updates == 3 and r.stats.num_fulls == 1
    assert r.stats.bytes_received == sum(u.nbytes for u in updates)


def _poll_until(sub, mirror, have, done) -> int | None:
    deadline = time.monotonic() + 10
    while not done(have) and time.monotonic() < deadline:
        u, _ = sub.poll(mirror, have)
        have = u.version if u is not None else have
    return have


def test_corrupted_update_is_rejected_counted_and_recovered(channel):
    seq = states(4)
    sub = Subscriber(channel.receivers[0])
    mirror = {k: torch.zeros_like(v) for k, v in seq[0].items()}
    channel.sender.send(channel.encode(None, seq[0], 0, None))
    have = _poll_until(sub, mirror, None, lambda h: h == 0)
    assert have == 0 and state_digest(mirror) == state_digest(seq[0])
    bad = channel.encode(seq[0], seq[1], 1, 0)
    if channel.full_only:  # one byte of the device buffer, after the sender's digest
        bad.flat[bad.nbytes // 2] ^= 0xFF
    else:
        payload = bytearray(bad.payload)
        payload[len(payload) // 2] ^= 0xFF
        bad.payload = payload
    channel.sender.send(bad)
    have = _poll_until(sub, mirror, have, lambda h: sub.failures > 0)
    assert have == 0 and state_digest(mirror) == state_digest(seq[0])
    assert sub.failures >= 1  # the bad update was rejected; the mirror stayed at version 0
    channel.sender.send(channel.encode(None, seq[2], 2, None))
    have = _poll_until(sub, mirror, have, lambda h: h == 2)
    assert have == 2 and state_digest(mirror) == state_digest(seq[2])


def test_publisher_and_subscriber_over_the_transport(channel):
    torch.manual_seed(0)
    master = {"w": torch.randn(128, 64), "b": torch.zeros(64)}
    pub = Publisher(channel.sender, codec="delta", full_every=3)
    subs = [Subscriber(r) for r in channel.receivers]
    mirrors = [
        {k: torch.zeros(v.shape, dtype=torch.bfloat16) for k, v in master.items()} for _ in subs
    ]
    haves = [None] * len(subs)
    for v in range(6):
        master["w"] += 1e-3 * torch.randn_like(master["w"])
        metrics = pub.publish(master, v)
        assert metrics["weight_sync/is_full"] == float(v % 3 == 0 or channel.full_only)
        for i, sub in enumerate(subs):
            deadline = time.monotonic() + 10
            while haves[i] != v and time.monotonic() < deadline:
                u, _ = sub.poll(mirrors[i], haves[i])
                haves[i] = u.version if u is not None else haves[i]
            expected = {k: t.to(torch.bfloat16) for k, t in master.items()}
            assert state_digest(mirrors[i]) == state_digest(expected)


# -- rules and transport-specific failure handling ----------------------------------------


def test_select_update_rules():
    refs = [UpdateRef(3, None), UpdateRef(4, 3), UpdateRef(5, 4), UpdateRef(2, 1)]
    assert select_update([], None) is None
    assert select_update(refs, None).version == 3
    assert select_update(refs, 3).version == 4
    assert select_update(refs, 1) == UpdateRef(2, 1)  # a retained delta beats a snapshot
    assert select_update(refs, 0).version == 3
    assert select_update(refs, 5) is None
    assert select_update(refs, 9).version == 3  # sender behind the receiver
    assert select_update([UpdateRef(3, None), UpdateRef(5, 4)], 3) is None  # gap


def _corrupt_stored_manifest(kind: str, t) -> None:
    if kind == "shm":
        data = t._owned[0].data.bytes
        data[20:24] ^= 0xFF  # inside the first snapshot's manifest
    else:
        path = sorted(t.fs.ls(t.root, detail=False))[0]
        raw = bytearray(t.fs.cat_file(path))
        raw[20] ^= 0xFF
        t.fs.pipe_file(path, bytes(raw))


@pytest.mark.parametrize("kind", ["shm", "files"])
def test_corrupted_stored_bytes_are_counted_and_skipped(kind, tmp_path):
    t = make_transport(kind, **({"path": str(tmp_path)} if kind == "files" else {}))
    try:
        sender, receiver = t.sender(), t.receiver()
        seq = states(2)
        sender.send(encode_update(None, seq[0], version=0, base_version=None))
        _corrupt_stored_manifest(kind, t)
        assert receiver.receive(None) is None
        assert receiver.stats.failures >= 1
        sender.send(encode_update(None, seq[1], version=1, base_version=None))
        u = receiver.receive(None)
        assert u is not None and u.version == 1
    finally:
        t.close()


def test_files_keep_recent_snapshots_and_their_deltas(tmp_path):
    t = make_transport("files", path=str(tmp_path), keep_fulls=2)
    publish(t.sender(), states(7), "FDFDFDD")
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [
        "v000000000002-full.lwu",
        "v000000000003-from000000000002.lwu",
        "v000000000004-full.lwu",
        "v000000000005-from000000000004.lwu",
        "v000000000006-from000000000005.lwu",
    ]


def test_shm_regrows_when_the_model_grows():
    t = make_transport("shm")
    try:
        sender, receiver = t.sender(), t.receiver()
        small = {"w": torch.ones(10)}
        big = {"w": torch.ones(10), "x": torch.ones(300_000)}
        sender.send(encode_update(None, small, version=0, base_version=None))
        sender.send(encode_update(None, big, version=1, base_version=None))
        state: dict[str, torch.Tensor] = {}
        apply_update(state, receiver.receive(None))
        assert state_digest(state) == state_digest(big)
    finally:
        t.close()


@pytest.mark.parametrize("path", ["apply_update", "prepare_update", "poll", "poll-prefetch"])
def test_a_corrupt_payload_is_never_applied_by_any_path(path):
    seq = states(2)
    bad = encode_update(seq[0], seq[1], version=1, base_version=0)
    data = bytearray(bad.to_bytes())
    data[-3] ^= 1
    corrupt = WeightUpdate.from_bytes(bytes(data))
    state = {k: v.clone() for k, v in seq[0].items()}
    if path == "apply_update":
        with pytest.raises(WeightUpdateError):
            apply_update(state, corrupt)
    elif path == "prepare_update":  # decode and verify come before anything is written
        with pytest.raises(WeightUpdateError):
            prepare_update(state, corrupt, have_version=0)
    else:  # a generator's subscriber, polling inline or prefetching in the background
        t = make_transport("inproc")
        t.sender().send(corrupt)
        sub = Subscriber(t.receiver(0), prefetch=path == "poll-prefetch")
        try:
            deadline = time.monotonic() + 5
            while sub.failures == 0 and time.monotonic() < deadline:
                assert sub.poll(state, 0)[0] is None
                time.sleep(0.01)
            assert sub.failures >= 1 and sub.poll(state, 0)[0] is None  # seen, refused, not retried
        finally:
            sub.close()
    assert state_digest(state) == state_digest(seq[0])


# -- across processes -----------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _remote_receiver(kind: str, kwargs: dict, last: int, results) -> None:
    torch.set_num_threads(1)
    if kwargs.get("backend") == "nccl":
        torch.cuda.set_device(kwargs["rank"])  # NCCL: a GPU per rank
    t = make_transport(kind, **kwargs)
    receiver = t.receiver(1)
    state: dict[str, torch.Tensor] = {}
    have = catch_up(receiver, state, None, last, timeout_s=60)
    results.put((have, state_digest(state)))
    t.close()


def test_torch_dist_auto_is_gloo():
    """NCCL refuses two ranks on one GPU, as a job's executors sit on a one-GPU host."""
    t = make_transport("torch_dist", world_size=3, store=dist.HashStore())
    assert t.backend == "gloo"


@pytest.mark.parametrize(
    "kind", ["shm", "torch_dist", pytest.param("torch_dist-nccl", marks=pytest.mark.gpu)]
)
def test_receiver_in_another_process(kind):
    seq = states(4, seed=7)
    if kind == "torch_dist-nccl" and torch.cuda.device_count() < 2:
        pytest.skip("NCCL needs a GPU per rank")
    if kind == "shm":
        kwargs = {"name": f"test-{_free_port()}"}
    else:
        kwargs = {
            "world_size": 2,
            "init_method": f"tcp://127.0.0.1:{_free_port()}",
            "backend": "nccl" if kind == "torch_dist-nccl" else "gloo",
            "bucket_bytes": 1024,
        }
        kind = "torch_dist"
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    local = make_transport(kind, **kwargs)
    remote_kwargs = kwargs | ({"rank": 1} if kind == "torch_dist" else {})
    proc = ctx.Process(target=_remote_receiver, args=(kind, remote_kwargs, 3, results))
    if kind == "shm":
        sender = local.sender()  # create the channel before the receiver looks for it
        proc.start()
    else:
        proc.start()
        sender = local.sender()  # blocks until the receiver joined the group
    try:
        publish(sender, seq, "FDDD")
        have, digest = results.get(timeout=120)
        assert have == 3 and digest == state_digest(seq[3])
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
        local.close()
