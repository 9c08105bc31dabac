"""The step progress bar of ``loomrl run`` and ``Job.run()``: step, elapsed, eta and the
headline numbers, drawn with rich (in a terminal, and in a notebook's output cell).

The bar is drawn from the first step's record on, so an error before the first step (a bad
path, a dataset without the prompt column) is printed alone, with no empty bar above it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class StepProgress:
    """A context manager; ``on_record`` is what ``Job.run(on_record=...)`` takes. ``then``:
    another ``on_record`` called after the bar's (the caller's own)."""

    def __init__(
        self, total_steps: int, then: Callable[[dict[str, Any]], None] | None = None
    ) -> None:
        self.total_steps, self.then = total_steps, then
        self._progress: Any = None
        self._task: Any = None
        self._eval: float | None = None

    def __enter__(self) -> StepProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()

    def _start(self) -> None:
        from rich.progress import (
            BarColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self._progress = Progress(
            TextColumn("[bold]step {task.completed}/{task.total}"),
            BarColumn(),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            TextColumn("{task.fields[headline]}"),
            refresh_per_second=4,
        )
        self._task = self._progress.add_task("train", total=self.total_steps, headline="")
        self._progress.start()

    def on_record(self, record: dict[str, Any]) -> None:
        if "eval/mean_reward" in record:
            self._eval = record["eval/mean_reward"]
        if "step" in record and "rollout/reward_mean" in record:
            if self._progress is None:
                self._start()
            self._progress.update(
                self._task, completed=record["step"], headline="  ".join(self._parts(record))
            )
        if self.then is not None:
            self.then(record)

    def _parts(self, record: dict[str, Any]) -> list[str]:
        parts = [f"reward {record['rollout/reward_mean']:.3f}"]
        if self._eval is not None:
            parts.append(f"eval {self._eval:.3f}")
        if "rollout/staleness_mean" in record:
            parts.append(f"stale {record['rollout/staleness_mean']:.2f}")
        if "throughput/samples_per_s" in record:
            parts.append(f"{record['throughput/samples_per_s']:.0f} samples/s")
        if record.get("rollout/dropped_zero_variance"):
            parts.append(f"zero-variance dropped {record['rollout/dropped_zero_variance']}")
        return parts + fault_parts(record)


def fault_parts(record: dict[str, Any]) -> list[str]:
    """Executor failures and restarts for the progress line, shown once there are any."""
    failed = sum(
        v for k, v in record.items() if k.startswith("executor/") and k.endswith("_failures")
    )
    if not failed and not record.get("executor/trainer_restarts"):
        return []
    parts = [
        f"[yellow]executors failed {failed:.0f}, restarted {record.get('executor/restarts', 0):.0f}"
    ]
    if record.get("executor/hung_kills"):
        parts.append(f"hung {record['executor/hung_kills']:.0f}")
    if record.get("executor/trainer_restarts"):
        parts.append(f"job restarts {record['executor/trainer_restarts']:.0f}")
    return parts
