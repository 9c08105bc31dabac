"""The dashboard screenshot in docs/timeslice.md: three clients sharing one core (sleeps
stand in for their device phases and tool calls), over-subscribing it (so some wait), rendered by
headless Chromium after 20 s.

    python bench/timeslice_screenshot.py --out docs/img/timeslice-dashboard.png
"""

from __future__ import annotations

import argparse
import random
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from loomrl.scheduler.client import SchedulerClient  # noqa: E402
from loomrl.scheduler.server import SchedulerDaemon  # noqa: E402


def job(
    client: SchedulerClient, device_s: float, idle_s: float, stop: threading.Event, seed: int
) -> None:
    rng = random.Random(seed)
    while not stop.is_set():
        for phase, share in (("generate", 0.6), ("train", 0.4)):
            with client.lease("cpu0", phase):
                time.sleep(device_s * share * rng.uniform(0.8, 1.2))
        time.sleep(idle_s * rng.uniform(0.8, 1.2))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, default=ROOT / "docs/img/timeslice-dashboard.png")
    p.add_argument("--seconds", type=float, default=20.0)
    args = p.parse_args()
    daemon = SchedulerDaemon(
        {"cpu0": [0], "cpu1": [1]}, policy="fair", switch_cost_multiple=2.0
    ).start()
    stop = threading.Event()
    clients = [
        SchedulerClient(daemon.url, name, weight=w, pin=False, heartbeat_interval_s=0.2)
        for name, w in (("grpo-math", 1.0), ("ppo-code", 1.0), ("dpo-chat", 2.0))
    ]
    threads = [
        threading.Thread(target=job, args=(c, d, i, stop, n), daemon=True)
        for n, (c, d, i) in enumerate(zip(clients, (1.0, 1.5, 0.8), (0.4, 0.3, 0.5)))
    ]
    for t in threads:
        t.start()
    time.sleep(args.seconds)
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    subprocess.run(
        [
            chromium,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            "--virtual-time-budget=3000",
            f"--screenshot={args.out}",
            "--window-size=1100,1150",
            daemon.url + "/",
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    stop.set()
    for t in threads:
        t.join(timeout=10)
    for c in clients:
        c.close()
    daemon.stop()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
