"""Versioned, verified weight updates from the trainer to the generators.

Public API: ``encode_update``, ``apply_update`` (``prepare_update`` + commit), ``WeightUpdate``
(``to_bytes`` / ``from_bytes``), the ``Publisher`` / ``Subscriber`` pair, and the transports in
``loomrl.weights.transports`` (``make_transport("inproc" | "shm" | "torch_dist" | "files" | "tensor")``;
the tensor lane's update is ``loomrl.weights.tensors.TensorUpdate``).
"""

from loomrl.weights.codec import CodecOptions
from loomrl.weights.update import (
    PreparedUpdate,
    WeightUpdate,
    WeightUpdateError,
    apply_update,
    encode_update,
    prepare_update,
    state_digest,
)

__all__ = [
    "CodecOptions",
    "PreparedUpdate",
    "WeightUpdate",
    "WeightUpdateError",
    "apply_update",
    "encode_update",
    "prepare_update",
    "state_digest",
]
