"""The vLLM engine on vLLM's ``AsyncLLM`` (``[generation.engine] type = "vllm"``,
``async_engine = true``): ``generate`` calls overlap.

Each call's requests go to vLLM as the call comes (from the local runtime's pool of
concurrent endpoint threads), and vLLM batches every request it holds continuously, so a
multi-turn environment's turns and several rollouts in flight share the engine's batches
instead of waiting for each other. Sampling, seeds, log-probs, the prefix-cache salt and
the weight reloads are ``VllmGenerator``'s: only the engine under them differs
(``vllm_adapter.AsyncLLMOnLoop``), so a request gives the same tokens on either engine.

The weight contract holds under concurrency through a ``WeightGate``: generate calls share
it; whatever changes the engine (a reload, a restart, sleep and wake) holds it alone, after
the calls in flight have ended and before new ones start. So every result was made by one
version, the version it reports.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from loomrl.generation import vllm_adapter
from loomrl.generation.vllm_engine import VllmGenerator
from loomrl.runtime.endpoints import endpoint
from loomrl.types import GenerationRequest, GenerationResult
from loomrl.weights.receiver import WeightsApplied

logger = logging.getLogger(__name__)


class WeightGate:
    """A readers-writer gate that prefers the writer: ``shared()`` for generate calls,
    ``hold()``/``release()`` for a weight change. Once a writer waits, new readers wait too,
    so a reload is never starved by a stream of generate calls."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._writer = False
        self._writers_waiting = 0

    @contextmanager
    def shared(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: not self._writer and not self._writers_waiting)
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                self._cond.notify_all()

    def hold(self) -> None:
        """Wait for the readers in flight to end, then hold the gate alone."""
        with self._cond:
            self._writers_waiting += 1
            try:
                self._cond.wait_for(lambda: not self._writer and not self._readers)
            finally:
                self._writers_waiting -= 1
            self._writer = True

    def release(self) -> None:
        with self._cond:
            self._writer = False
            self._cond.notify_all()

    @property
    def readers(self) -> int:
        return self._readers

    @property
    def held(self) -> bool:
        """Whether a writer holds the gate."""
        return self._writer


class AsyncVllmGenerator(VllmGenerator):
    """``VllmGenerator`` on ``AsyncLLM``, its ``generate`` concurrent (module docstring)."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any, **kwargs: Any) -> None:
        self.gate = WeightGate()
        self._change_lock = threading.RLock()  # one engine change at a time
        self._change_depth = 0  # nested _engine_change blocks (under _change_lock)
        self._gate_held = False  # by the change in progress (under _change_lock)
        super().__init__(model, tokenizer, **kwargs)

    def _engine_factory(self):
        return vllm_adapter.start_async_llm

    # -- engine changes: alone, between generate calls -----------------------------------

    @contextmanager
    def _engine_change(self) -> Iterator[None]:
        """Hold the engine alone for the block (the gate is taken at the first
        ``_hold_gate``, so a change that turns out to change nothing never waits)."""
        with self._change_lock:
            self._change_depth += 1
            try:
                yield
            finally:
                self._change_depth -= 1
                if self._change_depth == 0 and self._gate_held:  # the outermost block ends
                    self._gate_held = False
                    self.gate.release()

    def _hold_gate(self) -> None:
        """Inside ``_engine_change``: wait for the generate calls in flight, then hold."""
        if not self._gate_held:
            self.gate.hold()
            self._gate_held = True

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Reload into vLLM once no generate call is in flight; the gate stays held until
        the receiver has moved its version (when ``apply_weights``/``update_weights`` end)."""
        with self._engine_change():
            self._hold_gate()
            super().load_weights(weights)

    def update_weights(self, update) -> int:
        with self._engine_change():
            return super().update_weights(update)

    def apply_weights(self, min_version: int = 0) -> WeightsApplied:
        with self._engine_change():
            return super().apply_weights(min_version)

    def offload(self) -> float:
        with self._engine_change():
            self._hold_gate()
            return super().offload()

    def restore(self) -> float:
        with self._engine_change():
            self._hold_gate()
            return super().restore()

    def _heal(self) -> None:
        """Restart a dead engine (once, whichever call finds it dead first)."""
        if vllm_adapter.engine_alive(self.llm):
            return
        with self._engine_change():
            self._hold_gate()
            if not vllm_adapter.engine_alive(self.llm):
                logger.warning("vLLM's engine core is gone; restarting it from the verified mirror")
                self.restart()

    def _restart_if_still(self, llm: Any) -> None:
        """Restart after ``llm`` died under a call, unless another call did already."""
        with self._engine_change():
            self._hold_gate()
            if self.llm is llm:
                logger.warning("vLLM's engine core died; restarting it from the verified mirror")
                self.restart()

    # -- sampling: concurrent ------------------------------------------------------------

    @endpoint(concurrent=True)
    def generate(
        self, requests: list[GenerationRequest], apply_newest: bool = False
    ) -> list[GenerationResult]:
        applied = self._apply_for(requests, apply_newest)  # before sharing the gate
        if not requests:
            return []
        if self.offloaded:
            self.restore()
        self._heal()
        results, llm = self._sample_shared(requests)
        if results is None:  # the engine died under this call
            self._restart_if_still(llm)
            results, _ = self._sample_shared(requests)  # sampling is a function of the seeds
            if results is None:
                raise RuntimeError("vLLM's engine core died again right after its restart")
        self._report_apply(results, applied)
        results[0].engine_metrics = self.metrics()
        return results

    def _sample_shared(
        self, requests: list[GenerationRequest]
    ) -> tuple[list[GenerationResult] | None, Any]:
        """The results, sampled under the shared gate (no weight change starts before they
        are done), and the engine that made them; None for results if it died meanwhile."""
        with self.gate.shared():
            llm = self.llm
            try:
                return self._generate_grouped(requests), llm
            except Exception as err:
                if not vllm_adapter.is_engine_dead(err):
                    raise
                return None, llm

    def metrics(self) -> dict[str, float]:
        """``VllmGenerator.metrics`` and ``generation/vllm_peak_requests``: the most requests
        vLLM held at once (counted as each one ended: a lower bound)."""
        peak = self.llm.peak_requests if self.llm is not None else 0
        return {**super().metrics(), "generation/vllm_peak_requests": float(peak)}
