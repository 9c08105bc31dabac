"""Versioned, verified weight updates from the trainer to the generators.

Public API: ``encode_update``, ``apply_update``, ``WeightUpdate`` and the transports in
``loomrl.weights.transports``.
"""

from loomrl.weights.update import (
    WeightUpdate,
    WeightUpdateError,
    apply_update,
    encode_update,
    state_digest,
)

__all__ = ["WeightUpdate", "WeightUpdateError", "apply_update", "encode_update", "state_digest"]
