"""Versioned, verified weight updates from the trainer to the generators.

Public API: ``encode_update``, ``apply_update`` (``prepare_update`` + commit), ``WeightUpdate``
(``to_bytes`` / ``from_bytes``), the ``Publisher`` / ``Subscriber`` pair, and the transports in
``loomrl.weights.transports`` (``make_transport("inproc" | "shm" | "torch_dist" | "files" | "tensor")``;
the tensor lane's update is ``loomrl.weights.tensors.TensorUpdate``).

The names below import on first use: the job's config reads ``loomrl.weights.config``,
which must not pull in torch (``loomrl --help`` answers without it).
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "CodecOptions": "loomrl.weights.codec",
    "PreparedUpdate": "loomrl.weights.update",
    "WeightUpdate": "loomrl.weights.update",
    "WeightUpdateError": "loomrl.weights.update",
    "apply_update": "loomrl.weights.update",
    "encode_update": "loomrl.weights.update",
    "prepare_update": "loomrl.weights.update",
    "state_digest": "loomrl.weights.update",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'loomrl.weights' has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)
