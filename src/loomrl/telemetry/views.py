"""The optional views of a run's metrics (TensorBoard, W&B), fed without ever stopping it.

A view is a copy of what ``metrics.jsonl`` and ``samples.jsonl`` hold; a view that stops
answering must not stop the job. tensorboardX, for one, writes on a thread of its own: on a
full disk that thread dies, its 10-event queue fills, and the next ``add_summary`` blocks
for ever (and so did loomrl's metrics thread, the ``flush`` before each checkpoint, and
the checkpoint a SIGTERM asks for). So:

- events go to ``Views`` without blocking: into a bounded queue, drained by a thread of
  its own; an event that finds the queue full is dropped and counted, with one warning;
- a view that raises is warned about once and then skipped (``metrics.jsonl`` has it all);
- ``close`` waits a bounded time for the views to finish; a view still stuck after that is
  left behind (a daemon thread), and TensorBoard's own exit hook is disarmed so that it
  cannot hang the process's exit either.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any

logger = logging.getLogger(__name__)

QUEUE_SIZE = 256  # events waiting for the views (a step is one event per view)
CLOSE_TIMEOUT_S = 5.0  # how long close waits for the views to write what is queued


class Views:
    """Feeds ``tensorboard`` (a tensorboardX ``SummaryWriter`` or None) and ``sinks``
    (``WandbSink``...) with ``scalars`` and ``samples`` events on a thread of their own."""

    def __init__(self, tensorboard: Any, sinks: list[Any], write_scalars, write_text) -> None:
        """``write_scalars(tensorboard, scalars, step)`` and ``write_text(tensorboard,
        samples, step)`` write one event to TensorBoard (the metrics logger's format)."""
        self._tb, self._sinks = tensorboard, list(sinks)
        self._write_scalars, self._write_text = write_scalars, write_text
        self.dropped = 0  # events that found the queue full
        self._failed: set[str] = set()  # views that raised once: skipped from then on
        self._queue: queue.Queue[tuple[str, Any, int]] = queue.Queue(QUEUE_SIZE)
        self._closing = threading.Event()
        self._thread = None
        if self._tb is not None or self._sinks:
            self._thread = threading.Thread(target=self._run, name="loomrl-views", daemon=True)
            self._thread.start()

    def offer(self, kind: str, payload: Any, step: int) -> None:
        """Queue an event (``"scalars"``: a dict of finite numbers; ``"samples"``: a list of
        dicts) for every view; never waits: dropped and counted when the queue is full."""
        if self._thread is None:
            return
        try:
            self._queue.put_nowait((kind, payload, step))
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1:
                logger.warning(
                    "the metrics views (TensorBoard, W&B) fall behind or hang: their events are "
                    "dropped from step %d on (counted; metrics.jsonl has every record)",
                    step,
                )

    def _run(self) -> None:
        while True:
            try:
                kind, payload, step = self._queue.get(timeout=0.1)
            except queue.Empty:
                if self._closing.is_set():
                    break
                continue
            tb_write = self._write_scalars if kind == "scalars" else self._write_text
            if self._tb is not None:
                self._each(f"TensorBoard {kind}", tb_write, self._tb, payload, step)
            for sink in self._sinks:
                sink_write = sink.log if kind == "scalars" else sink.log_samples
                self._each(f"{type(sink).__name__} {kind}", sink_write, payload, step)
        if self._tb is not None:
            self._each("TensorBoard close", self._tb.close)
        for sink in self._sinks:
            self._each(f"{type(sink).__name__} close", sink.close)

    def _each(self, name: str, write, *args) -> None:
        """``write(*args)`` unless it failed before: a failure is warned about once, and
        that write is skipped from then on."""
        if name in self._failed:
            return
        try:
            write(*args)
        except Exception as err:  # noqa: BLE001 - a view never stops a run
            self._failed.add(name)
            logger.warning(
                "%s failed (%s); it is skipped from now on, metrics.jsonl is complete", name, err
            )

    def close(self, timeout_s: float | None = None) -> bool:
        """Write what is queued and close the views, waiting at most ``timeout_s`` (default
        ``CLOSE_TIMEOUT_S``); whether they finished (a view still stuck is left behind, its
        exit hook disarmed)."""
        if self._thread is None:
            return True
        timeout_s = CLOSE_TIMEOUT_S if timeout_s is None else timeout_s
        self._closing.set()
        self._thread.join(timeout_s)
        if self.dropped:
            logger.warning("%d events to the metrics views were dropped", self.dropped)
        if not self._thread.is_alive():
            return True
        logger.warning(
            "the metrics views did not finish within %.0f s (a full disk under tb/?); left "
            "behind, metrics.jsonl is complete",
            timeout_s,
        )
        _disarm_exit_hook(self._tb)
        return False


def _disarm_exit_hook(tensorboard: Any) -> None:
    """tensorboardX closes its event writer at interpreter exit, which waits for its writer
    thread: with that thread dead and its queue full it would wait for ever. Mark the
    writer closed so that the hook returns at once (what it would have written is lost)."""
    writer = getattr(getattr(tensorboard, "file_writer", None), "event_writer", None)
    if writer is not None and hasattr(writer, "_closed"):
        writer._closed = True
