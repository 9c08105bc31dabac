"""Transports move encoded weight updates from the trainer to generators."""

from loomrl.weights.transports.base import (
    Receiver,
    Sender,
    TransferStats,
    Transport,
    TransportError,
    UpdateRef,
    make_transport,
    select_update,
)

__all__ = [
    "Receiver",
    "Sender",
    "TransferStats",
    "Transport",
    "TransportError",
    "UpdateRef",
    "make_transport",
    "select_update",
]
