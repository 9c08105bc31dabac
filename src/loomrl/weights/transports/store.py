"""The store an in-process channel keeps: the latest full snapshot and the deltas after it.

Shared by ``inproc`` (the sender's updates, handed over as objects) and ``torch_dist``
(updates filed by each rank's receiving thread).
"""

from __future__ import annotations

import threading

from loomrl.weights.transports.base import Receiver, UpdateRef
from loomrl.weights.update import WeightUpdate


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


class StoreReceiver(Receiver):
    """A receiver whose updates are filed in an ``UpdateStore`` in this process
    (``self.store``): it lists, reads and waits on the store."""

    store: UpdateStore

    def _list(self) -> list[UpdateRef]:
        return self.store.refs()

    def _fetch(self, ref: UpdateRef) -> WeightUpdate | None:
        return self.store.get(ref)

    def _wait(self, seconds: float) -> None:
        self.store.wait(seconds)
