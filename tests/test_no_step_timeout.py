"""A job that makes no training step for ``no_step_timeout_s`` stops with the reason: here
every rollout fails and ``task.max_failure_rate = 1.0`` lets the job carry on for ever."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from loomrl.control.watchdog import NoStepError
from loomrl.job import Job


def always_fails(prompt, completion, **row):
    raise ValueError(f"no answer in {completion!r}")


def test_a_job_whose_every_rollout_fails_stops_with_the_reason(tiny_job):
    cfg = tiny_job(
        task={"reward": "test_no_step_timeout:always_fails", "max_failure_rate": 1.0},
        no_step_timeout_s=3.0,
    )
    start = time.monotonic()
    with pytest.raises(
        NoStepError, match=r"no training step completed .* no_step_timeout_s=3"
    ) as err:
        Job(cfg).run()
    assert time.monotonic() - start < 120
    assert "step 1 of 4" in str(err.value) and "ValueError: no answer in" in str(err.value)
    summary = json.loads((Path(cfg.output_dir) / "summary.json").read_text())
    assert summary["steps"] == 0 and summary["failed"] > 0
