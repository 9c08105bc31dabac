"""Metrics sinks: one JSON line per record in ``metrics.jsonl``, and TensorBoard scalars."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


class MetricsLogger:
    """Appends records to ``run_dir/metrics.jsonl`` and, when available, ``run_dir/tb``."""

    def __init__(self, run_dir: Path, tensorboard: bool = True, purge_step: int | None = None) -> None:
        """``purge_step``: a resumed run's first step; TensorBoard hides the events the run
        wrote at or after it before the crash (metrics.jsonl is cut by the caller)."""
        self.path = run_dir / "metrics.jsonl"
        self._file = self.path.open("a", buffering=1)
        self._tb = None
        if tensorboard:
            try:
                from tensorboardX import SummaryWriter

                self._tb = SummaryWriter(str(run_dir / "tb"), purge_step=purge_step)
            except ImportError:  # optional sink
                logger.info("tensorboardX not installed; TensorBoard logs disabled")

    def log(self, record: dict[str, Any], step: int) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self._file.write(json.dumps(clean, sort_keys=True) + "\n")
        if self._tb is not None:
            for key, value in record.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                    self._tb.add_scalar(key, value, step)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
