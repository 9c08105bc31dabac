"""Weights & Biases as a metrics sink: ``[logging.wandb]`` in the job file.

Every record metrics.jsonl gets is logged at its step, and each step's samples as a table
(step, prompt, rendered prompt, completion, reward, reward parts). The W&B run's id is derived from the run folder, so
``loomrl resume`` continues the same W&B run. ``mode = "offline"`` writes under
``RUN_DIR/wandb`` with no network (``wandb sync RUN_DIR/wandb/offline-run-*`` uploads it
later). A W&B failure never stops training: it is logged once, and metrics.jsonl holds
every record.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


class WandbSink:
    def __init__(self, options: Any, run_dir: Path, name: str, config: dict[str, Any]) -> None:
        try:
            # lazy: wandb is optional (the wandb extra); its absence is reported here
            import wandb
        except ImportError:
            raise RuntimeError(
                "logging.wandb is set but the wandb package is not installed: pip install wandb "
                "(or remove [logging.wandb] from the job file)"
            ) from None
        self._wandb = wandb
        self.failed = False
        run_id = hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:16]
        self.run = wandb.init(
            project=options.project,
            entity=options.entity,
            name=name,
            id=run_id,
            resume="allow",
            dir=str(run_dir),
            mode=options.mode,
            config=config,
            tags=list(options.tags),
            # no history and summary tables at the end (metrics.jsonl and the report hold
            # them): W&B's own lines on where the run is stay
            settings=wandb.Settings(quiet=True),
        )

    def _guard(self, what: str, fn, *args) -> None:
        if self.failed:
            return
        try:
            fn(*args)
        except Exception as err:  # noqa: BLE001 - W&B never stops a run
            self.failed = True
            logger.warning(
                "W&B %s failed (%s); W&B logging stops, metrics.jsonl is complete", what, err
            )

    def log(self, scalars: dict[str, float], step: int) -> None:
        self._guard("log", self.run.log, scalars, step)

    def log_samples(self, samples: list[dict[str, Any]], step: int) -> None:
        def log() -> None:
            columns = ["step", "prompt", "rendered_prompt", "completion", "reward", "rewards"]
            table = self._wandb.Table(columns=columns)
            for s in samples:
                table.add_data(
                    step,
                    str(s.get("prompt")),
                    s.get("rendered_prompt"),
                    s.get("completion"),
                    s.get("reward"),
                    str(s.get("rewards", "")),
                )
            self.run.log({"samples": table}, step=step)

        self._guard("samples", log)

    def close(self) -> None:
        self._guard("finish", self.run.finish)
