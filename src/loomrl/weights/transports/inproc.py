"""In-process transport: receivers in the same process read the sender's latest updates."""

from __future__ import annotations

import threading
import time

from loomrl.weights.transports.base import Receiver, Sender, TransferStats, Transport
from loomrl.weights.update import WeightUpdate


class _Channel:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.latest_full: WeightUpdate | None = None
        self.deltas: dict[int, WeightUpdate] = {}  # base_version -> delta
        self.latest_version: int | None = None


class InprocSender(Sender):
    def __init__(self, channel: _Channel) -> None:
        self.channel = channel
        self.stats = TransferStats()

    def send(self, update: WeightUpdate) -> None:
        t0 = time.perf_counter()
        with self.channel.lock:
            if update.is_full:
                self.channel.latest_full = update
                self.channel.deltas.clear()
            else:
                self.channel.deltas[update.base_version] = update
            self.channel.latest_version = update.version
        self.stats.bytes_sent += update.nbytes
        self.stats.seconds += time.perf_counter() - t0


class InprocReceiver(Receiver):
    def __init__(self, channel: _Channel) -> None:
        self.channel = channel
        self.stats = TransferStats()

    def receive(self, have_version: int | None) -> WeightUpdate | None:
        with self.channel.lock:
            if self.channel.latest_version is None or self.channel.latest_version == have_version:
                return None
            if have_version is not None and have_version in self.channel.deltas:
                return self.channel.deltas[have_version]
            full = self.channel.latest_full
        if full is None or full.version == have_version:
            return None
        return full


class InprocTransport(Transport):
    name = "inproc"

    def __init__(self) -> None:
        self._channel = _Channel()

    def sender(self) -> Sender:
        return InprocSender(self._channel)

    def receiver(self, rank: int = 0) -> Receiver:
        return InprocReceiver(self._channel)
