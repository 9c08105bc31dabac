"""``loomrl report`` and ``loomrl status`` from a run folder: a fixture run (a 4-step gsm8k
job's metrics.jsonl, summary.json, config.json and trace.json) draws every figure, and a
run holding its folder's lock shows as running."""

from __future__ import annotations

import base64
import io
import json
import re
import shutil
import subprocess
import sys

import pytest

from loomrl.run_folder import RunFolderLock
from loomrl.telemetry.report import ReportError, build_report
from loomrl.telemetry.run_status import run_status

from conftest import ROOT

Image = pytest.importorskip("PIL.Image")
pytest.importorskip("matplotlib")

FIXTURE = ROOT / "tests/data/run_fixture"
FIGURES = [
    "Reward over steps",
    "Reward over wall time",
    "Throughput",
    "Staleness",
    "Executor timeline",
    "Busy fraction",
    "Weight sync bytes",
    "Weight sync time",
    "Failures by reason",
]


@pytest.fixture
def run_dir(tmp_path):
    return shutil.copytree(FIXTURE, tmp_path / "run")


def test_the_report_draws_every_figure_as_a_readable_png(run_dir):
    page = build_report(run_dir).read_text()
    titles = re.findall(
        r'<h2>([^<]+)</h2><img alt="[^"]+" src="data:image/png;base64,([^"]+)"', page
    )
    assert [t for t, _ in titles] == FIGURES
    for title, data in titles:
        image = Image.open(io.BytesIO(base64.b64decode(data)))
        assert image.width >= 500 and image.height >= 150, title  # drawn at a readable size
    assert "gsm8k" in page and "eval reward at end" in page


def test_the_timeline_shows_each_executor_lane(run_dir):
    from loomrl.telemetry.report import _read_json, _timeline_figure

    events = _read_json(run_dir / "trace.json")["traceEvents"]
    png, busy = _timeline_figure(events)
    assert png is not None and set(busy) == {"generator0", "scorer0", "trainer"}
    assert all(0 < frac <= 1 for frac in busy.values())


def test_a_report_without_trace_or_summary_still_builds(run_dir):
    (run_dir / "trace.json").unlink()
    (run_dir / "summary.json").unlink()
    page = build_report(run_dir).read_text()
    assert "Executor timeline" not in page and "Reward over steps" in page
    assert "stopped without a summary" in page


def test_status_says_finished_running_or_stopped(run_dir):
    status = run_status(run_dir)
    assert status["state"] == "finished" and status["step"] == 4 and status["num_steps"] == 4
    (run_dir / "summary.json").unlink()
    assert run_status(run_dir)["state"] == "stopped"
    lock = RunFolderLock(run_dir)
    lock.acquire()
    try:
        status = run_status(run_dir)
        assert status["state"] == "running" and status["pid"] > 0 and "eta_s" in status
    finally:
        lock.release()


def test_cli_report_and_status(run_dir, tmp_path):
    def cli(*args):
        return subprocess.run(
            [sys.executable, "-m", "loomrl.cli", *args], capture_output=True, text=True
        )

    out = cli("report", str(run_dir), "--out", str(tmp_path / "r.html"))
    assert out.returncode == 0 and (tmp_path / "r.html").stat().st_size > 10_000
    status = cli("status", str(run_dir), "--json")
    assert json.loads(status.stdout)["state"] == "finished"
    bad = cli("report", str(tmp_path))
    assert bad.returncode == 2 and "no metrics.jsonl" in bad.stderr
    with pytest.raises(ReportError):
        build_report(tmp_path)


def test_a_metric_key_with_dollars_is_drawn_as_text(run_dir):
    # matplotlib reads "$...$" as mathtext; "\frac" without arguments made it raise
    records = (run_dir / "metrics.jsonl").read_text().splitlines()
    last = json.loads(records[-1])
    last["reward/$\\frac$_mean"] = 0.5
    records[-1] = json.dumps(last)
    (run_dir / "metrics.jsonl").write_text("\n".join(records) + "\n")
    page = build_report(run_dir).read_text()
    assert "Reward over steps" in page


def test_a_report_that_cannot_be_drawn_is_a_clear_error_and_leaves_no_stale_page(run_dir):
    old = build_report(run_dir)
    events = json.loads((run_dir / "trace.json").read_text())
    for event in events["traceEvents"]:
        if event.get("ph") == "X":
            event["ts"] = "not a time"
    (run_dir / "trace.json").write_text(json.dumps(events))
    with pytest.raises(ReportError, match=r"could not draw .*Executor timeline.*removed"):
        build_report(run_dir)
    assert not old.exists()
