"""What resume does to the record: metrics cut at the checkpoint and marked, one summary
for the whole run, a finished run left as it is, and a checkpoint of what the trainer
has when a generator dies."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest

from loomrl import cli
from loomrl.generation.hf import HFGenerator
from loomrl.job import Job, resume_job
from loomrl.telemetry.metrics import read_metrics
from loomrl.training.checkpoint import latest_checkpoint, load_checkpoint


def _crash_after_step_3(run_dir) -> None:
    """What a kill -9 after step 3 leaves when the last checkpoint is step 2."""
    shutil.rmtree(run_dir / "checkpoints" / "step_000003")
    shutil.rmtree(run_dir / "final")
    (run_dir / "summary.json").unlink()


def _tb_events(tb_dir: Path) -> list:
    """Every event in the TensorBoard files under ``tb_dir`` (TFRecord framing)."""
    from tensorboardX.proto import event_pb2

    events = []
    for path in sorted(tb_dir.glob("events.out.tfevents.*")):
        data, pos = path.read_bytes(), 0
        while pos + 12 <= len(data):
            (length,) = struct.unpack("<Q", data[pos : pos + 8])
            event = event_pb2.Event()
            event.ParseFromString(data[pos + 12 : pos + 12 + length])
            events.append(event)
            pos += 12 + length + 4
    return events


def test_tensorboard_gets_every_scalar_of_a_record_at_its_step(tmp_path):
    """One event per step holds all its scalars (cheaper than one event each); non-finite
    values, strings and booleans stay out, odd characters in a tag become '_'."""
    from loomrl.telemetry.metrics import MetricsLogger

    metrics = MetricsLogger(tmp_path)
    metrics.log(
        {
            "train/loss": 0.5,
            "rollout/generated": 128,
            "eval/x y": 2.0,
            "bad": float("nan"),
            "flag": True,
            "note": "text",
        },
        step=1,
    )
    metrics.log({"train/loss": 0.25}, step=2)
    metrics.close()
    scalars = {
        (v.tag, e.step): v.simple_value
        for e in _tb_events(tmp_path / "tb")
        for v in e.summary.value
    }
    assert scalars == {
        ("train/loss", 1): 0.5,
        ("rollout/generated", 1): 128.0,
        ("eval/x_y", 1): 2.0,
        ("train/loss", 2): 0.25,
    }


def test_metrics_are_written_off_the_caller_flush_waits_for_them_and_a_failed_write_is_raised(
    tmp_path,
):
    """The controller's loop only queues a record; ``flush`` (before every checkpoint) and
    ``close`` wait until it is in metrics.jsonl, and a write that failed is not silent."""
    from loomrl.telemetry.metrics import MetricsLogger

    metrics = MetricsLogger(tmp_path, tensorboard=False)
    record = {"step": 1, "train/loss": float("nan")}
    metrics.log(record, step=1)
    record["step"] = 99  # the caller may change its dict afterwards: the logged one is a snapshot
    metrics.flush()
    assert read_metrics(tmp_path) == [{"step": 1, "train/loss": None}]  # (NaN is null in JSON)
    metrics._file.close()  # the file goes away under the writer
    metrics.log({"step": 2}, step=2)
    with pytest.raises(OSError, match="could not write"):
        metrics.flush()
    with pytest.raises(OSError, match="could not write"):
        metrics.log({"step": 3}, step=3)
    metrics._file = (tmp_path / "other.jsonl").open("a")
    metrics.close()


def test_a_record_reaches_metrics_jsonl_without_a_flush_and_an_owned_one_is_not_copied(tmp_path):
    """The writer is not woken per record: it drains the queue every WRITE_EVERY_S, so a
    record is on disk within that even if nothing flushes (a job that hangs later)."""
    import queue
    import time

    from loomrl.telemetry.metrics import WRITE_EVERY_S, MetricsLogger

    queued: list = []

    class Spy(queue.SimpleQueue):
        def put(self, item, *args, **kwargs):
            queued.append(item)
            super().put(item, *args, **kwargs)

    metrics = MetricsLogger(tmp_path, tensorboard=False)
    metrics._queue = Spy()  # (before anything is queued; the writer reads the attribute)
    record = {"step": 1, "train/loss": 0.5}
    metrics.log(record, step=1, owned=True)
    metrics.log(dict(record), step=1)
    # handed over, not copied; else a snapshot
    assert queued[0][0] is record and queued[1][0] is not record
    deadline = time.monotonic() + 20 * WRITE_EVERY_S
    while len(read_metrics(tmp_path)) < 2 and time.monotonic() < deadline:
        time.sleep(WRITE_EVERY_S / 4)
    assert read_metrics(tmp_path) == [record, record]
    metrics.close()


def test_resume_cuts_the_record_at_the_checkpoint_and_keeps_one_summary(tiny_job):
    first = Job(tiny_job(trainer={"num_steps": 3}, checkpoint={"every_steps": 2, "keep": 5})).run()
    run = first.run_dir
    _crash_after_step_3(run)
    before = load_checkpoint(run / "checkpoints" / "step_000002")["controller"]["history"]
    resumed = resume_job(run)
    records = read_metrics(run)
    steps = [r["step"] for r in records if "train/loss" in r]
    assert steps == [1, 2, 3]  # step 3 once, not once per attempt
    # no eval at the resume point
    assert [r["step"] for r in records if "eval/mean_reward" in r] == [0, 3]
    (mark,) = [r for r in records if r.get("event") == "resume"]
    purges = [
        e.step
        for e in _tb_events(run / "tb")
        if e.HasField("session_log") and e.session_log.status == 1
    ]
    assert purges == [3]  # TensorBoard drops what the crashed attempt logged from step 3 on
    # step 3 and its final eval
    assert mark["resume/from_step"] == 2 and mark["resume/dropped_records"] == 2
    s = resumed.summary
    assert s["eval_start"] == first.summary["eval_start"] == before["eval_start"]
    assert s["elapsed_s"] > before["elapsed_s"] > 0  # the time before the crash counts too
    assert s["samples_per_s"] == pytest.approx(s["trained"] / s["elapsed_s"])
    assert s["trained"] == 3 * 16


def test_resuming_a_finished_run_says_so_and_keeps_its_summary(tiny_job, capsys):
    result = Job(tiny_job(trainer={"num_steps": 2})).run()
    summary = (result.run_dir / "summary.json").read_text()
    metrics = (result.run_dir / "metrics.jsonl").read_text()
    again = resume_job(result.run_dir)
    assert again.summary["already_finished"] is True and again.summary["samples_per_s"] > 0
    assert cli.main(["resume", str(result.run_dir)]) == 0
    assert "already finished" in capsys.readouterr().out
    assert (result.run_dir / "summary.json").read_text() == summary
    assert (result.run_dir / "metrics.jsonl").read_text() == metrics


def test_a_generator_that_dies_leaves_a_checkpoint_of_what_the_trainer_has(tiny_job, monkeypatch):
    calls = {"n": 0}
    real = HFGenerator.generate

    def dying(self, requests, apply_newest=False):
        calls["n"] += 1
        if calls["n"] > 12:
            raise RuntimeError("generator lost its device")
        return real(self, requests, apply_newest)

    monkeypatch.setattr(HFGenerator, "generate", dying)
    cfg = tiny_job(trainer={"num_steps": 50}, checkpoint={"every_steps": 100}, data={"eval": None})
    with pytest.raises(RuntimeError, match="generator lost its device"):
        Job(cfg).run()
    run = Path(cfg.output_dir)
    last = latest_checkpoint(run / "checkpoints")
    assert last is not None  # checkpoint every 100 steps: this one is the failure's
    version = load_checkpoint(last)["controller"]["version"]
    assert version >= 1 and last.name == f"step_{version:06d}"
    summary = json.loads((run / "summary.json").read_text())  # a failed job has one too
    assert summary["job_failed"] is True and "generator lost its device" in summary["error"]
    assert summary["steps"] == version
