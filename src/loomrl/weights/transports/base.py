"""The transport interface: ``send`` on the trainer side, ``receive`` on each generator.

Every transport keeps (at least) the latest full snapshot and the chain of deltas after it.
A receiver at version ``have`` is handed, in this order of preference:

1. nothing, when ``have`` is the latest version;
2. the delta whose base is ``have``;
3. the latest full snapshot, when it is not ``have`` and either newer than ``have`` or the
   sender is behind the receiver (a restarted trainer);
4. nothing otherwise (a gap: the next full snapshot will close it).

So a receiver that missed versions falls back to the latest full snapshot and never gets a
delta for another base. Each side counts bytes, seconds, updates and failures in
``TransferStats``. All transports pass the one contract suite in ``tests/test_weights_transports.py``.
"""

from __future__ import annotations

import logging
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from loomrl.weights.update import WeightUpdate, WeightUpdateError

logger = logging.getLogger(__name__)


class TransportError(RuntimeError):
    """A transport could not move an update (too large for its buffers, peer gone, ...)."""


@dataclass
class TransferStats:
    """Counters of one side of a transport (the receiver counts received bytes in
    ``bytes_received``)."""

    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0
    failures: int = 0
    num_updates: int = 0
    num_fulls: int = 0  # full snapshots among the updates


@dataclass(frozen=True)
class UpdateRef:
    """Where a transport keeps one update: its versions and a transport-specific key."""

    version: int
    base_version: int | None
    key: Any = None

    @property
    def is_full(self) -> bool:
        return self.base_version is None


def select_update(refs: Iterable[UpdateRef], have_version: int | None) -> UpdateRef | None:
    """The update to hand a receiver at ``have_version`` (the rule in the module docstring)."""
    refs = list(refs)
    if not refs:
        return None
    latest = max(r.version for r in refs)
    if have_version is not None and have_version == latest:
        return None
    if have_version is not None and have_version < latest:
        deltas = [r for r in refs if r.base_version == have_version and r.version > have_version]
        if deltas:
            return max(deltas, key=lambda r: r.version)
    fulls = [r for r in refs if r.is_full]
    if not fulls:
        return None
    full = max(fulls, key=lambda r: r.version)
    if have_version is None or (
        full.version != have_version and (full.version > have_version or have_version > latest)
    ):
        return full
    return None


class BufferPool:
    """Receive buffers reused once nothing references them any more (the update that used
    one was dropped), so a receiver does not page-fault fresh memory on every update."""

    def __init__(self, max_buffers: int = 4) -> None:
        self.max_buffers = max_buffers
        self.buffers: list[bytearray] = []

    def get(self, nbytes: int) -> memoryview:
        """A writable buffer of exactly ``nbytes`` (a view of a pooled ``bytearray``)."""
        free = [b for b in self.buffers if len(b) >= nbytes and sys.getrefcount(b) <= 3]
        if free:  # referenced only by the list, `free` and getrefcount's argument
            return memoryview(min(free, key=len))[:nbytes]  # best fit: deltas keep small ones
        busy = [b for b in self.buffers if sys.getrefcount(b) > 3]
        buf = bytearray(nbytes)
        self.buffers = [*busy[-(self.max_buffers - 1) :], buf] if self.max_buffers > 1 else [buf]
        return memoryview(buf)[:nbytes]


class Sender(ABC):
    """Trainer side: makes each update available to every receiver."""

    stats: TransferStats
    # True where the publisher hands this sender device tensors to ``pack`` instead of an
    # encoded ``WeightUpdate`` (the tensor lane, ``transports/tensor.py``)
    carries_tensors: bool = False

    def send(self, update: WeightUpdate) -> None:
        """Make ``update`` available to every receiver; raises ``TransportError`` on failure
        (counted in ``stats.failures``)."""
        t0 = time.perf_counter()
        try:
            self._put(update)
        except Exception:
            self.stats.failures += 1
            raise
        self.stats.seconds += time.perf_counter() - t0
        self.stats.bytes_sent += update.nbytes
        self.stats.num_updates += 1
        self.stats.num_fulls += int(update.is_full)

    @abstractmethod
    def _put(self, update: WeightUpdate) -> None: ...

    def close(self) -> None:  # noqa: B027
        """Release this side's resources."""


class Receiver(ABC):
    """Generator side: hands out the next applicable update, never blocking by default."""

    stats: TransferStats
    poll_interval_s: float = 0.001

    def receive(self, have_version: int | None, timeout_s: float = 0.0) -> WeightUpdate | None:
        """The next update that applies on top of ``have_version`` (a delta whose base is
        ``have_version``, or the latest full snapshot when a delta would not apply), or
        ``None`` when nothing newer is available. Waits up to ``timeout_s`` (0: never blocks)."""
        deadline = time.perf_counter() + timeout_s
        while True:
            update = self._receive_once(have_version)
            if update is not None or time.perf_counter() >= deadline:
                return update
            self._wait(min(self.poll_interval_s, max(0.0, deadline - time.perf_counter())))

    def _receive_once(self, have_version: int | None) -> WeightUpdate | None:
        t0 = time.perf_counter()
        tried: set = set()
        for _ in range(4):  # a fetched update may have been overwritten or be corrupt: retry
            ref = select_update(
                [r for r in self._list() if (r.version, r.base_version) not in tried], have_version
            )
            if ref is None:
                return None
            try:
                update = self._fetch(ref)
            except WeightUpdateError as err:
                self.stats.failures += 1
                logger.warning("%s: rejected update %s: %s", type(self).__name__, ref, err)
                tried.add((ref.version, ref.base_version))
                continue
            if update is None:  # gone while reading (overwritten, deleted): look again
                continue
            if (update.version, update.base_version) != (ref.version, ref.base_version):
                self.stats.failures += 1
                logger.warning(
                    "%s: %s holds update %s->%s",
                    type(self).__name__,
                    ref,
                    update.base_version,
                    update.version,
                )
                tried.add((ref.version, ref.base_version))
                continue
            self.stats.seconds += time.perf_counter() - t0
            self.stats.bytes_received += update.nbytes
            self.stats.num_updates += 1
            self.stats.num_fulls += int(update.is_full)
            return update
        return None

    @abstractmethod
    def _list(self) -> list[UpdateRef]:
        """The updates available now."""

    @abstractmethod
    def _fetch(self, ref: UpdateRef) -> WeightUpdate | None:
        """Read one update; None when it vanished meanwhile; ``WeightUpdateError`` if corrupt."""

    def _wait(self, seconds: float) -> None:
        time.sleep(seconds)

    def close(self) -> None:  # noqa: B027
        """Release this side's resources."""


class Transport(ABC):
    """A channel from one sender to any number of receivers."""

    name: str

    @abstractmethod
    def sender(self) -> Sender: ...

    @abstractmethod
    def receiver(self, rank: int = 0) -> Receiver: ...

    def close(self) -> None:  # noqa: B027
        """Release shared resources."""
