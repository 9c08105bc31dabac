"""The dashboard of a live daemon rendered by headless Chromium (Debian's ``chromium``):
the DOM after its scripts ran names the jobs, the lease held and the job waiting, and the
screenshot shows the holder's colour on the timeline and device card."""

from __future__ import annotations

import re
import shutil
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from loomrl.scheduler.client import SchedulerClient, get_json
from loomrl.scheduler.server import SchedulerDaemon

CHROMIUM = next(
    (p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None
)
pytestmark = pytest.mark.skipif(
    CHROMIUM is None,
    reason="headless Chromium is not installed (Debian: apt-get install chromium; .ci/run does it)",
)
FIRST_JOB_RGB = (0x4E, 0x79, 0xA7)  # the dashboard's colour for the first job it draws


def chromium(*args: str, timeout_s: float = 90.0) -> str:
    cmd = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--hide-scrollbars",
        "--no-first-run",
        "--virtual-time-budget=5000",
        *args,
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def render(url: str, screenshot: Path) -> str:
    chromium(f"--screenshot={screenshot}", "--window-size=1200,1000", url)
    return chromium("--dump-dom", url)


@pytest.fixture
def live_daemon():
    daemon = SchedulerDaemon({"cpu0": [0], "cpu1": [0]}, policy="fair").start()
    holder = SchedulerClient(daemon.url, "trainer-alpha", pin=False)
    waiter = SchedulerClient(daemon.url, "sampler-beta", pin=False)
    lease = holder.acquire("cpu0", "train")
    thread = threading.Thread(
        target=lambda: waiter.release(waiter.acquire("cpu0", "generate", timeout_s=300))
    )
    thread.start()
    while not get_json(daemon.url, "/api/status")["queue"]:
        time.sleep(0.05)
    try:
        yield daemon, lease
    finally:
        holder.release(lease)
        thread.join(timeout=30)
        holder.close()
        waiter.close()
        daemon.stop()


def test_dashboard_shows_the_jobs_and_leases_of_a_live_daemon(live_daemon, tmp_path):
    daemon, lease = live_daemon
    shot = tmp_path / "dashboard.png"
    dom = render(daemon.url + "/", shot)
    jobs = dom[dom.index('<table id="jobs"') :]
    assert 'data-job="trainer-alpha"' in jobs and 'data-job="sampler-beta"' in jobs
    assert f'data-lease="{lease.id}"' in dom
    queue = dom[dom.index('<table id="queue"') : dom.index('<table id="jobs"')]
    assert (
        'data-job="sampler-beta"' in queue
        and "cpu0 held by job 'trainer-alpha' (phase 'train')" in queue
    )
    assert re.search(r"held by <b>trainer-alpha</b> \(train\)", dom)
    assert 'class="span" data-job="trainer-alpha"' in dom  # its lease on the timeline

    from PIL import Image

    image = Image.open(shot).convert("RGB")
    assert image.size == (1200, 1000)
    pixels = np.asarray(image).reshape(-1, 3).astype(int)
    holder_px = int((np.abs(pixels - np.array(FIRST_JOB_RGB)).max(axis=1) <= 6).sum())
    assert holder_px > 200, (
        f"the holder's colour is missing from the screenshot ({holder_px} pixels)"
    )
