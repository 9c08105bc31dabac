"""Metrics sinks: one JSON line per record in ``metrics.jsonl``, and TensorBoard scalars;
completion samples in ``samples.jsonl`` (and TensorBoard text).

``metrics.jsonl`` and ``samples.jsonl`` are the record; TensorBoard and W&B are views of it,
fed without blocking (``loomrl.telemetry.views``): a view that hangs or fails never stops
the job, and every wait on the writer thread is bounded."""

from __future__ import annotations

import json
import logging
import math
import queue
import re
import threading
from pathlib import Path
from typing import Any

from loomrl.telemetry.views import Views

logger = logging.getLogger(__name__)
_INVALID_TAG = re.compile(r"[^-/\w\.]")  # what TensorBoard's own writers replace in a tag
WRITE_EVERY_S = 0.2  # how often the writer looks for records (flush and close wake it at once)
FLUSH_TIMEOUT_S = 120.0  # how long flush waits for metrics.jsonl (a hung filesystem)
CLOSE_TIMEOUT_S = 30.0  # how long close waits for the writer thread


class MetricsLogger:
    """Appends records to ``run_dir/metrics.jsonl`` and, when available, ``run_dir/tb``."""

    def __init__(
        self,
        run_dir: Path,
        tensorboard: bool = True,
        purge_step: int | None = None,
        sinks: list[Any] = (),
    ) -> None:
        """``purge_step``: a resumed run's first step; TensorBoard hides the events the run
        wrote at or after it before the crash (metrics.jsonl is cut by the caller).
        ``sinks``: more sinks (``WandbSink``), given each record's finite scalars and each
        step's samples on the writer thread, and closed with it."""
        self._sinks = list(sinks)
        self.path = run_dir / "metrics.jsonl"
        self._file = self.path.open("a", buffering=1)
        self.samples_path = run_dir / "samples.jsonl"
        self._samples_file = None  # opened at the first samples
        self._tb = None
        if tensorboard:
            try:
                # lazy: tensorboardX loads only where TensorBoard logs are written
                from tensorboardX import SummaryWriter

                self._tb = SummaryWriter(str(run_dir / "tb"), purge_step=purge_step)
            except ImportError:  # optional sink
                logger.info("tensorboardX not installed; TensorBoard logs disabled")
            except OSError as err:  # a full disk: a view is optional
                logger.warning(
                    "TensorBoard logs disabled: cannot write %s (%s)", run_dir / "tb", err
                )
        self._views = Views(self._tb, self._sinks, _write_tb_scalars, _write_tb_text)

        # Records are written on a thread of their own, off the controller's loop: JSON for
        # metrics.jsonl, and one TensorBoard event per step, not one per scalar. The writer
        # drains the queue every WRITE_EVERY_S rather than being woken by each record: a
        # wake-up of another thread costs the loop, and the writer's turns take the GIL from
        # the executors' threads on ``local`` once, not every step.
        self._kick = threading.Event()
        self._queue: queue.SimpleQueue[tuple[dict[str, Any], int] | threading.Event | None] = (
            queue.SimpleQueue()
        )
        self._error: BaseException | None = None  # the first metrics.jsonl write that failed
        self._thread = threading.Thread(target=self._write, name="loomrl-metrics", daemon=True)
        self._thread.start()

    def log(self, record: dict[str, Any], step: int, *, owned: bool = False) -> None:
        """Queue ``record`` (a snapshot: the caller may change its dict afterwards; with
        ``owned`` the dict itself, which the caller hands over) for ``metrics.jsonl`` and
        TensorBoard; written within WRITE_EVERY_S, and ``flush`` or ``close`` waits for it.
        Raises if an earlier record could not be written (the disk is full, the folder
        went away)."""
        self._raise_write_error()
        self._queue.put((record if owned else record.copy(), step))

    def log_samples(self, samples: list[dict[str, Any]], step: int) -> None:
        """Queue a step's (prompt, completion, reward) samples: one JSON line each in
        ``samples.jsonl`` (with ``step``), and one TensorBoard text entry per step."""
        self._raise_write_error()
        self._queue.put((_Samples(samples), step))

    def flush(self, timeout_s: float = FLUSH_TIMEOUT_S) -> None:
        """Wait until every record logged so far is in ``metrics.jsonl`` (before a
        checkpoint: resume keeps the record up to the checkpoint's step); at most
        ``timeout_s`` (TimeoutError). The views are not waited for."""
        written = threading.Event()
        self._queue.put(written)
        self._kick.set()
        if not written.wait(timeout_s):
            raise TimeoutError(f"{self.path} was not written within {timeout_s:.0f} s")
        self._raise_write_error()

    def _raise_write_error(self) -> None:
        if self._error is not None:
            raise OSError(f"could not write {self.path}: {self._error}") from self._error

    def _items(self):
        """What is queued, as it comes, every WRITE_EVERY_S (or at once when kicked), until
        ``close``'s None."""
        while True:
            self._kick.wait(WRITE_EVERY_S)
            self._kick.clear()
            try:
                while True:
                    item = self._queue.get_nowait()
                    if item is None:
                        return
                    yield item
            except queue.Empty:
                pass

    def _write(self) -> None:
        for item in self._items():
            if isinstance(item, threading.Event):
                item.set()
                continue
            record, step = item
            if isinstance(record, _Samples):
                self._write_samples(record.samples, step)
                continue
            try:  # the common case, all in C: no value is NaN or infinite
                line = json.dumps(record, sort_keys=True, allow_nan=False)
            except ValueError:  # JSON has no NaN or infinity: they are written as null
                clean = {
                    k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                    for k, v in record.items()
                }
                line = json.dumps(clean, sort_keys=True)
            try:
                self._file.write(line + "\n")
            except Exception as err:  # noqa: BLE001 - raised on the caller's next log or flush
                self._error = self._error or err
            self._views.offer("scalars", _finite_scalars(record), step)

    def _write_samples(self, samples: list[dict[str, Any]], step: int) -> None:
        lines = "".join(json.dumps({"step": step, **s}, default=str) + "\n" for s in samples)
        try:
            if self._samples_file is None:
                self._samples_file = self.samples_path.open("a", buffering=1)
            self._samples_file.write(lines)
        except Exception as err:  # noqa: BLE001 - raised on the caller's next log or flush
            self._error = self._error or err
        self._views.offer("samples", samples, step)

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Write what is queued, then close the sinks; waits at most ``timeout_s`` for the
        writer and a bounded time for the views (a hung one is left behind, warned)."""
        self._queue.put(None)
        self._kick.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.error(
                "the metrics writer did not finish within %.0f s; %s may miss its last records",
                timeout_s,
                self.path,
            )
        else:
            self._file.close()
            if self._samples_file is not None:
                self._samples_file.close()
        self._views.close()


def _finite_scalars(record: dict[str, Any]) -> dict[str, float]:
    """The record's finite numbers: what a view plots."""
    return {
        k: v
        for k, v in record.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    }


def _write_tb_scalars(tb, scalars: dict[str, float], step: int) -> None:
    """A step's scalars as one event of many values (TensorBoard reads it as the same
    scalar series as one event per scalar; one event costs about what one scalar did)."""
    # lazy: tensorboardX loads only where TensorBoard logs are written
    from tensorboardX.proto.summary_pb2 import Summary

    summary = Summary(
        value=[
            Summary.Value(tag=_INVALID_TAG.sub("_", key), simple_value=float(value))
            for key, value in scalars.items()
        ]
    )
    tb._get_file_writer().add_summary(summary, step)


def _write_tb_text(tb, samples: list[dict[str, Any]], step: int) -> None:
    """A step's samples as one markdown text entry: a prompt and its completion per sample."""
    tb.add_text("samples", "\n\n".join(_as_markdown(s) for s in samples), step)


class _Samples:
    """A step's samples on the writer's queue (told apart from a metrics record)."""

    __slots__ = ("samples",)

    def __init__(self, samples: list[dict[str, Any]]) -> None:
        self.samples = samples


def _as_markdown(sample: dict[str, Any]) -> str:
    prompt = sample["prompt"] if isinstance(sample["prompt"], str) else json.dumps(sample["prompt"])
    return f"**reward {sample['reward']}**\n\n```\n{prompt}\n```\n```\n{sample['completion']}\n```"


def read_samples(run_dir: str | Path) -> list[dict[str, Any]]:
    """The samples a run wrote, in order (``samples.jsonl``)."""
    path = Path(run_dir) / "samples.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
