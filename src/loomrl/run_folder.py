"""The run folder: one run per folder, locked while a run uses it.

A folder that already holds a run (a ``config.json``, metrics, checkpoints or a final
model) is refused by a new run unless it is asked to overwrite it; ``resume`` continues
the run that is there. While a run (or a resume) uses a folder it holds an exclusive
``flock`` on ``<run_dir>/.lock``, so a second ``loomrl run`` or ``resume`` with the same
folder fails at once instead of interleaving its metrics with the first. The lock goes
away with the process, so kill -9 leaves nothing to clean up.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from loomrl.config import JobConfig

logger = logging.getLogger(__name__)

LOCK_FILE = ".lock"
# What a run writes into its folder; --overwrite removes exactly these.
RUN_ENTRIES = (
    "config.json",
    "metrics.jsonl",
    "summary.json",
    "tb",
    "checkpoints",
    "final",
    "weight_updates",
    "eval.json",
    "eval_samples.jsonl",
)


@dataclass
class JobResult:
    """What a finished run returns: its folder, its summary and the evals along the way."""

    run_dir: Path
    summary: dict[str, Any]
    eval_history: list[dict[str, Any]] = field(default_factory=list)


def default_run_dir(cfg: JobConfig) -> Path:
    """``output_dir``, or ``runs/<name>-<date>-<time>``."""
    if cfg.output_dir:
        return Path(cfg.output_dir)
    return Path("runs") / f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}"


def write_json_atomically(path: Path, obj: Any) -> bool:
    """Write ``obj`` as JSON to ``path`` through a temporary file and a rename, so ``path`` is
    never a partial (or, on a full disk, 0-byte) file: it is the new content or the old one.
    A failure is logged, not raised (a summary must not hide the error that ended a run);
    returns whether it was written."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return True
    except (OSError, TypeError, ValueError) as err:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        logger.error("could not write %s: %s", path, err)
        return False


class RunFolderError(ValueError):
    """A run folder that cannot be used: it holds another run, is in use, or is unwritable."""


def holds_run(run_dir: Path) -> bool:
    return any((run_dir / name).exists() for name in RUN_ENTRIES)


def never_trained(run_dir: Path) -> bool:
    """A run that failed or was stopped before its first step: its summary says so (0
    steps), and it left no checkpoint and no final model. Nothing in it can be resumed, so a
    new run in the folder replaces it without ``--overwrite``."""
    checkpoints = run_dir / "checkpoints"
    if (run_dir / "final").exists() or (checkpoints.is_dir() and any(checkpoints.iterdir())):
        return False
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return False
    ended_early = summary.get("job_failed") or summary.get("interrupted")
    return bool(isinstance(summary, dict) and ended_early and not summary.get("steps"))


def _remove_run(run_dir: Path) -> None:
    for name in RUN_ENTRIES:
        path = run_dir / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


def check_writable(run_dir: Path) -> None:
    """Create ``run_dir`` (and parents) and prove a file can be written there; one-line
    error otherwise. Cheap, so it runs before any model is loaded."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        reason = err.strerror or type(err).__name__
        raise RunFolderError(
            f"output dir {str(run_dir)!r} is not usable: {reason}; choose a writable folder with --output-dir"
        ) from None


class RunFolderLock:
    """An exclusive, non-blocking ``flock`` on ``run_dir/.lock`` for the life of a run."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 64).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise RunFolderError(
                f"run folder {str(self.path.parent)!r} is in use by another loomrl run (pid {holder}); "
                "wait for it to finish or use another --output-dir"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.ftruncate(self._fd, 0)
            os.close(self._fd)  # closing drops the flock
            self._fd = None

    def __enter__(self) -> RunFolderLock:
        if self._fd is None:
            self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def claim_run_folder(run_dir: Path, *, resume: bool, overwrite: bool) -> RunFolderLock:
    """Check and lock ``run_dir`` for a new run or a resume; returns the held lock.

    A new run refuses a folder that holds a run unless ``overwrite``, which removes the
    old run's files (after taking the lock, so a live run is never removed)."""
    check_writable(run_dir)
    lock = RunFolderLock(run_dir)
    lock.acquire()
    try:
        if not resume and holds_run(run_dir):
            if never_trained(run_dir):
                _remove_run(run_dir)
                logger.info("replaced the run in %s that ended before its first step", run_dir)
            elif not overwrite:
                raise RunFolderError(
                    f"output dir {str(run_dir)!r} already holds a run; `loomrl resume {run_dir}` continues it, "
                    "--overwrite (Job.run(overwrite=True)) replaces it, or choose another --output-dir"
                )
            else:
                _remove_run(run_dir)
                logger.warning("--overwrite: removed the previous run in %s", run_dir)
    except BaseException:
        lock.release()
        raise
    return lock
