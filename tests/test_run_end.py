"""``loomrl status`` and the report read a run's real end: a failed run shows ``failed``
with its error, an interrupted one the signal that stopped it, a running one ``running``
(not the summary its last session left); failed rollouts by kind with the counts of
summary.json and each kind's first error."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from loomrl.cli import main
from loomrl.job import Job
from loomrl.run_folder import RunFolderLock
from loomrl.telemetry.report import build_report
from loomrl.telemetry.run_status import format_status, run_status

from conftest import tiny_job_raw

pytest.importorskip("matplotlib")


def flaky_reward(prompt, completion, **row):
    """Raises for every other prompt: a run that fails once the failure rate is too high."""
    if int(row["answer"]) % 2:
        raise ValueError(f"no score for answer {row['answer']}")
    return 1.0


@pytest.fixture
def job(tmp_path):
    from loomrl.config import build_config

    train = tmp_path / "train.jsonl"
    train.write_text("".join(f'{{"prompt": "{i}+1=", "answer": "{i + 1}"}}\n' for i in range(64)))

    def make(**sections):
        raw = tiny_job_raw(tmp_path, train, **sections)
        raw["trainer"]["num_steps"] = 3
        return Job(build_config(raw))

    return make


def test_a_failed_run_shows_failed_with_its_error_and_failures_by_kind(job, capsys):
    failing = job(
        task={"reward": "test_run_end:flaky_reward", "max_failure_rate": 0.2, "failure_window": 8}
    )
    with pytest.raises(RuntimeError):
        failing.run()
    run_dir = failing.config.output_dir
    status = run_status(run_dir)
    summary = json.loads((Path(run_dir) / "summary.json").read_text())
    assert status["state"] == "failed"
    assert status["error"] == summary["error"] and "max_failure_rate" in status["error"]
    raised = status["failures"]["raised"]
    assert raised["count"] == summary["failures_by_kind"]["raised"] > 1
    assert raised["first_error"].startswith("reward function raised ValueError: no score")
    assert status["failed"] == summary["failed"]
    text = format_status(status)
    assert f"{run_dir}: failed: JobFailedError: " in text
    assert f"raised {raised['count']}: reward function raised ValueError: no score" in text
    page = build_report(run_dir).read_text()
    assert "<b>failed</b>: JobFailedError: " in page
    assert f"failed raised: {raised['count']}" in page and "no score for answer" in page
    assert main(["status", run_dir]) == 0
    assert "failed: JobFailedError" in capsys.readouterr().out


def test_an_interrupted_run_names_the_signal(job):
    interrupted = job()

    def stop(record):
        if record.get("step") == 1 and "train/loss" in record:
            os.kill(os.getpid(), signal.SIGTERM)

    result = interrupted.run(on_record=stop)
    assert result.summary["interrupted"] and result.summary["stopped_by"] == "SIGTERM"
    status = run_status(result.run_dir)
    assert (status["state"], status["signal"]) == ("interrupted", "SIGTERM")
    assert format_status(status).startswith(f"{result.run_dir}: interrupted by SIGTERM")
    assert "<b>interrupted by SIGTERM</b>" in build_report(result.run_dir).read_text()


def test_a_running_resume_is_running_not_its_last_sessions_end(job):
    result = job(task={"reward": "test_run_end:flaky_reward", "max_failure_rate": 1.0}).run()
    assert run_status(result.run_dir)["state"] == "finished"
    # failures by kind: the summary's counts, and they add up to its failed rollouts
    status = run_status(result.run_dir)
    assert status["failures"]["raised"]["count"] == result.summary["failed"] > 0
    lock = RunFolderLock(result.run_dir)
    lock.acquire()
    try:
        status = run_status(result.run_dir)
        assert (status["state"], status["pid"]) == ("running", os.getpid())
        assert status["error"] is None and status["signal"] is None
    finally:
        lock.release()
