"""The generator's forward passes as TorchScript traces, one per input shape.

Why: a Hugging Face forward is a few hundred Python-level calls (modules, mask and cache
helpers) around the kernels. Traced, the same kernels run from torch's C++ interpreter,
which releases the GIL for the whole pass. With executors as threads of one process
(``runtime="local"``) the generator then no longer takes the GIL from the trainer between
every op, and on its own it is faster too: there is less Python per token.

A trace records the aten ops that eager ran, in the same order, and holds the model's own
parameter tensors, so weight updates (written in place) reach it. It runs with the graph
executor's optimisations off (no constant folding, fusion or other rewrites): its outputs
are bit-identical to eager ones; ``tests/test_generation.py`` checks both. A trace
is only valid for the input shapes it was made with, because the forward turns shapes into
Python values (cache and mask lengths): there is one per shape, made on that shape's
``TRACE_AFTER``-th use, so a one-off shape stays eager; at most ``MAX_TRACES`` are kept.

``torch.jit.trace`` is deprecated in favour of ``torch.compile`` and ``torch.export``; it is
used because it is the one path in torch that runs a whole forward without the GIL and
without changing numerics (``torch.compile`` fuses kernels and keeps a Python wrapper). A
trace that fails turns tracing off for the engine, which then runs eager, and is counted.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections import OrderedDict

import torch

logger = logging.getLogger(__name__)

TRACE_AFTER = 3  # the use of an input shape that traces it (eval shapes, used twice a run, stay eager)
MAX_TRACES = 64  # traces kept (least recently used dropped first)


class KVForward(torch.nn.Module):
    """The causal LM's forward with its key/value cache as a flat tuple of tensors
    ``(keys_0, values_0, keys_1, ...)`` (empty for a prefill): last-position logits in fp32
    and the new cache. Only for models whose own cache is a ``DynamicCache`` of full-attention
    layers (``loomrl.models.cache.probe_can_repeat``), the cache this forward rebuilds."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, position_ids, *kv: torch.Tensor):
        from transformers.cache_utils import DynamicCache

        cache = DynamicCache()
        for i in range(0, len(kv), 2):
            cache.update(kv[i], kv[i + 1], i // 2)
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
        )
        flat = [t for layer in out.past_key_values.layers for t in (layer.keys, layer.values)]
        return (out.logits[:, -1, :].float(), *flat)


class TracedForward:
    """``KVForward`` run from a trace per input shape, eager until a shape is traced.

    Calls come from one thread at a time (the generator's). ``clear()`` drops every trace,
    for when the model's tensors were replaced rather than written in place (offload).
    A trace is of a function, not of the module: tracing a module rebuilds its whole
    hierarchy as script modules, which costs more than the trace itself."""

    def __init__(self, model: torch.nn.Module, *, trace_after: int = TRACE_AFTER, max_traces: int = MAX_TRACES) -> None:
        self.module = KVForward(model).eval()
        self.trace_after, self.max_traces = trace_after, max_traces
        self.enabled = True
        self._traces: OrderedDict[tuple, torch.jit.ScriptFunction] = OrderedDict()
        self._uses: dict[tuple, int] = {}
        self.traces_made = 0
        self.trace_s = 0.0
        self.failures = 0
        self.traced_calls = 0
        self.eager_calls = 0

    def __call__(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
        kv: tuple[torch.Tensor, ...] = (),
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:  # fmt: skip
        args = (input_ids, attention_mask, position_ids, *kv)
        key = tuple(a.shape for a in args)
        fn = self._traces.get(key)
        if fn is not None:
            self._traces.move_to_end(key)
        elif self.enabled:
            uses = self._uses[key] = self._uses.get(key, 0) + 1
            if uses >= self.trace_after:
                fn = self._trace(key, args)
        if fn is None:
            self.eager_calls += 1
            out = self.module(*args)
        else:
            self.traced_calls += 1
            with torch.jit.optimized_execution(False):  # per thread: the recorded ops as they are
                out = fn(*args)
        return out[0], out[1:]

    def _trace(self, key: tuple, args: tuple) -> torch.jit.ScriptFunction | None:
        t0 = time.perf_counter()
        module = self.module

        def forward(*inputs):
            return module(*inputs)

        # The parameters enter the trace as tensors it holds; the tracer only takes those
        # that do not ask for gradients (the engine never computes any).
        wants_grad = [p for p in module.parameters() if p.requires_grad]
        try:
            for p in wants_grad:
                p.requires_grad_(False)
            with warnings.catch_warnings():  # shape-derived constants are what the per-shape key is for
                warnings.simplefilter("ignore", torch.jit.TracerWarning)
                warnings.simplefilter("ignore", DeprecationWarning)
                fn = torch.jit.trace(forward, args, check_trace=False)
        except Exception as exc:  # noqa: BLE001 - any failure leaves the engine on eager, counted
            self.enabled, self.failures = False, self.failures + 1
            logger.warning("tracing the generator's forward failed (%s: %s); it runs eager from now on",
                           type(exc).__name__, exc)  # fmt: skip
            return None
        finally:
            for p in wants_grad:
                p.requires_grad_(True)
            self.trace_s += time.perf_counter() - t0
        self.traces_made += 1
        self._uses.pop(key, None)
        self._traces[key] = fn
        if len(self._traces) > self.max_traces:
            self._traces.popitem(last=False)
        if len(self._uses) > 16 * self.max_traces:  # shapes seen once, long ago
            self._uses.clear()
        return fn

    def clear(self) -> None:
        self._traces.clear()
        self._uses.clear()

    def metrics(self) -> dict[str, float]:
        return {
            "generation/traces": float(self.traces_made),
            "generation/trace_s": self.trace_s,
            "generation/trace_failures": float(self.failures),
            "generation/traced_forwards": float(self.traced_calls),
            "generation/eager_forwards": float(self.eager_calls),
        }
