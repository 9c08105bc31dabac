"""A loomrl job under the scheduler: its device phases run in leases, it gives the
device way to another job (offloading its trainer and generator), and it trains exactly
as it does alone. Without ``scheduler.url`` nothing of the scheduler is imported."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

from loomrl.job import Job
from loomrl.scheduler.client import SchedulerClient, get_json
from loomrl.scheduler.server import SchedulerDaemon
from loomrl.telemetry.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]


def losses(result) -> list[float]:
    return [r["train/loss"] for r in read_metrics(result.run_dir) if "train/loss" in r]


def test_a_shared_job_trains_exactly_as_alone_while_giving_way(tiny_job, tmp_path):
    sections = {
        "algorithm": {"max_staleness": 0},
        "trainer": {"num_steps": 3},
        "data": {"eval": None},
    }
    alone = Job(tiny_job(**sections, output_dir=str(tmp_path / "alone"))).run()
    daemon = SchedulerDaemon({"cpu0": [0]}, policy="fifo").start()
    rival = SchedulerClient(daemon.url, "rival", pin=False, heartbeat_interval_s=0.1)
    stop = threading.Event()

    def compete() -> None:  # another job that keeps asking for the device
        while not stop.is_set():
            with rival.lease("cpu0", "train"):
                time.sleep(0.01)
            time.sleep(0.005)

    thread = threading.Thread(target=compete)
    thread.start()
    try:
        shared = Job(
            tiny_job(
                **sections,
                output_dir=str(tmp_path / "shared"),
                scheduler={"url": daemon.url, "heartbeat_timeout_s": 10},
            )
        ).run()
        snap = get_json(daemon.url, "/api/status")
        events = daemon.store.events(limit=100_000)  # the whole event log
    finally:
        stop.set()
        thread.join()
        rival.close()
        daemon.stop()
    assert losses(shared) == losses(alone)  # offloads and restores changed nothing
    record = [r for r in read_metrics(shared.run_dir) if "train/loss" in r][-1]
    assert record["scheduler/num_offloads"] >= 1 and record["scheduler/restore_s"] > 0
    phases = {e.get("phase") for e in events if e["kind"] == "grant" and e["job"] == "tiny"}
    assert phases == {"generate", "train", "weight_sync", "checkpoint"}
    job = next(j for j in snap["jobs"] if j["name"] == "tiny")
    assert job["state"] == "done" and job["grants"] >= 3 * 3 and job["device_s"] > 0
    rival_job = next(j for j in snap["jobs"] if j["name"] == "rival")
    assert rival_job["swap_s"] > 0  # the job's offloads were charged to the rival that caused them


def test_without_a_scheduler_url_nothing_of_it_is_imported():
    code = (
        "import sys; import loomrl.job, loomrl.session, loomrl.control, loomrl.config\n"
        "cfg = loomrl.config.SchedulerConfig(); assert cfg.url is None\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('loomrl.scheduler'))\n"
        "assert loaded == ['loomrl.scheduler', 'loomrl.scheduler.config'], loaded\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={"PYTHONPATH": str(ROOT / "src")},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
