"""A model's forward run from TorchScript traces, one per input shape.

Why: a Hugging Face forward is a few hundred Python-level calls (modules, mask and cache
helpers) around the kernels. Traced, the same kernels run from torch's C++ interpreter,
which releases the GIL for the whole pass. With executors as threads of one process
(``runtime="local"``), a generator and a trainer then no longer take the GIL from each
other between every op. The generator's sampling forwards and the trainer's training
forward both run this way.

A trace records the aten ops that eager ran, in the same order, and runs them with the
graph executor's passes off (no constant folding, fusion, autodiff graphs or other
rewrites): each op goes through the dispatcher as in eager, autograd included, so
outputs and gradients are bit-identical to eager ones; the tests check both, and that
weight updates (written in place) reach a trace. A trace is only valid for the input
shapes it was made with, because the forward turns shapes into Python values (cache and
mask lengths, a branch on a width): there is one per shape, made on that shape's
``TRACE_AFTER``-th use, so a one-off shape stays eager; at most ``MAX_TRACES`` are kept.

``torch.jit.trace`` is deprecated in favour of ``torch.compile`` and ``torch.export``; it is
used because it is the one path in torch that runs a whole forward without the GIL and
without changing numerics (``torch.compile`` fuses kernels and keeps a Python wrapper). A
trace that fails turns tracing off for that forward, which then runs eager, and is counted.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)

TRACE_AFTER = 3  # the use of an input shape that traces it (eval shapes, used twice a run, stay eager)
MAX_TRACES = 64  # traces kept (least recently used dropped first)


class ShapeTraces:
    """``module(*tensors)`` from a trace per input shape, eager until a shape is traced.

    ``params_as_constants``: trace a function over the module, which holds its parameters
    as tensors, for a forward that never needs their gradients (about half the cost of
    tracing the module, which rebuilds its whole hierarchy as script modules). Otherwise
    the module is traced and reads its parameters as attributes, so autograd reaches them.

    Calls come from one thread at a time. ``clear()`` drops every trace, for when the
    module's tensors were replaced rather than written in place (offload)."""

    def __init__(
        self, module: torch.nn.Module, *, what: str, params_as_constants: bool = False,
        trace_after: int = TRACE_AFTER, max_traces: int = MAX_TRACES,
    ) -> None:  # fmt: skip
        self.module, self.what = module, what
        self.params_as_constants = params_as_constants
        self.trace_after, self.max_traces = trace_after, max_traces
        self.enabled = True
        self._traces: OrderedDict[tuple, Callable] = OrderedDict()
        self._uses: dict[tuple, int] = {}
        self.traces_made = 0
        self.trace_s = 0.0
        self.failures = 0
        self.traced_calls = 0
        self.eager_calls = 0

    def __call__(self, *args: torch.Tensor):
        key = (self.module.training, *(a.shape for a in args))
        fn = self._traces.get(key)
        if fn is not None:
            self._traces.move_to_end(key)
        elif self.enabled:
            uses = self._uses[key] = self._uses.get(key, 0) + 1
            if uses >= self.trace_after:
                fn = self._trace(key, args)
        if fn is None:
            self.eager_calls += 1
            return self.module(*args)
        self.traced_calls += 1
        with torch.jit.optimized_execution(False):  # per thread: the recorded ops as they are
            return fn(*args)

    def _trace(self, key: tuple, args: tuple) -> Callable | None:
        t0 = time.perf_counter()
        module, target = self.module, self.module
        frozen: list[torch.nn.Parameter] = []
        if self.params_as_constants:

            def target(*inputs):
                return module(*inputs)

            # The tracer takes a tensor as a constant only if it does not ask for gradients.
            frozen = [p for p in module.parameters() if p.requires_grad]
        try:
            for p in frozen:
                p.requires_grad_(False)
            with warnings.catch_warnings():  # shape-derived constants are what the per-shape key is for
                warnings.simplefilter("ignore", torch.jit.TracerWarning)
                warnings.simplefilter("ignore", DeprecationWarning)
                fn = torch.jit.trace(target, args, check_trace=False)
        except Exception as exc:  # noqa: BLE001 - any failure leaves this forward eager, counted
            self.enabled, self.failures = False, self.failures + 1
            logger.warning("tracing the %s failed (%s: %s); it runs eager from now on",
                           self.what, type(exc).__name__, exc)  # fmt: skip
            return None
        finally:
            for p in frozen:
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

    def metrics(self, prefix: str) -> dict[str, float]:
        return {
            f"{prefix}/traces": float(self.traces_made),
            f"{prefix}/trace_s": self.trace_s,
            f"{prefix}/trace_failures": float(self.failures),
            f"{prefix}/traced_forwards": float(self.traced_calls),
            f"{prefix}/eager_forwards": float(self.eager_calls),
        }


def can_trace(model: torch.nn.Module) -> bool:
    """Whether a trace of ``model``'s forward is the forward: not for PEFT adapters (their
    modules switch behaviour on flags a trace would freeze) nor gradient checkpointing."""
    from loomrl.weights.lora import is_peft_model

    return not is_peft_model(model) and not getattr(model, "is_gradient_checkpointing", False)
