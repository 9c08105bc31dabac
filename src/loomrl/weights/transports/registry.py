"""Transports by name: ``make_transport("shm", ...)``.

The registry maps a name to where its class lives (``module:Class``), imported only when a
transport of that kind is built: the interface in ``base.py`` knows none of its
implementations, and a new transport (Ray's object store, NCCL) is one more file and one
line in ``_REGISTRY`` (and its name in ``weight_sync.transport``).
"""

from __future__ import annotations

import importlib
from typing import Any

from loomrl.weights.transports.base import Transport

_REGISTRY: dict[str, str] = {
    "inproc": "loomrl.weights.transports.inproc:InprocTransport",
    "shm": "loomrl.weights.transports.shm:ShmTransport",
    "torch_dist": "loomrl.weights.transports.torch_dist:TorchDistTransport",
    "files": "loomrl.weights.transports.files:FilesTransport",
    "tensor": "loomrl.weights.transports.tensor:TensorTransport",
}


def make_transport(kind: str, **kwargs: Any) -> Transport:
    """Build a transport by name: ``inproc``, ``shm``, ``torch_dist``, ``files`` or ``tensor``."""
    try:
        target = _REGISTRY[kind]
    except KeyError:
        raise ValueError(
            f"unknown weight transport {kind!r}; expected one of {', '.join(_REGISTRY)}"
        ) from None
    module, _, name = target.partition(":")
    cls = getattr(importlib.import_module(module), name)
    return cls(**kwargs)


# Where an executor is built: a transport object shared with the controller (threads of
# one process), or ``(kind, kwargs)`` for the executor to build its own end (a process).
TransportSpec = Transport | tuple[str, dict]


def open_transport(spec: TransportSpec) -> tuple[Transport, bool]:
    """The transport ``spec`` names, and whether it was built here (then the executor that
    holds it closes it)."""
    if isinstance(spec, tuple):
        kind, kwargs = spec
        return make_transport(kind, **kwargs), True
    return spec, False
