"""How a run ended, read from its folder: finished, failed (with the error), interrupted
(by which signal), running, or stopped without a word (killed); and its failed rollouts by
kind, with the first error text of each kind. ``loomrl status`` and the report both read it
here, so they never disagree with ``summary.json``."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import Any

LOCK_FILE = ".lock"  # loomrl.run_folder.LOCK_FILE: a running run holds an flock on it
# A failure kind's count in a step record (cumulative): rollout/failed_<kind>.
FAILED_PREFIX = "rollout/failed_"


def running_pid(run_dir: Path) -> int | None:
    """The pid of the loomrl run holding ``run_dir``'s lock, or None when none does."""
    path = run_dir / LOCK_FILE
    if not path.is_file():
        return None
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        text = os.read(fd, 64).decode(errors="replace").strip()
        return int(text) if text.isdigit() else -1
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def run_end(summary: dict[str, Any], running: bool) -> dict[str, Any]:
    """``{"state": ..., "error": ..., "signal": ...}``: ``running`` while a process holds the
    folder's lock; else from ``summary.json``: ``failed`` (``job_failed``, its ``error``),
    ``interrupted`` (by ``stopped_by``, or SIGINT for a bare KeyboardInterrupt),
    ``finished``; with no summary, ``stopped`` (a kill -9, a machine lost)."""
    if running:
        return {"state": "running", "error": None, "signal": None}
    if not summary:
        return {"state": "stopped", "error": None, "signal": None}
    error = summary.get("error")
    error = error if isinstance(error, str) else None
    if summary.get("job_failed"):
        return {"state": "failed", "error": error, "signal": None}
    if summary.get("interrupted"):
        signal = summary.get("stopped_by")
        return {
            "state": "interrupted",
            "error": None,
            "signal": signal if isinstance(signal, str) else "SIGINT",
        }
    return {"state": "finished", "error": None, "signal": None}


def _count(value: Any) -> int | None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and value == value
    return int(value) if ok else None


def failures_by_kind(summary: dict[str, Any], last_record: dict[str, Any]) -> dict[str, dict]:
    """``{kind: {"count": n, "first_error": text}}``: the summary's ``failures_by_kind`` (the
    counts a run writes when it ends), else the newest step record's ``rollout/failed_<kind>``
    (a running or killed run); each kind's first error is the first line of the summary's
    ``first_failures`` message (its traceback follows in summary.json)."""
    counts = summary.get("failures_by_kind")
    if not isinstance(counts, dict):
        counts = {
            k.removeprefix(FAILED_PREFIX): v
            for k, v in last_record.items()
            if k.startswith(FAILED_PREFIX)
        }
    first = summary.get("first_failures")
    first = first if isinstance(first, dict) else {}
    kinds = {}
    for kind in sorted({*counts, *first}):
        message = first.get(kind)
        kinds[str(kind)] = {
            "count": _count(counts.get(kind)),
            "first_error": message.partition("\n")[0] if isinstance(message, str) else None,
        }
    return kinds
