"""Key/value cache helpers shared by the trainer and the generation engines."""

from __future__ import annotations

import torch


def can_repeat(cache) -> bool:
    """Whether ``repeat_cache`` copies ``cache`` faithfully: a ``DynamicCache`` of plain
    full-attention layers. Sliding-window layers keep only their window, and linear-attention
    or quantized layers hold other state, so those are left to the unshared path."""
    # lazy: transformers' cache classes load when a cache is built, not with the module
    from transformers.cache_utils import DynamicCache, DynamicLayer

    layers = getattr(cache, "layers", None)
    return (
        isinstance(cache, DynamicCache)
        and bool(layers)
        and all(type(layer) is DynamicLayer for layer in layers)
    )


def probe_can_repeat(model: torch.nn.Module) -> bool:
    """Whether ``model``'s own KV cache can be shared (``can_repeat``), from a two-token
    forward."""
    param = next(model.parameters())
    ids = torch.ones((1, 2), dtype=torch.long, device=param.device)
    with torch.no_grad():
        try:
            out = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True)
        except TypeError:  # a forward without the cache arguments
            return False
    return can_repeat(getattr(out, "past_key_values", None))


def repeat_cache(cache, rows: torch.Tensor):
    """A new ``DynamicCache`` whose row ``i`` is ``cache``'s row ``rows[i]``: one prompt's
    keys and values for each of the completions that share it. Differentiable, so a trainer
    can back-propagate through a shared prompt."""
    # lazy: transformers' cache classes load when a cache is built, not with the module
    from transformers.cache_utils import DynamicCache

    repeated = DynamicCache()
    for layer_idx, layer in enumerate(cache.layers):
        repeated.update(
            layer.keys.index_select(0, rows), layer.values.index_select(0, rows), layer_idx
        )
    return repeated
