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

A trace costs tens to hundreds of milliseconds and is no faster than eager on its own
(its gain is the GIL), so tracing must not cost more than it saves where shapes vary a lot
(prompts of many lengths, long generations: a new key/value length every token):
- tracing spends at most ``TRACE_BUDGET_S`` plus ``TRACE_BUDGET_FRAC`` of the time spent
  in the forward so far; a shape over budget stays eager until the budget allows;
- once ``WASTED_TRACES_MAX`` traces were dropped (least recently used) before serving
  ``TRACE_AFTER`` calls, the shapes vary too much for traces to pay: tracing stops.

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

import torch

from loomrl.weights.lora import is_peft_model

logger = logging.getLogger(__name__)

# the use of an input shape that traces it (eval shapes, used twice a run, stay eager)
TRACE_AFTER = 3
MAX_TRACES = 64  # traces kept (least recently used dropped first)
TRACE_BUDGET_S = 0.25  # tracing time always allowed ...
TRACE_BUDGET_FRAC = 0.05  # ... plus this share of the time spent in the forward
WASTED_TRACES_MAX = 8  # traces dropped after fewer than TRACE_AFTER calls before tracing stops


def quiet_tracer_warnings(module: torch.nn.Module) -> None:
    """Ignore the tracer's warnings, for the whole process: shape-derived constants are what
    a trace's per-shape key is for, and torch.jit.trace's deprecation is known (module
    docstring). Set once, not inside ``warnings.catch_warnings()``: that swaps the global
    filter list and puts it back, and the generator's and the trainer's threads trace at
    the same time on the ``local`` runtime, so one's restore let the other's warnings out.

    The tracer also reads every attribute of every submodule: a transformers base model
    (``Qwen2Model``, no ``loss_type`` of its own) answers ``loss_function`` with a warning
    that its loss type None is "unrecognized"; it is given its causal LM's."""
    for sub in module.modules():
        if hasattr(sub, "loss_type") and sub.loss_type is None:
            sub.loss_type = "ForCausalLM"
    warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
    warnings.filterwarnings("ignore", message=r".*torch\.jit\.trace.*", category=DeprecationWarning)
    warnings.filterwarnings("ignore", message=r".*torch\.jit\.trace.*", category=FutureWarning)


class ShapeTraces:
    """``module(*tensors)`` from a trace per input shape, eager until a shape is traced.

    ``params_as_constants``: trace a function over the module, which holds its parameters
    as tensors, for a forward that never needs their gradients (about half the cost of
    tracing the module, which rebuilds its whole hierarchy as script modules). Otherwise
    the module is traced and reads its parameters as attributes, so autograd reaches them.

    Calls come from one thread at a time. ``clear()`` drops every trace, for when the
    module's tensors were replaced rather than written in place (offload)."""

    def __init__(
        self,
        module: torch.nn.Module,
        *,
        what: str,
        params_as_constants: bool = False,
        trace_after: int = TRACE_AFTER,
        max_traces: int = MAX_TRACES,
    ) -> None:
        self.module, self.what = module, what
        self.params_as_constants = params_as_constants
        self.trace_after, self.max_traces = trace_after, max_traces
        self.enabled = True
        self._traces: OrderedDict[tuple, list] = OrderedDict()  # key -> [trace, calls it served]
        self._uses: dict[tuple, int] = {}
        self.traces_made = 0
        self.trace_s = 0.0
        self.call_s = 0.0  # wall time in calls, traced or eager
        self.failures = 0
        self.wasted = 0
        self.traced_calls = 0
        self.eager_calls = 0

    def __call__(self, *args: torch.Tensor):
        key = (self.module.training, *(a.shape for a in args))
        entry = self._traces.get(key)
        if entry is not None:
            self._traces.move_to_end(key)
        elif self.enabled:
            uses = self._uses[key] = self._uses.get(key, 0) + 1
            if uses >= self.trace_after and self._affordable():
                entry = self._trace(key, args)
        t0 = time.perf_counter()  # (the forward's own time: tracing counts in trace_s)
        try:
            if entry is None:
                self.eager_calls += 1
                return self.module(*args)
            self.traced_calls += 1
            entry[1] += 1
            with torch.jit.optimized_execution(False):  # per thread: the recorded ops as they are
                return entry[0](*args)
        finally:
            self.call_s += time.perf_counter() - t0

    def _affordable(self) -> bool:
        """Whether one more trace, at the mean cost so far, stays within the budget."""
        mean = self.trace_s / self.traces_made if self.traces_made else 0.0
        return self.trace_s + mean <= TRACE_BUDGET_S + TRACE_BUDGET_FRAC * self.call_s

    def _trace(self, key: tuple, args: tuple) -> list | None:
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
            quiet_tracer_warnings(module)
            fn = torch.jit.trace(target, args, check_trace=False)
        except Exception as exc:  # noqa: BLE001 - any failure leaves this forward eager, counted
            self.enabled, self.failures = False, self.failures + 1
            logger.warning(
                "tracing the %s failed (%s: %s); it runs eager from now on",
                self.what,
                type(exc).__name__,
                exc,
            )
            return None
        finally:
            for p in frozen:
                p.requires_grad_(True)
            self.trace_s += time.perf_counter() - t0
        self.traces_made += 1
        self._uses.pop(key, None)
        entry = self._traces[key] = [fn, 0]
        if len(self._traces) > self.max_traces:
            self._drop_oldest_trace()
        if len(self._uses) > 16 * self.max_traces:  # shapes seen once, long ago
            self._uses.clear()
        return entry

    def _drop_oldest_trace(self) -> None:
        """Make room; when too many traces went before they paid for themselves, stop tracing."""
        _, (_, served) = self._traces.popitem(last=False)
        self.wasted += served < self.trace_after
        if self.wasted >= WASTED_TRACES_MAX:
            self.enabled = False
            logger.info(
                "the %s runs eager from now on: its input shapes vary too much for traces to pay "
                "(%d traces dropped after fewer than %d calls each)",
                self.what,
                self.wasted,
                self.trace_after,
            )

    def clear(self) -> None:
        self._traces.clear()
        self._uses.clear()

    def metrics(self, prefix: str) -> dict[str, float]:
        return {
            f"{prefix}/traces": float(self.traces_made),
            f"{prefix}/trace_s": self.trace_s,
            f"{prefix}/trace_failures": float(self.failures),
            f"{prefix}/traces_wasted": float(self.wasted),
            f"{prefix}/traced_forwards": float(self.traced_calls),
            f"{prefix}/eager_forwards": float(self.eager_calls),
        }


def can_trace(model: torch.nn.Module) -> bool:
    """Whether a trace of ``model``'s forward is the forward: not for PEFT adapters (their
    modules switch behaviour on flags a trace would freeze) nor gradient checkpointing."""
    return not is_peft_model(model) and not getattr(model, "is_gradient_checkpointing", False)
