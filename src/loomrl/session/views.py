"""What a run shows besides metrics.jsonl: trace.json, report.html and W&B
(``loomrl.telemetry``). Each is a view of the run: none of them fails it."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from loomrl.config import JobConfig
from loomrl.telemetry import trace
from loomrl.telemetry.report import build_report
from loomrl.telemetry.wandb_sink import WandbSink

logger = logging.getLogger(__name__)


@contextmanager
def run_views(cfg: JobConfig, run_dir: Path) -> Iterator[None]:
    """Spans of every process of the run into ``run_dir/trace/``, merged into trace.json at
    the end, then report.html, however the run ends."""
    if cfg.logging.trace:
        trace.start(run_dir / "trace", "controller")
    try:
        yield
    finally:
        if cfg.logging.trace:
            trace.stop()
            try:
                trace.merge(run_dir / "trace", run_dir / "trace.json")
            except (OSError, ValueError) as err:
                logger.warning("could not write %s: %s", run_dir / "trace.json", err)
        if cfg.logging.report and (run_dir / "metrics.jsonl").is_file():
            _write_report(run_dir)


def extra_sinks(cfg: JobConfig, run_dir: Path) -> list[Any]:
    """Metrics sinks beside metrics.jsonl and TensorBoard: W&B when ``[logging.wandb]`` is set."""
    if cfg.logging.wandb is None:
        return []

    return [WandbSink(cfg.logging.wandb, run_dir, cfg.name, cfg.model_dump(mode="json"))]


def _write_report(run_dir: Path) -> None:
    try:
        build_report(run_dir)
    except Exception as err:  # noqa: BLE001 - a plot that fails must not fail a finished run
        logger.warning(
            "could not write %s: %s: %s", run_dir / "report.html", type(err).__name__, err
        )
