"""The generator's forward with its key/value cache as plain tensors, so that it can run
from traces (``loomrl.models.traces``): a trace takes and returns tensors only."""

from __future__ import annotations

import torch


class KVForward(torch.nn.Module):
    """The causal LM's forward with its key/value cache as a flat tuple of tensors
    ``(keys_0, values_0, keys_1, ...)`` (empty for a prefill): last-position logits in fp32
    and the new cache. A mask of width 0 stands for none (no row padded). Only for models
    whose own cache is a ``DynamicCache`` of full-attention layers
    (``loomrl.models.cache.probe_can_repeat``), the cache this forward rebuilds."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, position_ids, *kv: torch.Tensor):
        # lazy: transformers' cache classes load when a cache is built, not with the module
        from transformers.cache_utils import DynamicCache

        cache = DynamicCache()
        cache.layers.extend(_layer_holding(kv[i], kv[i + 1]) for i in range(0, len(kv), 2))
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask if attention_mask.shape[1] else None,  # width 0: no mask
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
        )
        flat = [t for layer in out.past_key_values.layers for t in (layer.keys, layer.values)]
        return (out.logits[:, -1, :].float(), *flat)


def _layer_holding(keys: torch.Tensor, values: torch.Tensor):
    """A ``DynamicLayer`` that holds ``keys`` and ``values`` as they are: ``update`` on a
    fresh one would first copy them (``cat`` onto an empty tensor), the whole cache again at
    every token."""
    # lazy: transformers' cache classes load when a cache is built, not with the module
    from transformers.cache_utils import DynamicLayer

    layer = DynamicLayer()
    layer.lazy_initialization(keys, values)
    layer.keys, layer.values = keys, values
    return layer
