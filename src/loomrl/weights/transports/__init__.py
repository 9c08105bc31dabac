"""Transports move encoded weight updates from the trainer to generators."""

from loomrl.weights.transports.base import Receiver, Sender, Transport, make_transport

__all__ = ["Receiver", "Sender", "Transport", "make_transport"]
