"""The scheduler daemon against a hostile local client (issue 41, findings 2, 3 and 5).

- Authentication: registering needs the daemon's token (a 0600 file); every call of a
  job needs that job's secret, so another client can neither release nor unregister it;
  job ids are not a counter; ``/api/status``, ``/metrics`` and the dashboard show no ids.
- Hostile numbers: NaN, subnormal, infinite and negative values are refused with a 400
  naming the field, and no accepted value can stop the tick loop.
- Denial of service: idle connections cannot starve an honest job at a 128-fd limit, a
  16 MB name is refused before it is read, malformed requests always get an answer, an
  exception in the tick loop is counted and survived, and ``/healthz`` reports trouble.
"""

from __future__ import annotations

import json
import math
import os
import resource
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from loomrl.scheduler.client import SchedulerClient, get_json, post
from loomrl.scheduler.core import Scheduler
from loomrl.scheduler.model import SchedulerError
from loomrl.scheduler.server import SchedulerDaemon

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src")}


@pytest.fixture
def daemon():
    d = SchedulerDaemon({"cpu0": [0], "cpu1": [0]}, policy="fair", tick_s=0.02).start()
    yield d
    d.stop()


def token_of(d: SchedulerDaemon) -> str | None:
    return getattr(d, "token", None)


def secret_of(client: SchedulerClient) -> str:
    return getattr(client, "job_secret", "")


def exchange(url: str, data: bytes, timeout_s: float = 3.0) -> tuple[int | None, bytes]:
    """Send raw bytes, read until the daemon closes or ``timeout_s``: (status, body),
    status None when no HTTP answer came."""
    host, port = url.removeprefix("http://").split(":")
    received = b""
    with socket.create_connection((host, int(port)), timeout=timeout_s) as s:
        s.sendall(data)
        end = time.time() + timeout_s
        try:
            while time.time() < end:
                chunk = s.recv(65536)
                if not chunk:
                    break
                received += chunk
                head, sep, body = received.partition(b"\r\n\r\n")
                length = next(
                    (
                        int(h.split(b":")[1])
                        for h in head.split(b"\r\n")
                        if h.lower().startswith(b"content-length:")
                    ),
                    None,
                )
                if sep and length is not None and len(body) >= length:
                    break
        except (TimeoutError, ConnectionResetError):
            pass
    if not received.startswith(b"HTTP/1."):
        return None, b""
    return int(received.split(b" ", 2)[1]), received.partition(b"\r\n\r\n")[2]


def call(url: str, route: str, text: str, timeout_s: float = 3.0) -> tuple[int | None, dict]:
    """POST a JSON text as written (NaN and Infinity literals included)."""
    body = text.encode()
    head = f"POST {route} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    status, payload = exchange(url, head.encode() + b"Connection: close\r\n\r\n" + body, timeout_s)
    try:
        return status, json.loads(payload or b"{}")
    except ValueError:
        return status, {}


def register_raw(d: SchedulerDaemon, fields: str) -> tuple[int | None, dict]:
    token = json.dumps(token_of(d))
    return call(d.url, "/v1/register", f'{{"name": "hostile", "token": {token}, {fields}}}')


# -- authentication (finding 2) --------------------------------------------------------


def test_registering_needs_the_daemon_token_from_a_0600_file(daemon):
    status, out = call(daemon.url, "/v1/register", '{"name": "anyone"}')
    assert status == 401, (status, out)
    assert "token" in out["error"]
    status, out = call(daemon.url, "/v1/register", '{"name": "anyone", "token": "guess"}')
    assert status == 401, (status, out)
    token_file = Path(daemon.token_file)
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    assert token_file.read_text().strip() == daemon.token
    status, out = call(
        daemon.url, "/v1/register", json.dumps({"name": "honest", "token": daemon.token})
    )
    assert status == 200 and len(out["secret"]) >= 32


def test_job_ids_are_not_a_guessable_counter(daemon):
    clients = [SchedulerClient(daemon.url, f"job{i}", pin=False) for i in range(3)]
    ids = [c.job_id for c in clients]
    for c in clients:
        c.close()
    randoms = [i.rsplit("-", 1)[-1] for i in ids]
    assert all(len(r) >= 16 and r not in ids[0].split("-")[0] for r in randoms), ids
    assert len(set(randoms)) == 3


def test_another_client_can_neither_release_nor_unregister_a_job(daemon):
    victim = SchedulerClient(daemon.url, "victim", pin=False)
    lease = victim.acquire("cpu0", "train")
    attacks = [
        ("/v1/release", {"lease_id": lease.id}),
        ("/v1/unregister", {}),
        ("/v1/heartbeat", {}),
        ("/v1/evicted", {"devices": ["cpu0"]}),
        ("/v1/boundary", {"lease_id": lease.id}),
    ]
    for route, body in attacks:
        for secret in ({}, {"secret": "not-its-secret"}):
            status, out = call(
                daemon.url, route, json.dumps({"job_id": victim.job_id, **body, **secret})
            )
            assert status == 403, (route, secret, status, out)
    snap = get_json(daemon.url, "/api/status")
    assert snap["devices"][0]["holder"]["job"] == "victim"  # still holds its lease
    assert {j["name"]: j["state"] for j in snap["jobs"]}["victim"] == "alive"
    assert lease.boundary() is False  # its own calls still work
    victim.release(lease)
    victim.close()


def test_status_metrics_and_dashboard_show_no_job_ids_or_secrets(daemon):
    client = SchedulerClient(daemon.url, "private", pin=False)
    lease = client.acquire("cpu0", "train")
    try:
        for page in ("/api/status", "/metrics", "/"):
            text = urlopen_text(daemon.url + page)
            assert client.job_id not in text, page
            assert not secret_of(client) or secret_of(client) not in text, page
        snap = get_json(daemon.url, "/api/status")
        # names stay: the dashboard shows them
        assert [j["name"] for j in snap["jobs"]] == ["private"]
        assert all("id" not in j for j in snap["jobs"])
    finally:
        client.release(lease)
        client.close()


def urlopen_text(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=5) as resp:
        return resp.read().decode()


# -- hostile numbers (finding 3) -------------------------------------------------------


@pytest.mark.parametrize(
    "fields,named",
    [
        ('"weight": NaN', "weight"),
        ('"weight": 1e-320', "weight"),
        ('"weight": Infinity', "weight"),
        ('"weight": -1', "weight"),
        ('"heartbeat_timeout_s": Infinity', "heartbeat_timeout_s"),
        ('"heartbeat_timeout_s": 1e12', "heartbeat_timeout_s"),
        ('"heartbeat_timeout_s": -5', "heartbeat_timeout_s"),
        ('"priority": 1e400', "priority"),
    ],
)
def test_hostile_numbers_at_registration_are_refused(daemon, fields, named):
    status, out = register_raw(daemon, fields)
    assert status == 400, (status, out)
    assert named in out["error"]


@pytest.mark.parametrize(
    "route,fields,named",
    [
        ("/v1/evicted", '"devices": ["cpu0"], "offload_s": NaN', "offload_s"),
        ("/v1/evicted", '"devices": ["cpu0"], "offload_s": -1', "offload_s"),
        ("/v1/release", '"lease_id": "LEASE", "restore_s": NaN', "restore_s"),
        ("/v1/release", '"lease_id": "LEASE", "expected_idle_s": Infinity', "expected_idle_s"),
        ("/v1/acquire", '"devices": ["cpu1"], "phase": "p", "expected_s": NaN', "expected_s"),
        ("/v1/acquire", '"devices": ["cpu1"], "phase": "p", "timeout_s": -1', "timeout_s"),
        ("/v1/acquire", '"devices": ["cpu1"], "phase": "p", "poll_s": Infinity', "poll_s"),
    ],
)
def test_hostile_numbers_in_a_jobs_calls_are_refused(daemon, route, fields, named):
    client = SchedulerClient(daemon.url, "numbers", pin=False)
    lease = client.acquire("cpu0", "train")
    ident = f'"job_id": {json.dumps(client.job_id)}, "secret": {json.dumps(secret_of(client))}'
    status, out = call(daemon.url, route, f"{{{ident}, {fields.replace('LEASE', lease.id)}}}")
    assert status == 400, (status, out)
    assert named in out["error"]
    assert lease.boundary() is False  # the lease is untouched
    client.release(lease)
    client.close()


def _hostile_job(d: SchedulerDaemon, weight: str) -> None:
    """Register a job with ``weight``; if the daemon takes it, give it one lease and queue
    it behind the honest jobs, so the fair policy has to weigh it."""
    status, out = register_raw(d, f'"weight": {weight}, "heartbeat_timeout_s": 30')
    if status != 200:
        return
    ident = {"job_id": out["job_id"], "secret": out.get("secret", "")}
    got = post(d.url, "/v1/acquire", {**ident, "devices": ["cpu0"], "phase": "p", "poll_s": 2})
    time.sleep(0.05)
    post(d.url, "/v1/release", {**ident, "lease_id": got["lease_id"]})
    post(d.url, "/v1/evicted", {**ident, "devices": ["cpu0"]})
    post(d.url, "/v1/acquire", {**ident, "devices": ["cpu0"], "phase": "p", "poll_s": 0.05})


@pytest.mark.parametrize("weight", ["NaN", "1e-320"])
def test_a_hostile_weight_cannot_wedge_the_scheduler(daemon, weight):
    a = SchedulerClient(daemon.url, "a", pin=False)
    b = SchedulerClient(daemon.url, "b", pin=False)
    _hostile_job(daemon, weight)
    lease = a.acquire("cpu0", "train", timeout_s=5)
    got: list = []
    waiter = threading.Thread(target=lambda: got.append(b.acquire("cpu0", "gen", timeout_s=5)))
    waiter.start()
    time.sleep(0.2)
    a.release(lease)
    waiter.join(timeout=10)
    assert got, "the honest waiter never got the device"
    b.release(got[0])
    assert urlopen_status(daemon.url + "/healthz") == 200
    status, out = register_raw(daemon, f'"weight": {weight}')
    assert status == 400 and "weight" in out["error"], (status, out)
    a.close()
    b.close()


def test_numbers_at_their_bounds_keep_the_fair_policy_going():
    """The extremes the API lets through (weights 0.001 and 1000, a week-long restore)
    leave every account finite and every pass working."""
    s = Scheduler({"d0": None}, "fair")
    light, heavy = s.register("light", 0.0, weight=1e-3).id, s.register("heavy", 0.0, weight=1e3).id
    now = 0.0
    for i in range(20):
        job = (light, heavy)[i % 2]
        s.heartbeat(light, now)
        s.heartbeat(heavy, now)
        s.request(light, ["d0"], "p", now)
        s.request(heavy, ["d0"], "p", now)
        s.tick(now)
        holder = s.leases[s.devices["d0"].holder]
        now += 1.0
        s.release(holder.id, holder.job_id, now, restore_s=7 * 86400.0 if job == light else 0.0)
        s.evicted(holder.job_id, ["d0"], now, offload_s=7 * 86400.0)
        s.tick(now)
        for r in list(s.requests.values()):
            s.cancel(r.id, now)
    assert all(math.isfinite(j.deficit_s) for j in s.jobs.values())
    assert {j.num_grants > 0 for j in s.jobs.values()} == {True}


def test_the_core_refuses_non_finite_numbers_too():
    s = Scheduler({"d0": None}, "fair")
    for kwargs in (
        {"weight": float("nan")},
        {"weight": 1e-320},
        {"heartbeat_timeout_s": float("inf")},
    ):
        with pytest.raises(SchedulerError, match=next(iter(kwargs))):
            s.register("x", 0.0, **kwargs)
    j = s.register("ok", 0.0).id
    s.request(j, ["d0"], "p", 0.0)
    with pytest.raises(SchedulerError, match="restore_s"):
        s.release(s.devices["d0"].holder, j, 1.0, restore_s=float("nan"))
    with pytest.raises(SchedulerError, match="offload_s"):
        s.evicted(j, ["d0"], 1.0, offload_s=float("nan"))


def urlopen_status(url: str) -> int:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status
    except urllib.error.HTTPError as err:
        return err.code


# -- denial of service (finding 5) -----------------------------------------------------


def _limit_fds() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128))


def test_idle_connections_do_not_starve_an_honest_job(tmp_path, monkeypatch):
    # killed: it stays here
    monkeypatch.setenv("LOOMRL_SCHEDULER_TOKEN_FILE", str(tmp_path / "daemon.token"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    cmd = [
        sys.executable,
        "-m",
        "loomrl.cli",
        "scheduler",
        "serve",
        "--port",
        str(port),
        "--db",
        str(tmp_path / "s.db"),
        "--device",
        "cpu0=0",
    ]
    env = {**ENV, "LOOMRL_SCHEDULER_TOKEN_FILE": str(tmp_path / "daemon.token")}
    daemon = subprocess.Popen(
        cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=_limit_fds
    )
    idle: list[socket.socket] = []
    try:
        end = time.time() + 30
        while urlopen_status_quiet(url + "/healthz") != 200:
            assert time.time() < end and daemon.poll() is None, "the daemon did not come up"
            time.sleep(0.1)
        for _ in range(200):  # more than the daemon has file descriptors
            try:
                idle.append(socket.create_connection(("127.0.0.1", port), timeout=0.2))
            except OSError:
                pass
        time.sleep(0.3)
        token = read_token(url)
        t0 = time.time()
        job = post(
            url,
            "/v1/register",
            {"name": "honest", "token": token, "heartbeat_timeout_s": 2},
            timeout_s=5,
        )
        ident = {"job_id": job["job_id"], "secret": job.get("secret", "")}
        lease = post(
            url,
            "/v1/acquire",
            {**ident, "devices": ["cpu0"], "phase": "p", "poll_s": 2},
            timeout_s=5,
        )
        for _ in range(6):  # three heartbeat timeouts' worth of beats, each answered in time
            beat = time.time()
            post(url, "/v1/heartbeat", ident, timeout_s=1.5)
            assert time.time() - beat < 1.5
            time.sleep(0.25)
        post(url, "/v1/release", {**ident, "lease_id": lease["lease_id"]}, timeout_s=5)
        assert time.time() - t0 < 10
        states = {j["name"]: j["state"] for j in get_json(url, "/api/status")["jobs"]}
        assert states["honest"] == "alive"
    finally:
        for s in idle:
            s.close()
        daemon.kill()
        daemon.wait()


def read_token(url: str) -> str | None:
    try:
        from loomrl.scheduler.auth import read_token as read
    except ImportError:  # a daemon without authentication
        return None
    return read(url)


def urlopen_status_quiet(url: str) -> int | None:
    try:
        return urlopen_status(url)
    except OSError:
        return None


def test_a_16_mb_name_is_refused_before_it_is_read(daemon):
    size = 16 * 2**20
    head = (
        f"POST /v1/register HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {size}\r\n\r\n"
    ).encode()
    t0 = time.time()
    status, body = exchange(daemon.url, head + b'{"name": "' + b"x" * 65536, timeout_s=3.0)
    assert status == 413, status
    assert time.time() - t0 < 2.0
    assert b"bytes" in body
    # a long name inside a small body: refused by the name bound
    status, out = register_raw(daemon, '"priority": 0, "name": "' + "y" * 4096 + '"')
    assert status == 400 and "name" in out["error"], (status, out)
    t1 = time.time()
    assert urlopen_status(daemon.url + "/healthz") == 200 and time.time() - t1 < 1.0


def _post(route: str, body: bytes) -> bytes:
    return f"POST {route} HTTP/1.1\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body


MALFORMED = {
    "content-length not a number": b"POST /v1/register HTTP/1.1\r\nContent-Length: abc\r\n\r\n{}",
    "negative content-length": b"POST /v1/register HTTP/1.1\r\nContent-Length: -1\r\n\r\n{}",
    "body not an object": _post("/v1/register", b"[1, 2]"),
    "name not a string": _post("/v1/register", b'{"name": {"a": [1]}}'),
    "nested too deep": _post("/v1/register", b"[" * 60000),
    "priority overflows": _post("/v1/register", b'{"name": "a", "priority": 1e400}'),
    "not utf-8": _post("/v1/register", b"\xff\xfe"),
    "job id not a string": _post("/v1/heartbeat", b'{"job_id": ["x"]}'),
    "chunked body": b"POST /v1/register HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
    "garbage request line": b"HELLO THERE\r\n\r\n",
    "unknown method": b"PUT /v1/register HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}",
    "header line too long": b"GET /healthz HTTP/1.1\r\nX: " + b"a" * 70000 + b"\r\n\r\n",
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_requests_are_answered(daemon, case):
    status, body = exchange(daemon.url, MALFORMED[case], timeout_s=3.0)
    assert status is not None and 400 <= status < 600 and status != 500, (case, status, body[:200])
    assert json.loads(body)["error"]
    assert urlopen_status(daemon.url + "/healthz") == 200


def test_an_exception_in_the_tick_loop_is_counted_and_survived(daemon):
    failing = threading.Event()
    failing.set()
    real_tick = daemon.core.tick

    def tick(now: float) -> None:
        if failing.is_set():
            raise RuntimeError("injected fault in the policy")
        real_tick(now)

    daemon.core.tick = tick
    assert wait_for(lambda: urlopen_status(daemon.url + "/healthz") == 503, 5.0), (
        "/healthz did not report trouble"
    )
    health = json.loads(urlopen_error_body(daemon.url + "/healthz"))
    assert health["ok"] is False and "injected fault" in health["why"]
    metrics = urlopen_text(daemon.url + "/metrics")
    errors = next(
        x for x in metrics.splitlines() if x.startswith("loomrl_scheduler_tick_errors_total")
    )
    assert float(errors.split()[-1]) >= 1
    failing.clear()
    assert wait_for(lambda: urlopen_status(daemon.url + "/healthz") == 200, 5.0)
    # the loop still reaps: a silent job loses its lease at its heartbeat deadline
    out = post(
        daemon.url,
        "/v1/register",
        {"name": "silent", "token": token_of(daemon), "heartbeat_timeout_s": 0.3},
    )
    ident = {"job_id": out["job_id"], "secret": out.get("secret", "")}
    post(daemon.url, "/v1/acquire", {**ident, "devices": ["cpu0"], "phase": "p", "poll_s": 2})
    assert wait_for(
        lambda: get_json(daemon.url, "/api/status")["devices"][0]["holder"] is None, 5.0
    )


def test_healthz_reports_a_stalled_tick_loop(daemon):
    daemon.stall_s = 0.5
    with daemon.lock:  # the tick loop cannot run meanwhile
        time.sleep(1.0)
        assert urlopen_status(daemon.url + "/healthz") == 503
    assert wait_for(lambda: urlopen_status(daemon.url + "/healthz") == 200, 5.0)


def urlopen_error_body(url: str) -> str:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.read().decode()


def wait_for(predicate, timeout_s: float) -> bool:
    end = time.time() + timeout_s
    while time.time() < end:
        if predicate():
            return True
        time.sleep(0.05)
    return False
