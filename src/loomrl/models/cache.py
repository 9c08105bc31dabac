"""Key/value cache helpers shared by the trainer and the generation engines."""

from __future__ import annotations

import torch


def repeat_cache(cache, rows: torch.Tensor):
    """A new ``DynamicCache`` whose row ``i`` is ``cache``'s row ``rows[i]``: one prompt's
    keys and values for each of the completions that share it. Differentiable, so a trainer
    can back-propagate through a shared prompt."""
    from transformers.cache_utils import DynamicCache

    repeated = DynamicCache()
    for layer_idx, layer in enumerate(cache.layers):
        repeated.update(layer.keys.index_select(0, rows), layer.values.index_select(0, rows), layer_idx)
    return repeated
