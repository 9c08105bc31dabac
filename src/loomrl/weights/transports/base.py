"""The transport interface: ``send`` on the trainer side, ``receive`` on each generator."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from loomrl.weights.update import WeightUpdate


@dataclass
class TransferStats:
    bytes_sent: int = 0
    seconds: float = 0.0
    failures: int = 0


class Sender(ABC):
    stats: TransferStats

    @abstractmethod
    def send(self, update: WeightUpdate) -> None:
        """Make ``update`` available to every receiver."""


class Receiver(ABC):
    stats: TransferStats

    @abstractmethod
    def receive(self, have_version: int | None) -> WeightUpdate | None:
        """The next update that applies on top of ``have_version`` (a delta whose base is
        ``have_version``, or the latest full snapshot when a delta would not apply), or
        ``None`` when nothing newer is available. Never blocks."""


class Transport(ABC):
    name: str

    @abstractmethod
    def sender(self) -> Sender: ...

    @abstractmethod
    def receiver(self, rank: int = 0) -> Receiver: ...

    def close(self) -> None:  # noqa: B027
        """Release shared resources."""


def make_transport(kind: str, **kwargs) -> Transport:
    if kind == "inproc":
        from loomrl.weights.transports.inproc import InprocTransport

        return InprocTransport(**kwargs)
    raise ValueError(f"unknown or unavailable weight transport {kind!r}")
