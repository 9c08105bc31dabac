"""Transport over a ``torch.distributed`` group: the sender (rank 0) broadcasts each update.

The group is gloo (``backend="auto"``) or NCCL when ``backend="nccl"`` (a GPU per rank), and
is built for this transport alone (its own store prefix), so it does not disturb a
training job's default process group. Per update the sender sets a store key
``ready/<n>`` (so idle receivers wait on the store, with no collective timing out), then
broadcasts ``[header_len, payload_len]``, the header, and the payload in buckets of
``bucket_bytes`` (zero-copy views on CPU; one reused device bucket with NCCL).

Each receiver runs a thread that takes part in every broadcast and files the update into
a local store (latest full snapshot plus the deltas after it), so ``receive`` never
blocks. The sender blocks until every receiver has joined the broadcast.

The store is untrusted ground (docs/security.md): when every rank is on this host it
listens on loopback only (torch binds the wildcard address, so rank 0 binds the socket
itself and hands it over); with a per-job ``secret`` its keys live under a prefix derived
from the secret, and every announcement carries an HMAC of ``(n, kind, version, digest)``
under the secret. A receiver acts on no announcement that does not verify, never stops for
good on a key alone, and files an update only when the broadcast carried the version and
digest that were announced.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import threading
import warnings
from datetime import timedelta
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from loomrl.runtime.group_store import store_prefix, tcp_store
from loomrl.weights.transports.base import (
    BufferPool,
    Sender,
    TransferStats,
    Transport,
    TransportError,
)
from loomrl.weights.transports.store import StoreReceiver, UpdateStore
from loomrl.weights.update import WeightUpdate, WeightUpdateError

logger = logging.getLogger(__name__)

_PREFIX = "loomrl-weights"
# Once every rank has arrived at the store, gloo's own connections (a port of its own on each
# rank's interface) open in well under a second on any network; this bounds a group that
# cannot form (a firewall, the wrong interface) to seconds instead of the transfer timeout.
CONNECT_TIMEOUT_S = 30.0


def _as_uint8(buffer: bytes | bytearray | memoryview) -> torch.Tensor:
    if len(buffer) == 0:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():  # read-only buffers: the sender only reads them
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buffer, dtype=torch.uint8)


def _tcp_store(host: str, port: int, t: TorchDistTransport, timeout: timedelta) -> dist.TCPStore:
    """The rendezvous store at ``host:port``, hosted by rank 0, on loopback alone where the
    group meets there (``loomrl.runtime.group_store``)."""
    return tcp_store(host, port, t.rank, t.world_size, timeout)


def _store_prefix(secret: str | None) -> str:
    """Keys under a name only the job's ranks can derive (``group_store.store_prefix``)."""
    return store_prefix(_PREFIX, secret)


def _sign(secret: str | None, count: int, body: str) -> str:
    """``body`` as announced at ``ready/<count>``, with an HMAC under the job's secret."""
    if secret is None:
        return f"{body}|"
    mac = hmac.new(secret.encode(), f"{count}|{body}".encode(), hashlib.sha256).hexdigest()
    return f"{body}|{mac}"


def _verify(secret: str | None, count: int, value: str) -> tuple[str, bool]:
    """The announced body and whether it is authenticated (never, without a secret)."""
    body, _, mac = value.rpartition("|")
    if secret is None or not mac:
        return body or value, False
    return body, hmac.compare_digest(_sign(secret, count, body), value)


def _arrive(store: dist.Store, rank: int, world_size: int, timeout_s: float) -> None:
    """Stage one of forming the group, for every backend: this rank marks its arrival in
    the store and waits for the others up to ``timeout_s`` (a generator may load its model
    for minutes); ranks that never come are named."""
    store.set(f"arrived/{rank}", "1")
    keys = [f"arrived/{r}" for r in range(world_size)]
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
    except RuntimeError as err:  # DistStoreError, DistNetworkError, gloo's own
        missing = [r for r, key in enumerate(keys) if not store.check([key])]
        raise TransportError(
            f"torch_dist: rank(s) {missing} of the weight group did not reach its store within "
            f"{timeout_s:g} s (weight_sync.transport.timeout_s): {err}"
        ) from err


def _gloo_group(store: dist.Store, rank: int, world_size: int, timeout_s: float):
    """The gloo group, formed in two stages so that each failure names itself: every rank
    arrives at the store (``_arrive``), then gloo connects the ranks to each other within
    ``CONNECT_TIMEOUT_S``. A store reached while gloo's own ports are not (a firewall that
    lets the rendezvous port through, an interface the other nodes cannot reach) fails in
    seconds with the reason, not after the transfer timeout."""
    _arrive(store, rank, world_size, timeout_s)
    connect = min(timeout_s, CONNECT_TIMEOUT_S)
    try:
        return dist.ProcessGroupGloo(store, rank, world_size, timedelta(seconds=connect))
    except RuntimeError as err:  # DistStoreError, DistNetworkError, gloo's own
        ifname = os.environ.get("GLOO_SOCKET_IFNAME") or "unset (the hostname's address)"
        raise TransportError(
            f"torch_dist: all {world_size} ranks of the weight group reached its store, but "
            f"gloo could not connect rank {rank} to the others within {connect:g} s "
            f"({type(err).__name__}: {err}); gloo opens ports of its own on each rank's "
            f"interface (GLOO_SOCKET_IFNAME here: {ifname}): open TCP between the nodes' "
            "addresses beyond the rendezvous port, or name the interface (docs/cluster.md)"
        ) from err


class _Group:
    """A process group plus its store and the device the bytes travel on."""

    def __init__(self, t: TorchDistTransport) -> None:
        timeout = timedelta(seconds=t.timeout_s)
        store = t.store
        if store is None:
            url = urlparse(t.init_method)
            store = _tcp_store(url.hostname, url.port, t, timeout)
        self.secret = t.secret
        self.store = dist.PrefixStore(_store_prefix(t.secret), store)
        backend = t.backend
        if backend == "auto":
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        self.device = torch.device("cpu")
        if t.group is not None:
            self.pg = t.group
        elif backend == "gloo":
            self.pg = _gloo_group(self.store, t.rank, t.world_size, t.timeout_s)
        elif backend == "nccl":
            self.device = torch.device("cuda", torch.cuda.current_device())
            # (NCCL connects lazily, at the first transfer, bounded by the transfer timeout)
            _arrive(self.store, t.rank, t.world_size, t.timeout_s)
            self.pg = dist.ProcessGroupNCCL(self.store, t.rank, t.world_size)
        else:
            raise ValueError(f"torch_dist backend must be gloo, nccl or auto, got {backend!r}")
        self.op_timeout = timeout  # each transfer's own (the group's is the connect bound)
        self.bucket = None
        if self.device.type != "cpu":
            self.bucket = torch.empty(t.bucket_bytes, dtype=torch.uint8, device=self.device)

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Broadcast ``tensor`` from rank 0 in place; NCCL moves device memory only, so a host
        tensor (the sizes, the header) travels through a device copy of itself."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.timeout = self.op_timeout
        if self.device.type == "cpu" or tensor.device == self.device:
            self.pg.broadcast([tensor], opts).wait()
            return
        staged = tensor.to(self.device)
        self.pg.broadcast([staged], opts).wait()
        tensor.copy_(staged)

    def move(self, cpu: torch.Tensor, bucket_bytes: int, sending: bool) -> None:
        """Broadcast ``cpu`` (filled on the sender, written on receivers) in buckets."""
        for start in range(0, cpu.numel(), bucket_bytes):
            part = cpu[start : start + bucket_bytes]
            if self.bucket is None:
                self.broadcast(part)
                continue
            dev = self.bucket[: part.numel()]
            if sending:
                dev.copy_(part)
            self.broadcast(dev)
            if not sending:
                part.copy_(dev)


class TorchDistSender(Sender):
    def __init__(self, t: TorchDistTransport) -> None:
        self.t = t
        self.stats = TransferStats()
        self.group = _Group(t)
        self.lock = threading.Lock()
        self.count = 0

    def _announce(self, kind: str, update: WeightUpdate | None = None) -> None:
        """Set ``ready/<n>``, signed with the job's secret; an update names its version and
        digest, which the receivers check against what the broadcast carries."""
        self.count += 1
        body = kind if update is None else f"{kind}:{update.version}:{update.digest}"
        self.group.store.set(f"ready/{self.count}", _sign(self.group.secret, self.count, body))

    def _put(self, update: WeightUpdate) -> None:
        header, payload = update.frames()
        with self.lock:
            self._announce("update", update)
            self.group.broadcast(torch.tensor([len(header), len(payload)], dtype=torch.int64))
            self.group.move(_as_uint8(header).clone(), self.t.bucket_bytes, sending=True)
            self.group.move(_as_uint8(payload), self.t.bucket_bytes, sending=True)

    def close(self) -> None:
        with self.lock:  # receivers stop on the signed store key, no collective needed
            self._announce("close")


class TorchDistReceiver(StoreReceiver):
    secret: str | None = None  # the job's secret; None: the store is trusted as it is
    rejected_keys = 0  # announcements that did not verify (forged, or from before a restart)

    def __init__(self, t: TorchDistTransport) -> None:
        self.t, self.secret = t, t.secret
        self.stats = TransferStats()
        self.store = UpdateStore()
        self.pool = BufferPool()
        self.group = _Group(t)
        self.stop = threading.Event()
        self.error: str | None = None  # why the receiving thread stopped for good, if it did
        self.thread = threading.Thread(target=self._run, name="loomrl-weights-recv", daemon=True)
        self.thread.start()

    def _next(self, count: int) -> str | None:
        """Wait for the sender's next announcement, polling the store (a store ``wait``
        that times out logs a warning each time) with a backoff of at most 5 ms."""
        key, sleep_s = f"ready/{count}", 0.0002
        while not self.stop.is_set():
            if self.group.store.check([key]):
                return self.group.store.get(key).decode()
            self.stop.wait(sleep_s)
            sleep_s = min(sleep_s * 2, 0.005)
        return None

    def _next_verified(self, count: int) -> str | None:
        """The body of the ``count``-th announcement once it verifies; None when this
        receiver is closed, or on the sender's own (authenticated) close. A value that does
        not verify is logged and waited out: the sender's own announcement replaces it."""
        rejected: set[str] = set()
        while (value := self._next(count)) is not None:
            body, authentic = _verify(self.secret, count, value)
            if body == "close" and authentic:
                return None
            if body.startswith("update") and (authentic or self.secret is None):
                return body
            if self.secret is not None and value not in rejected:
                rejected.add(value)
                self.rejected_keys += 1
                logger.warning(
                    "torch_dist: ignored an announcement at ready/%d that does not verify (%.40r); "
                    "someone else wrote to the weight group's store",
                    count,
                    value,
                )
            # without a secret, a close cannot be told from a forged one: stay until closed
            self.stop.wait(0.005 if self.secret is not None else 0.05)
        return None

    def _check_announced(self, body: str, update: WeightUpdate) -> None:
        """What the broadcast carried is what was announced (``update:<version>:<digest>``)."""
        _, _, rest = body.partition(":")
        if not rest:  # no secret, an announcement without them: nothing to compare
            return
        version, _, digest = rest.partition(":")
        if version != str(update.version) or digest != update.digest:
            raise WeightUpdateError(
                f"broadcast carried update {update.version} ({update.digest[:12]}), but update {version} "
                f"({digest[:12]}) was announced"
            )

    def _receive_one(self) -> WeightUpdate:
        meta = torch.empty(2, dtype=torch.int64)
        self.group.broadcast(meta)
        header_len, payload_len = (int(x) for x in meta)
        header = torch.empty(header_len, dtype=torch.uint8)
        payload = self.pool.get(payload_len)  # reused once the previous update is dropped
        self.group.move(header, self.t.bucket_bytes, sending=False)
        self.group.move(_as_uint8(payload), self.t.bucket_bytes, sending=False)
        return WeightUpdate.from_frames(memoryview(header.numpy()), payload)

    def _run(self) -> None:
        count = 0
        while not self.stop.is_set():
            count += 1
            announced = self._next_verified(count)
            if announced is None:
                return
            try:
                update = self._receive_one()
                self._check_announced(announced, update)
            except WeightUpdateError as err:
                self.stats.failures += 1
                logger.warning("torch_dist: rejected an update: %s", err)
                continue
            except Exception as err:  # noqa: BLE001 - the group is broken (peer gone, timeout): stop here
                self.stats.failures += 1
                self.error = f"{type(err).__name__}: {err}"
                logger.error(
                    "torch_dist receiver stopped: %s; no further weight updates arrive", self.error
                )
                return
            self.store.put(update)

    def _receive_once(self, have_version: int | None) -> WeightUpdate | None:
        """As for every receiver; but once the group broke and nothing newer is stored,
        raise instead of letting the generator run on stale weights in silence."""
        update = super()._receive_once(have_version)
        if update is None and self.error is not None:
            raise TransportError(
                f"torch_dist receiver stopped after {self.error}; this generator can get no new weights "
                "(restart the job; `loomrl resume` continues it)"
            )
        return update

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)


def _resolve_backend(backend: str, world_size: int) -> str:
    """``auto`` is gloo: NCCL refuses two ranks on one GPU ("Duplicate GPU detected"), which
    is how a job's executors sit on a one-GPU host, and each rank's device is its current
    one. Ask for ``nccl`` where every rank has a GPU of its own."""
    if backend == "nccl" and torch.cuda.is_available() and world_size > torch.cuda.device_count():
        logger.warning(
            "torch_dist: %d ranks over %d GPUs; NCCL needs a GPU per rank",
            world_size,
            torch.cuda.device_count(),
        )
    return "gloo" if backend == "auto" else backend


class TorchDistTransport(Transport):
    """One process's end of the weight group: ``rank`` 0 sends, ranks 1.. receive.

    Give either a ``store`` (any ``torch.distributed.Store``), an ``init_method``
    (``tcp://host:port``; rank 0 hosts the store), or an existing ``group``. The group is
    built by ``sender()`` / ``receiver()``, which block until every rank has joined.
    ``secret`` (the same on every rank, from the job; never in a URL or on a command line)
    hides the group's keys in the store and signs every announcement; without it the store
    is trusted as it is, and a receiver stops only when it is closed or its group breaks.
    """

    name = "torch_dist"
    # the tensor lane's broadcast mode sends tensors
    sender_class: type[TorchDistSender] = TorchDistSender
    receiver_class: type[TorchDistReceiver] = TorchDistReceiver

    def __init__(
        self,
        *,
        rank: int = 0,
        world_size: int = 2,
        init_method: str | None = None,
        store: dist.Store | None = None,
        group: dist.ProcessGroup | None = None,
        backend: str = "auto",
        bucket_bytes: int = 64 << 20,
        timeout_s: float = 600.0,
        secret: str | None = None,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        if init_method is None and store is None and group is None:
            raise ValueError(
                "torch_dist transport needs init_method='tcp://host:port', a store "
                "or a group, and one TorchDistTransport(rank=...) per process"
            )
        self.rank, self.world_size = rank, world_size
        self.init_method, self.store, self.group = init_method, store, group
        self.backend, self.bucket_bytes, self.timeout_s = (
            _resolve_backend(backend, world_size),
            bucket_bytes,
            timeout_s,
        )
        self._sides: list = []
        self.secret = secret

    def sender(self) -> TorchDistSender:
        if self.rank != 0:
            raise ValueError(f"only rank 0 sends weight updates; this is rank {self.rank}")
        side = self.sender_class(self)
        self._sides.append(side)
        return side

    def receiver(self, rank: int = 0) -> TorchDistReceiver:
        """This process's receiver (its rank was fixed at construction; ``rank`` is unused)."""
        if self.rank == 0:
            raise ValueError("rank 0 is the sender; receivers are ranks 1..world_size-1")
        side = self.receiver_class(self)
        self._sides.append(side)
        return side

    def close(self) -> None:
        for side in reversed(self._sides):
            side.close()
        self._sides.clear()
