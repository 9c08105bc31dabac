"""The daemon over HTTP with real job processes: mutual exclusion under concurrent
acquires, a killed job's lease reclaimed at its heartbeat deadline, acquire deadlines, a
restarted daemon keeping its queue, Prometheus metrics and the status command."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loomrl.scheduler.auth import read_token
from loomrl.scheduler.client import SchedulerClient, get_json, post
from loomrl.scheduler.model import AcquireTimeout, Unauthorized
from loomrl.scheduler.server import SchedulerDaemon

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("scheduler_worker.py")
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src")}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_up(url: str, timeout_s: float = 20.0) -> None:
    end = time.time() + timeout_s
    while time.time() < end:
        try:
            urllib.request.urlopen(url + "/healthz", timeout=1).read()
            return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"scheduler at {url} did not come up")


def serve(port: int, db: Path, *extra: str) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "loomrl.cli",
        "scheduler",
        "serve",
        "--port",
        str(port),
        "--db",
        str(db),
        "--device",
        "cpu0=0",
        "--device",
        "cpu1=0",
        *extra,
    ]
    return subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def daemon():
    d = SchedulerDaemon({"cpu0": [0], "cpu1": [0]}, policy="fair", tick_s=0.02).start()
    yield d
    d.stop()


plans = st.lists(
    st.lists(
        st.tuples(
            st.sampled_from([["cpu0"], ["cpu1"], ["cpu0", "cpu1"]]),
            st.floats(min_value=0.0, max_value=0.03),
        ),
        min_size=1,
        max_size=4,
    ),
    min_size=2,
    max_size=4,
)


@settings(
    max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(plans=plans)
def test_leases_are_mutually_exclusive_across_processes(daemon, tmp_path_factory, plans):
    out = tmp_path_factory.mktemp("excl")
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), daemon.url, f"w{i}", json.dumps(plan), str(out)],
            env=ENV,
            stderr=subprocess.PIPE,
        )
        for i, plan in enumerate(plans)
    ]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err.decode()[-2000:]
    spans: dict[str, list[tuple[float, float]]] = {}
    for i, plan in enumerate(plans):
        records = [json.loads(line) for line in (out / f"w{i}.jsonl").read_text().splitlines()]
        assert len(records) == len(plan)
        for r in records:
            for d in r["devices"]:
                spans.setdefault(d, []).append((r["start"], r["end"]))
    for device, intervals in spans.items():
        intervals.sort()
        for (_, end), (start, _) in zip(intervals, intervals[1:]):
            assert start >= end, f"two leases of {device} overlapped"


def test_killed_job_loses_its_lease_at_the_heartbeat_deadline(daemon, tmp_path):
    holder = subprocess.Popen(
        [sys.executable, str(WORKER), daemon.url, "doomed", "hold-forever", str(tmp_path)],
        env=ENV,
        stdout=subprocess.PIPE,
    )
    try:
        assert holder.stdout.readline().strip() == b"holding"
        waiter = SchedulerClient(daemon.url, "waiter", heartbeat_timeout_s=5.0, pin=False)
        holder.kill()
        holder.wait()
        killed_at = time.time()
        lease = waiter.acquire("cpu0", "train", timeout_s=10.0)
        reclaimed_s = time.time() - killed_at
        # heartbeat timeout 1 s, last beat <= 0.2 s before the kill
        assert 0.5 <= reclaimed_s <= 3.0, reclaimed_s
        snap = get_json(daemon.url, "/api/status")
        assert {j["name"]: j["state"] for j in snap["jobs"]}["doomed"] == "dead"
        assert any(e["kind"] == "lease_lost" and e["job"] == "doomed" for e in snap["events"])
        waiter.release(lease)
        waiter.close()
    finally:
        stop(holder, signal.SIGKILL)


def test_acquire_past_its_deadline_fails_with_a_clear_error(daemon):
    a = SchedulerClient(daemon.url, "a", pin=False)
    b = SchedulerClient(daemon.url, "b", pin=False)
    lease = a.acquire("cpu0", "train")
    t0 = time.time()
    with pytest.raises(AcquireTimeout) as err:
        b.acquire("cpu0", "generate", timeout_s=0.5)
    assert 0.5 <= time.time() - t0 < 3.0
    msg = str(err.value)
    assert (
        "job 'b'" in msg
        and "timed out after 0.5" in msg
        and "cpu0 held by job 'a' (phase 'train')" in msg
    )
    a.release(lease)
    # the device is free again and b can have it at once
    b.release(b.acquire("cpu0", "generate", timeout_s=2.0))
    a.close()
    b.close()


def test_restarted_daemon_keeps_its_queue(tmp_path):
    port, db = free_port(), tmp_path / "sched.db"
    url = f"http://127.0.0.1:{port}"
    proc = serve(port, db)
    try:
        wait_up(url)
        token = read_token(url)  # the daemon's token file, 0600, of this user
        jobs = {
            n: post(url, "/v1/register", {"name": n, "heartbeat_timeout_s": 30, "token": token})
            for n in "abc"
        }
        ids = {n: {"job_id": out["job_id"], "secret": out["secret"]} for n, out in jobs.items()}
        held = post(
            url, "/v1/acquire", {**ids["a"], "devices": ["cpu0"], "phase": "train", "poll_s": 0.1}
        )
        pending = {
            n: post(
                url, "/v1/acquire", {**ids[n], "devices": ["cpu0"], "phase": "gen", "poll_s": 0.1}
            )["pending"]
            for n in "bc"
        }
        stop(proc, signal.SIGKILL)  # a crash, not a clean shutdown
        proc = serve(port, db)
        wait_up(url)
        snap = get_json(url, "/api/status")
        assert [q["job"] for q in snap["queue"]] == ["b", "c"]
        assert snap["devices"][0]["holder"]["job"] == "a"
        # the jobs' secrets outlive the restart (their digests are in the state); the new
        # daemon has a new token, and the old one no longer registers anyone
        with pytest.raises(Unauthorized):
            post(url, "/v1/register", {"name": "late", "token": token})
        post(url, "/v1/release", {**ids["a"], "lease_id": held["lease_id"]})
        post(url, "/v1/evicted", {**ids["a"], "devices": ["cpu0"]})
        got = post(url, "/v1/wait", {**ids["b"], "request_id": pending["b"], "poll_s": 5})
        assert got["devices"] == ["cpu0"] and "lease_id" in got
        status = subprocess.run(
            [sys.executable, "-m", "loomrl.cli", "scheduler", "status", "--url", url],
            env={**ENV, "COLUMNS": "200"},
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert status.returncode == 0, status.stderr
        assert "cpu0" in status.stdout and "gen" in status.stdout
        assert "held by job 'b'" in status.stdout  # c waits behind b, and the status says why
    finally:
        stop(proc)


def test_metrics_count_device_seconds_per_job(daemon):
    a = SchedulerClient(daemon.url, "metered", pin=False)
    with a.lease("cpu1", "train"):
        time.sleep(0.2)
    text = urllib.request.urlopen(daemon.url + "/metrics").read().decode()
    line = next(
        x
        for x in text.splitlines()
        if x.startswith('loomrl_scheduler_job_device_seconds_total{job="metered"}')
    )
    assert 0.2 <= float(line.split()[-1]) < 2.0
    assert 'loomrl_scheduler_device_busy_seconds_total{device="cpu1"}' in text
    a.close()
