"""In-process transport: receivers in the same process read the sender's latest updates.

Updates are handed over as objects (no serialization); the channel keeps the latest full
snapshot and the deltas after it.
"""

from __future__ import annotations

import logging

from loomrl.weights.transports.base import Sender, TransferStats, Transport
from loomrl.weights.transports.store import StoreReceiver, UpdateStore
from loomrl.weights.update import WeightUpdate

__all__ = ["InprocReceiver", "InprocSender", "InprocTransport", "UpdateStore"]

logger = logging.getLogger(__name__)


class InprocSender(Sender):
    def __init__(self, store: UpdateStore) -> None:
        self.store = store
        self.stats = TransferStats()

    def _put(self, update: WeightUpdate) -> None:
        self.store.put(update)


class InprocReceiver(StoreReceiver):
    def __init__(self, store: UpdateStore) -> None:
        self.store = store
        self.stats = TransferStats()


class InprocTransport(Transport):
    name = "inproc"

    def __init__(self) -> None:
        self._store = UpdateStore()

    def sender(self) -> InprocSender:
        return InprocSender(self._store)

    def receiver(self, rank: int = 0) -> InprocReceiver:
        return InprocReceiver(self._store)
