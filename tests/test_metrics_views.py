"""A view never stops a job (issue 49, item 3): with TensorBoard's writer dead on a full disk
(its queue full, so every event blocks) metrics.jsonl still gets every record, flush and close
return in bounded time, and a SIGTERM still ends the job with its checkpoint."""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from loomrl.telemetry import views
from loomrl.telemetry.metrics import MetricsLogger, read_metrics
from loomrl.training.checkpoint import checkpoint_step, latest_checkpoint

from conftest import ROOT, child_env, tiny_job_raw, write_job_file

pytestmark = pytest.mark.timeout(180)


class _StuckTensorBoard:
    """A SummaryWriter whose writer thread died: every event, the text and close block."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.calls = 0

    def _block(self, *args) -> None:
        self.calls += 1
        self.release.wait()

    def _get_file_writer(self):
        return self

    add_summary = add_text = close = _block


@pytest.fixture
def stuck(tmp_path, monkeypatch):
    tb = _StuckTensorBoard()
    monkeypatch.setattr(views, "CLOSE_TIMEOUT_S", 0.5)
    metrics = MetricsLogger(tmp_path, tensorboard=False)
    metrics._views = views.Views(
        tb, [], lambda t, s, n: t.add_summary(s, n), lambda t, s, n: t.add_text(s, n)
    )
    yield metrics, tb
    tb.release.set()


def test_a_hung_tensorboard_blocks_neither_the_record_nor_flush_nor_close(stuck, tmp_path, caplog):
    metrics, tb = stuck
    caplog.set_level(logging.WARNING)
    n = views.QUEUE_SIZE + 50
    t0 = time.monotonic()
    for step in range(n):
        metrics.log({"step": step, "train/loss": 1.0}, step)
        metrics.log_samples([{"prompt": "p", "completion": "c", "reward": 1.0}], step)
    metrics.flush(timeout_s=20)
    assert [r["step"] for r in read_metrics(tmp_path)] == list(range(n))
    assert tb.calls == 1  # the view took one event and hangs in it
    assert metrics._views.dropped >= n - views.QUEUE_SIZE
    dropped_warnings = [r for r in caplog.records if "are dropped" in r.getMessage()]
    assert len(dropped_warnings) == 1
    metrics.close()
    assert time.monotonic() - t0 < 15
    assert any("did not finish within" in r.getMessage() for r in caplog.records)


def test_flush_and_close_are_bounded_when_the_record_itself_hangs(tmp_path):
    metrics = MetricsLogger(tmp_path, tensorboard=False)
    release = threading.Event()
    real = metrics._file

    class _HungFile:
        def write(self, line):
            release.wait()
            return real.write(line)

    metrics._file = _HungFile()
    metrics.log({"step": 1}, 1)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="metrics.jsonl was not written within 1 s"):
        metrics.flush(timeout_s=1)
    metrics.close(timeout_s=1)
    assert time.monotonic() - t0 < 5
    release.set()


_FULL_DISK_RUN = """
import errno, sys
import tensorboardX.event_file_writer as efw

written = efw.EventsWriter.write_event

def full_after_the_first(self, event):
    # the event file was created, then the disk is full: the writer thread dies on its
    # first event, its 10-event queue fills, and each event after that blocks
    if getattr(self, "wrote", False):
        raise OSError(errno.ENOSPC, "No space left on device")
    self.wrote = True
    return written(self, event)

efw.EventsWriter.write_event = full_after_the_first
from loomrl.cli import main
sys.exit(main(["run", sys.argv[1]]))
"""


@pytest.mark.timeout(300)
def test_sigterm_ends_a_job_whose_tensorboard_died_on_a_full_disk(tmp_path, tiny_data):
    train, _ = tiny_data
    raw = tiny_job_raw(
        tmp_path, train, None, trainer={"num_steps": 500}, checkpoint={"every_steps": 1000}
    )
    job_file = write_job_file(tmp_path, raw)
    env = child_env()
    proc = subprocess.Popen(
        [sys.executable, "-c", _FULL_DISK_RUN, str(job_file)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL),
    )
    run_dir = Path(raw["output_dir"])
    # past tensorboardX's 10-event queue: with the old writer the record stopped there
    steps = _wait_for_steps(proc, run_dir / "metrics.jsonl", 16, timeout_s=120)
    assert steps >= 16, f"the record stopped at {steps} steps: the job hangs on TensorBoard"
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        _, stderr = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("the job ignored SIGTERM with its TensorBoard writer dead")
    assert time.monotonic() - t0 < 30
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-2000:]
    last = latest_checkpoint(run_dir / "checkpoints")
    assert last is not None and checkpoint_step(last) >= 16, stderr[-2000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["interrupted"] is True and summary["steps"] == checkpoint_step(last)
    assert not [p for p in run_dir.rglob("*.tmp*") if p.is_file()]


def _wait_for_steps(proc, metrics: Path, steps: int, timeout_s: float) -> int:
    """Steps in ``metrics`` once it has ``steps`` (or the time is up, or the job ended)."""
    deadline, seen = time.monotonic() + timeout_s, 0
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.is_file():
            seen = sum('"train/loss"' in line for line in metrics.read_text().splitlines())
            if seen >= steps:
                break
        time.sleep(0.1)
    return seen
