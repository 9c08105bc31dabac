"""Spans from every process of a run, as one Chrome trace-event file: ``RUN_DIR/trace.json``.

Open it in Perfetto (ui.perfetto.dev) or chrome://tracing: one row per process (controller,
trainer, generators, scorers), the controller's calls on one lane per executor, each
executor's own spans (the endpoint it ran, publishing, sandbox runs, lease waits) under it.

Each process appends its spans to ``RUN_DIR/trace/trace-PID.jsonl`` (buffered, flushed every
second or so and at exit); the session merges them into ``trace.json`` when the run ends.
Timestamps are wall-clock microseconds (``time.time_ns``), the one clock every process on a
machine shares, so spans of different processes line up; across machines they are as close
as the machines' clocks. A process killed with SIGKILL loses its last second of spans.

Processes started by an executor runtime find the folder in ``LOOMRL_TRACE_DIR`` (set by the
session before executors start): ``configure_from_env(name)``.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

ENV = "LOOMRL_TRACE_DIR"
FLUSH_EVERY_S = 1.0
MAX_EVENTS = 2_000_000  # per process and run: a cap on the file, not a limit a run meets


class Tracer:
    """One process's spans, appended to ``folder/trace-PID.jsonl``."""

    def __init__(self, folder: Path, process_name: str) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.pid = os.getpid()
        self.path = self.folder / f"trace-{self.pid}.jsonl"
        self.dropped = 0
        self._lock = threading.Lock()
        self._events: list[dict[str, Any]] = []
        self._written = 0
        self._lanes: dict[str, int] = {}
        self._last_flush = time.monotonic()
        self._meta("process_name", 0, process_name)

    def _meta(self, kind: str, tid: int, name: str) -> None:
        self._events.append(
            {"name": kind, "ph": "M", "pid": self.pid, "tid": tid, "args": {"name": name}}
        )

    def _tid(self, lane: str | None) -> int:
        """A thread id for a lane (a named row: an executor the controller calls), or the
        calling thread's id."""
        if lane is None:
            return threading.get_native_id()
        tid = self._lanes.get(lane)
        if tid is None:  # (under self._lock)
            tid = self._lanes[lane] = 1_000_000 + len(self._lanes)
            self._meta("thread_name", tid, lane)
        return tid

    def add(
        self,
        name: str,
        cat: str,
        start_ns: int,
        end_ns: int,
        lane: str | None = None,
        args: dict[str, Any] | None = None,
    ) -> None:
        """A complete span, from ``time.time_ns()`` readings."""
        event = {
            "name": name,
            "cat": cat,
            "ph": "X",
            "ts": start_ns / 1000,
            "dur": max(end_ns - start_ns, 0) / 1000,
            "pid": self.pid,
        }
        if args:
            event["args"] = args
        with self._lock:
            if self._written + len(self._events) >= MAX_EVENTS:
                self.dropped += 1
                return
            event["tid"] = self._tid(lane)
            self._events.append(event)
        if time.monotonic() - self._last_flush > FLUSH_EVERY_S:
            self.flush()

    @contextmanager
    def span(self, name: str, cat: str, lane: str | None = None, **args: Any) -> Iterator[None]:
        start = time.time_ns()
        try:
            yield
        finally:
            self.add(name, cat, start, time.time_ns(), lane, args or None)

    def flush(self) -> None:
        with self._lock:
            events, self._events = self._events, []
            self._last_flush = time.monotonic()
            if not events:
                return
            self._written += len(events)
            text = "".join(json.dumps(e, separators=(",", ":")) + "\n" for e in events)
            try:
                with self.path.open("a", encoding="utf-8") as f:
                    f.write(text)
            except OSError as err:  # a full disk loses spans, never the run
                logger.warning("trace: could not write %s (%s); spans lost", self.path, err)


_tracer: Tracer | None = None
_guard = threading.Lock()


def start(folder: str | Path, process_name: str) -> Tracer:
    """Trace this process into ``folder``, and every executor process started after this
    (through ``LOOMRL_TRACE_DIR``)."""
    global _tracer
    with _guard:
        if _tracer is not None:
            _tracer.flush()
        _tracer = Tracer(Path(folder), process_name)
        os.environ[ENV] = str(folder)
    return _tracer


def configure_from_env(process_name: str) -> None:
    """In an executor process: trace into ``$LOOMRL_TRACE_DIR`` when the session set it."""
    folder = os.environ.get(ENV)
    if folder:
        global _tracer
        with _guard:
            _tracer = Tracer(Path(folder), process_name)
        atexit.register(_tracer.flush)


def stop() -> None:
    """Flush and stop tracing this process (executor processes started later are not
    traced)."""
    global _tracer
    with _guard:
        if _tracer is not None:
            _tracer.flush()
        _tracer = None
        os.environ.pop(ENV, None)


def current() -> Tracer | None:
    return _tracer


def span(name: str, cat: str, lane: str | None = None, **args: Any):
    """A span around a block, or nothing (one global read) when this process is not traced."""
    tracer = _tracer
    if tracer is None:
        return nullcontext()
    return tracer.span(name, cat, lane, **args)


def read_events(folder: Path) -> list[dict[str, Any]]:
    """Every event of every process file in ``folder`` (a last line cut short by a killed
    process is skipped)."""
    events = []
    for path in sorted(Path(folder).glob("trace-*.jsonl")):
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return events


def merge(folder: str | Path, out: str | Path) -> Path | None:
    """Write ``out`` (trace.json) from the process files in ``folder``; None when there are
    none."""
    folder, out = Path(folder), Path(out)
    if not folder.is_dir():
        return None
    events = read_events(folder)
    if not events:
        return None
    events.sort(key=lambda e: (e.get("ph") != "M", e.get("ts", 0)))
    tmp = out.with_suffix(".json.tmp")
    try:
        tmp.write_text(
            json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}, separators=(",", ":")),
            encoding="utf-8",
        )
        os.replace(tmp, out)
    except OSError:
        # a full disk: no partial (often 0-byte) temporary file is left behind
        tmp.unlink(missing_ok=True)
        raise
    return out
