"""Requests that arrive together go to a generator together.

Each HTTP request becomes one ``GenerationRequest``; the batcher holds it for at most
``window_s`` (or until ``max_batch`` are waiting), then sends every waiting request as one
``generate`` call, so many concurrent agents share one batched forward pass of the HF engine
(and arrive at vLLM's AsyncLLM together). At most ``max_in_flight`` calls run at once (one
per generator): requests that arrive while every generator is busy wait and go together in
the next call, as soon as one is free, instead of queueing as many small calls. Where the call goes is the job's choice: the
``generate`` callable routes it (the least busy generator, the newest weights first).

A generator lost in the middle of a call (``ExecutorLostError``, healed by the runtime's
supervision) is asked once more, on whichever generator ``generate`` picks then; a second
loss fails the call's requests (each answered once: 503).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from loomrl.runtime.supervision import ExecutorLostError
from loomrl.types import GenerationRequest, GenerationResult

logger = logging.getLogger(__name__)

Generate = Callable[[list[GenerationRequest]], Awaitable[list[GenerationResult]]]


class Batcher:
    """Batches requests into generate calls (module docstring); counts what it did."""

    def __init__(
        self, generate: Generate, window_s: float, max_batch: int, max_in_flight: int = 1
    ) -> None:
        self.generate, self.window_s, self.max_batch = generate, window_s, max_batch
        self.max_in_flight = max_in_flight
        self._waiting: list[tuple[GenerationRequest, asyncio.Future]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._calls: set[asyncio.Task] = set()
        self.num_calls = 0
        self.num_requests = 0
        self.num_retries = 0
        self.num_failed = 0

    def submit(self, request: GenerationRequest) -> asyncio.Future:
        """The request's result, to await (its generate call may hold others)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._waiting.append((request, future))
        if len(self._waiting) >= self.max_batch:
            self._flush()
        elif self._timer is None:
            self._timer = loop.call_later(self.window_s, self._flush)
        return future

    def _flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if len(self._calls) >= self.max_in_flight:
            return  # (sent when a call ends: _call_ended)
        batch, self._waiting = self._waiting[: self.max_batch], self._waiting[self.max_batch :]
        if self._waiting:
            self._timer = asyncio.get_running_loop().call_later(self.window_s, self._flush)
        if batch:
            task = asyncio.create_task(self._run(batch))
            self._calls.add(task)
            task.add_done_callback(self._call_ended)

    def _call_ended(self, task: asyncio.Task) -> None:
        self._calls.discard(task)
        if self._waiting:
            self._flush()

    async def _run(self, batch: list[tuple[GenerationRequest, asyncio.Future]]) -> None:
        requests = [r for r, _ in batch]
        self.num_calls += 1
        self.num_requests += len(requests)
        try:
            try:
                results = await self.generate(requests)
            except ExecutorLostError as err:
                self.num_retries += 1
                logger.warning(
                    "generator lost under %d served requests, asking again: %s", len(requests), err
                )
                results = await self.generate(requests)
        except Exception as err:  # noqa: BLE001 - every waiting request is answered with it
            self.num_failed += len(batch)
            for _, future in batch:
                if not future.done():
                    future.set_exception(err)
            return
        for (_, future), result in zip(batch, results):
            if not future.done():
                future.set_result(result)

    def metrics(self) -> dict[str, float]:
        return {
            "serve/generate_calls": float(self.num_calls),
            "serve/requests": float(self.num_requests),
            "serve/retried_calls": float(self.num_retries),
            "serve/failed_requests": float(self.num_failed),
            "serve/requests_per_call": self.num_requests / max(self.num_calls, 1),
        }
