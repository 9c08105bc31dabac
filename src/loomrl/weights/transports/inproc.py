"""In-process transport: receivers in the same process read the sender's latest updates.

Updates are handed over as objects (no serialization); the channel keeps the latest full
snapshot and the deltas after it.
"""

from __future__ import annotations

import logging
import threading

from loomrl.weights.transports.base import (
    Receiver,
    Sender,
    TransferStats,
    Transport,
    UpdateRef,
)
from loomrl.weights.update import WeightUpdate

logger = logging.getLogger(__name__)


class UpdateStore:
    """Thread-safe store of the latest full snapshot and the chain of deltas after it."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.updates: dict[tuple[int, int | None], WeightUpdate] = {}

    def put(self, update: WeightUpdate) -> None:
        with self.cond:
            if update.is_full:
                self.updates.clear()
            self.updates[(update.version, update.base_version)] = update
            self.cond.notify_all()

    def refs(self) -> list[UpdateRef]:
        with self.cond:
            return [UpdateRef(v, b, (v, b)) for v, b in self.updates]

    def get(self, ref: UpdateRef) -> WeightUpdate | None:
        with self.cond:
            return self.updates.get(ref.key)

    def wait(self, seconds: float) -> None:
        with self.cond:
            self.cond.wait(seconds)


class InprocSender(Sender):
    def __init__(self, store: UpdateStore) -> None:
        self.store = store
        self.stats = TransferStats()

    def _put(self, update: WeightUpdate) -> None:
        self.store.put(update)


class InprocReceiver(Receiver):
    def __init__(self, store: UpdateStore) -> None:
        self.store = store
        self.stats = TransferStats()

    def _list(self) -> list[UpdateRef]:
        return self.store.refs()

    def _fetch(self, ref: UpdateRef) -> WeightUpdate | None:
        return self.store.get(ref)

    def _wait(self, seconds: float) -> None:
        self.store.wait(seconds)


class InprocTransport(Transport):
    name = "inproc"

    def __init__(self) -> None:
        self._store = UpdateStore()

    def sender(self) -> InprocSender:
        return InprocSender(self._store)

    def receiver(self, rank: int = 0) -> InprocReceiver:
        return InprocReceiver(self._store)
