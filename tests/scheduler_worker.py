"""A job process for the scheduler tests: runs a plan of leases against a daemon.

    python scheduler_worker.py URL NAME PLAN_JSON OUT_DIR

PLAN_JSON is a list of [devices, hold_s]. In each lease the worker claims a marker file
per device with O_EXCL (a second holder of the same device would fail to), records
(device, start, end) to OUT_DIR/NAME.jsonl, and removes the markers before it releases.
A plan of "hold-forever" acquires cpu0 and then sleeps (to be killed).
"""

import json
import os
import sys
import time

from loomrl.scheduler.client import SchedulerClient

url, name, plan_json, out_dir = sys.argv[1:5]
client = SchedulerClient(url, name, heartbeat_timeout_s=1.0, heartbeat_interval_s=0.2, pin=False)
if plan_json == "hold-forever":
    client.acquire("cpu0", "train")
    print("holding", flush=True)
    time.sleep(3600)
records = []
for devices, hold_s in json.loads(plan_json):
    with client.lease(devices, "phase", timeout_s=60.0):
        start = time.time()
        markers = [os.path.join(out_dir, f"{d}.held") for d in devices]
        for m in markers:
            fd = os.open(m, os.O_CREAT | os.O_EXCL | os.O_WRONLY)  # raises if another holds it
            os.close(fd)
        time.sleep(hold_s)
        for m in markers:
            os.unlink(m)
        records.append({"devices": devices, "start": start, "end": time.time()})
with open(os.path.join(out_dir, f"{name}.jsonl"), "w") as f:
    f.write("".join(json.dumps(r) + "\n" for r in records))
client.close()
