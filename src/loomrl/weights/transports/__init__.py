"""Transports move encoded weight updates from the trainer to generators."""

from loomrl.weights.transports.base import (
    Receiver,
    Sender,
    TransferStats,
    Transport,
    TransportError,
    UpdateRef,
    select_update,
)
from loomrl.weights.transports.registry import (
    TransportSpec,
    make_transport,
    open_transport,
)

__all__ = [
    "Receiver",
    "Sender",
    "TransferStats",
    "Transport",
    "TransportSpec",
    "TransportError",
    "UpdateRef",
    "make_transport",
    "open_transport",
    "select_update",
]
