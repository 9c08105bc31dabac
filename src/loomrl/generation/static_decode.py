"""The generator's decode step on a preallocated key/value cache, replayed from a CUDA graph.

Why: a decode step of a transformers model is a few hundred small kernels launched one by
one from Python (24 layers x a dozen ops for a 0.36B Qwen2), and on a GPU the launches, not
the arithmetic, set the pace at RL batch sizes. With every tensor of the step at a fixed
address and shape, the whole step is captured once as a CUDA graph and replayed as one
launch per token (``torch.cuda.CUDAGraph``, captured by hand: no compiler, a capture in
well under a second, nothing that varies with the transformers version but the cache API).

How: the prefill runs as before (``DynamicCache``, each distinct prompt once). Its keys and
values are copied into transformers ``StaticLayer``s of ``max_len`` positions, one row per
sequence; a decode step writes its key and value at the layer's ``cumulative_length`` (a
device tensor the step advances in place) and attends over all ``max_len`` positions through
a 4-D mask that hides padding and positions not written yet. The mask goes to the model
already built (transformers passes a 4-D mask through as it is), so its own mask code, with
its host-side checks, never runs in the step. ``max_len`` is rounded up to
``LENGTH_BUCKET`` so that calls with prompts of different widths reuse one graph.

With grouped-query attention (a 0.36B Qwen2: 14 query heads on 2 key/value heads), the step
attends through ``grouped_decode_attention`` rather than transformers' ``sdpa`` path, which
repeats every key/value head for its query heads whenever a mask is given: at 256 sequences of
192 positions that is ~9 GB of copies a token for the 24 layers, several times what the rest of
the step reads.

The same static step runs eagerly where there is no CUDA (the tests compare it with the
dynamic-cache loop on the CPU, where the dynamic loop stays the default): tokens equal, log-
probs equal to float rounding (attention over masked slots sums in another order).
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import torch

logger = logging.getLogger(__name__)

LENGTH_BUCKET = 64  # static cache lengths are multiples of this (one graph for many prompt widths)
MAX_GRAPHS = 2  # (rows, length) shapes kept, each with its own cache; least recently used dropped
WARMUP_STEPS = 2  # eager runs on a side stream before capture (allocator and kernels settle)
# attention implementations the 4-D mask is built for
MASK_KINDS = {"sdpa": "bool", "eager": "additive"}
GROUPED_DECODE = "loomrl_grouped_decode"  # the attention the static step runs for 'sdpa' models


def grouped_decode_attention(
    module,
    query,
    key,
    value,
    attention_mask,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
):
    """Attention of one new position per sequence over a cache with fewer key/value heads
    than query heads, without repeating the keys and values: the query heads that share a
    key/value head become that head's query positions (query head ``h`` reads key/value head
    ``h // (heads / kv_heads)``, as transformers' ``repeat_kv`` pairs them), and the mask
    [batch, 1, 1, length] broadcasts over them. Returns [batch, 1, heads, head_dim], as the
    attention interface does; other shapes go to transformers' ``sdpa``."""
    # lazy: transformers loads when this runs, not with the module
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    batch, heads, q_len, head_dim = query.shape
    kv_heads = key.shape[1]
    if q_len != 1 or kv_heads == heads or attention_mask is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    grouped = query.reshape(batch, kv_heads, heads // kv_heads, head_dim)
    out = torch.nn.functional.scaled_dot_product_attention(
        grouped, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling
    )
    return out.reshape(batch, heads, 1, head_dim).transpose(1, 2).contiguous(), None


def _register_grouped_decode() -> None:
    # lazy: transformers loads when this runs, not with the module
    from transformers import AttentionInterface

    if GROUPED_DECODE not in AttentionInterface._global_mapping:
        AttentionInterface.register(GROUPED_DECODE, grouped_decode_attention)


def static_decode_unsupported(model: torch.nn.Module) -> str | None:
    """Why ``model`` cannot decode from a static cache here, or None when it can: the step
    hands the model a ready 4-D mask for full attention only."""
    config = getattr(model, "config", None)
    if config is None:
        return "the model has no transformers config"
    impl = getattr(config, "_attn_implementation", None)
    if impl not in MASK_KINDS:
        return f"attention implementation {impl!r} (the static step builds masks for {sorted(MASK_KINDS)})"
    layer_types = getattr(config, "layer_types", None) or ["full_attention"]
    if any(t != "full_attention" for t in layer_types):
        return f"layer types {sorted(set(layer_types))} (only full attention)"
    return None


class _StaticStep:
    """One (rows, length) shape: the static cache, the step's input and output buffers, and
    the captured graph once there is one."""

    def __init__(
        self,
        model,
        num_layers: int,
        rows: int,
        max_len: int,
        like: list,
        values_like: list,
        *,
        grouped_attention: bool,
    ) -> None:
        # lazy: transformers' cache classes load when a cache is built, not with the module
        from transformers.cache_utils import Cache, StaticLayer

        self.model, self.rows, self.max_len = model, rows, max_len
        self.layers = [StaticLayer(max_cache_len=max_len) for _ in range(num_layers)]
        for layer, k, v in zip(self.layers, like, values_like):
            # (allocates [rows, kv_heads, max_len, head_dim] in the cache's dtype and device)
            layer.lazy_initialization(
                k.new_empty((rows, *k.shape[1:])), v.new_empty((rows, *v.shape[1:]))
            )
        self.cache = Cache(layers=self.layers)
        device = like[0].device
        dtype = next(model.parameters()).dtype
        self.input_ids = torch.zeros((rows, 1), dtype=torch.long, device=device)
        self.positions = torch.zeros((rows, 1), dtype=torch.long, device=device)
        # the mask, as booleans
        self.attend = torch.zeros((rows, max_len), dtype=torch.bool, device=device)
        kind = MASK_KINDS[model.config._attn_implementation]
        mask_dtype = torch.bool if kind == "bool" else dtype
        # what the model reads
        self.mask = torch.zeros((rows, 1, 1, max_len), dtype=mask_dtype, device=device)
        self.min_value = None if kind == "bool" else torch.finfo(dtype).min
        self.attention = GROUPED_DECODE if kind == "bool" and grouped_attention else None
        if self.attention is not None:
            _register_grouped_decode()
        self.logits: torch.Tensor | None = None
        self.graph: torch.cuda.CUDAGraph | None = None

    def load_prefill(self, keys: list, values: list, attention) -> None:
        """The prompts' keys and values at positions ``[0, width)``; the positions after
        them hidden until a step writes them."""
        width = keys[0].shape[2]
        for layer, k, v in zip(self.layers, keys, values):
            layer.keys[:, :, :width].copy_(k)
            layer.values[:, :, :width].copy_(v)
            layer.cumulative_length.fill_(width)
        self.attend.zero_()
        if attention is None:
            self.attend[:, :width] = True
        else:
            self.attend[:, :width] = attention.bool()

    def run(self, step_ids: torch.Tensor, positions: torch.Tensor, slot: int) -> torch.Tensor:
        """Logits (fp32, [rows, vocab]) of the step that writes position ``slot``."""
        self.input_ids.copy_(step_ids)
        self.positions.copy_(positions)
        self.attend[:, slot] = True
        self._write_mask()
        if self.graph is not None:
            self.graph.replay()
            return self.logits.float()
        return self._forward().float()

    def _write_mask(self) -> None:
        view = self.attend[:, None, None, :]
        if self.min_value is None:
            self.mask.copy_(view)
        else:
            self.mask.copy_(torch.where(view, 0.0, self.min_value))

    def _forward(self) -> torch.Tensor:
        config = self.model.config
        usual = config._attn_implementation
        # (read by every attention layer at each call: for this step only)
        if self.attention is not None:
            config._attn_implementation = self.attention
        try:
            out = self.model(
                input_ids=self.input_ids,
                attention_mask=self.mask,
                position_ids=self.positions,
                past_key_values=self.cache,
                use_cache=True,
                logits_to_keep=1,
            )
        finally:
            config._attn_implementation = usual
        return out.logits[:, -1, :]

    def capture(self) -> None:
        """Record the step as a CUDA graph. The warm-up and capture runs write junk at the
        positions after the cache's current length and advance it: ``load_prefill`` resets
        both before every use, and the mask hides a position until its own step writes it."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_STEPS):
                self._forward()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: a trainer thread of the same process (runtime="local") keeps launching
        # on its own streams while this one captures; only this thread's calls are checked.
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            self.logits = self._forward()
        self.graph = graph


class StaticDecoder:
    """Decode steps on a static cache, one ``_StaticStep`` per (rows, length) shape, each
    captured as a CUDA graph when ``cuda_graphs`` and the model is on a CUDA device."""

    def __init__(
        self, model: torch.nn.Module, *, cuda_graphs: bool, grouped_attention: bool = True
    ) -> None:
        self.model = model
        self.cuda_graphs = cuda_graphs
        # off: transformers' sdpa (repeated key/value heads)
        self.grouped_attention = grouped_attention
        self._steps: OrderedDict[tuple, _StaticStep] = OrderedDict()
        self.graphs_captured = 0
        self.capture_failures = 0

    def start(self, keys: list, values: list, attention, max_new_tokens: int) -> _StaticStep:
        """A step with the prompts' cache loaded: ``keys``/``values`` per layer, each
        [sequences, kv_heads, width, head_dim]; ``attention`` [sequences, width] or None."""
        rows, width = keys[0].shape[0], keys[0].shape[2]
        max_len = -(-(width + max_new_tokens) // LENGTH_BUCKET) * LENGTH_BUCKET
        key = (rows, max_len, keys[0].dtype, keys[0].shape[1:2], keys[0].shape[3:])
        step = self._steps.get(key)
        if step is None:
            step = self._steps[key] = _StaticStep(
                self.model,
                len(keys),
                rows,
                max_len,
                keys,
                values,
                grouped_attention=self.grouped_attention,
            )
            while len(self._steps) > MAX_GRAPHS:
                self._steps.popitem(last=False)
        self._steps.move_to_end(key)
        if self.cuda_graphs and step.graph is None and step.input_ids.device.type == "cuda":
            self._capture(step)
        step.load_prefill(keys, values, attention)
        return step

    def _capture(self, step: _StaticStep) -> None:
        try:
            step.capture()
            self.graphs_captured += 1
        except Exception as exc:  # noqa: BLE001 - any failure leaves decoding eager on the static cache, counted
            self.cuda_graphs = False
            self.capture_failures += 1
            step.graph = None
            logger.warning(
                "capturing the decode step as a CUDA graph failed (%s: %s); it runs eager from now on",
                type(exc).__name__,
                exc,
            )

    def clear(self) -> None:
        """Drop every cache and graph (the model's tensors were replaced: offload)."""
        self._steps.clear()

    def metrics(self, prefix: str) -> dict[str, float]:
        return {
            f"{prefix}/cuda_graphs": float(self.graphs_captured),
            f"{prefix}/cuda_graph_failures": float(self.capture_failures),
        }
