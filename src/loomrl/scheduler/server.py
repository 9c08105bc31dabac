"""The scheduler daemon: the core behind an HTTP API on loopback, with SQLite state,
Prometheus ``/metrics`` and a dashboard page.

API (JSON bodies; errors come back as ``{"error": message, "type": name}``):

    POST /v1/register   {name, priority?, weight?, heartbeat_timeout_s?} -> {job_id}
    POST /v1/heartbeat  {job_id} -> {evict: [device], yield: [lease]}
    POST /v1/acquire    {job_id, devices, phase, expected_s?, timeout_s?, poll_s?}
                        -> {lease_id, devices, cores, waited_s} | {pending: request_id}
    POST /v1/wait       {job_id, request_id, poll_s?} -> as acquire
    POST /v1/release    {job_id, lease_id, restore_s?, expected_idle_s?} -> {evict: bool}
    POST /v1/evicted    {job_id, devices, offload_s?}
    POST /v1/boundary   {job_id, lease_id} -> {yield: bool, waiting: int}
    POST /v1/cancel     {job_id, request_id}
    POST /v1/unregister {job_id}
    GET  /api/status    the snapshot (``status.snapshot``)
    GET  /metrics       Prometheus text format
    GET  /              the dashboard

An acquire blocks (long poll) until granted, past its deadline (HTTP 408 with the reason
it waited) or ``poll_s``; with no deadline the client polls again with ``/v1/wait``.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from loomrl.scheduler.core import Scheduler
from loomrl.scheduler.model import AcquireTimeout, LeaseLost, SchedulerError, UnknownJob
from loomrl.scheduler.status import snapshot

logger = logging.getLogger(__name__)

ERROR_STATUS = {AcquireTimeout: 408, UnknownJob: 404, LeaseLost: 410}
DEFAULT_POLL_S = 20.0


def parse_devices(specs: list[str]) -> dict[str, list[int] | None]:
    """``["cpu0=0", "cpu1=1-3", "cuda:0"]`` -> ``{"cpu0": [0], "cpu1": [1, 2, 3], "cuda:0": None}``."""
    devices: dict[str, list[int] | None] = {}
    for spec in specs:
        name, _, cores = spec.partition("=")
        if not name:
            raise ValueError(f"bad device spec {spec!r}: expected NAME or NAME=CORES (cpu0=0-1)")
        if not cores:
            devices[name] = None
            continue
        ids: list[int] = []
        for part in cores.split(","):
            lo, _, hi = part.partition("-")
            try:
                ids.extend(range(int(lo), int(hi or lo) + 1))
            except ValueError:
                raise ValueError(f"bad core list {cores!r} in device spec {spec!r}: expected e.g. 0-1,3") from None
        devices[name] = ids
    return devices


class SchedulerDaemon:
    def __init__(self, devices: dict[str, list[int] | None], *, policy: str = "fair", db_path: str = ":memory:",
                 host: str = "127.0.0.1", port: int = 0, tick_s: float = 0.05, max_hold_s: float | None = None,
                 switch_cost_multiple: float = 0.0, quantum_s: float = 1.0) -> None:  # fmt: skip
        from loomrl.scheduler.store import SqliteStore

        self.store = SqliteStore(db_path)
        self.lock = threading.Condition()
        self.core = Scheduler(devices, policy, max_hold_s=max_hold_s, switch_cost_multiple=switch_cost_multiple,
                              quantum_s=quantum_s, store=self.store, now=time.time())  # fmt: skip
        self.tick_s = tick_s
        self.httpd = ThreadingHTTPServer((host, port), _handler(self))
        self.httpd.daemon_threads = True
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> SchedulerDaemon:
        for target in (self.httpd.serve_forever, self._tick_loop):
            thread = threading.Thread(target=target, daemon=True, name=f"scheduler-{target.__name__}")
            thread.start()
            self._threads.append(thread)
        logger.info("scheduler listening on %s (policy %s, devices %s)", self.url, self.core.policy.name,
                    sorted(self.core.devices))  # fmt: skip
        return self

    def serve_forever(self) -> None:
        self.start()
        try:
            while not self._stop.wait(1.0):
                pass
        except KeyboardInterrupt:
            pass
        finally:
            self.stop()

    def stop(self) -> None:
        self._stop.set()
        self.httpd.shutdown()
        self.httpd.server_close()
        for thread in self._threads:
            thread.join(timeout=5)
        with self.lock:
            self.store.close()

    def _tick_loop(self) -> None:
        while not self._stop.wait(self.tick_s):
            with self.lock:
                self.core.tick(time.time())
                self.lock.notify_all()

    # -- the API, under the lock ---------------------------------------------------------

    def call(self, route: str, body: dict[str, Any]) -> dict[str, Any]:
        if route in ("/v1/acquire", "/v1/wait"):
            return self._acquire(route, body)
        with self.lock:
            now = time.time()
            core = self.core
            out: dict[str, Any]
            if route == "/v1/register":
                job = core.register(str(body["name"]), now, priority=int(body.get("priority", 0)),
                                    weight=float(body.get("weight", 1.0)),
                                    heartbeat_timeout_s=float(body.get("heartbeat_timeout_s", 10.0)))  # fmt: skip
                out = {"job_id": job.id, "heartbeat_timeout_s": job.heartbeat_timeout_s}
            elif route == "/v1/heartbeat":
                out = core.heartbeat(body["job_id"], now)
            elif route == "/v1/release":
                out = core.release(body["lease_id"], body["job_id"], now, restore_s=float(body.get("restore_s", 0.0)),
                                   expected_idle_s=body.get("expected_idle_s"))  # fmt: skip
            elif route == "/v1/evicted":
                core.evicted(body["job_id"], list(body["devices"]), now, offload_s=float(body.get("offload_s", 0.0)))
                out = {}
            elif route == "/v1/boundary":
                lease = core.lease(body["lease_id"], body["job_id"])
                waiting = sum(1 for r in core.requests.values()
                              if r.job_id != lease.job_id and set(r.devices) & set(lease.devices))  # fmt: skip
                out = {"yield": lease.yield_requested, "waiting": waiting}
            elif route == "/v1/cancel":
                core.job(body["job_id"])
                core.cancel(body["request_id"], now)
                out = {}
            elif route == "/v1/unregister":
                core.unregister(body["job_id"], now)
                out = {}
            elif route == "/api/status":
                out = snapshot(core, now)
            else:
                raise KeyError(route)
            self.lock.notify_all()
            return out

    def _acquire(self, route: str, body: dict[str, Any]) -> dict[str, Any]:
        poll_s = float(body.get("poll_s", DEFAULT_POLL_S))
        with self.lock:
            now = time.time()
            if route == "/v1/acquire":
                request = self.core.request(body["job_id"], list(body["devices"]), str(body.get("phase", "")), now,
                                            expected_s=body.get("expected_s"), timeout_s=body.get("timeout_s"))  # fmt: skip
                self.lock.notify_all()
            else:
                self.core.job(body["job_id"])
                request = self.core.lookup(body["request_id"])
                if request is None or request.job_id != body["job_id"]:
                    raise SchedulerError(f"unknown request {body['request_id']!r} for job {body['job_id']!r}")
            poll_end = now + poll_s
            while request.state == "waiting":
                now = time.time()
                limit = poll_end if request.deadline_at is None else min(poll_end, request.deadline_at + self.tick_s)
                if now >= limit:
                    break
                self.lock.wait(timeout=min(limit - now, 0.5))
            if request.state == "waiting":
                return {"pending": request.id}
            if request.state == "granted":
                lease = self.core.leases.get(request.lease_id or "")
                if lease is None:
                    raise LeaseLost(f"lease {request.lease_id} was granted and then lost before it was collected")
                cores = sorted({c for d in lease.devices for c in (self.core.devices[d].cores or [])})
                return {"lease_id": lease.id, "devices": lease.devices, "cores": cores or None,
                        "waited_s": lease.granted_at - request.requested_at}  # fmt: skip
            if request.state == "timed_out":
                raise AcquireTimeout(request.error or "acquire timed out")
            raise SchedulerError(request.error or f"request {request.id} was {request.state}")

    def metrics_text(self) -> bytes:
        from loomrl.scheduler.metrics import render

        with self.lock:
            snap = snapshot(self.core, time.time())
        return render(snap)


def _handler(daemon: SchedulerDaemon) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt: str, *args: Any) -> None:
            logger.debug("%s " + fmt, self.address_string(), *args)

        def _send(self, status: int, payload: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(payload)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(payload)

        def _json(self, status: int, obj: Any) -> None:
            self._send(status, json.dumps(obj).encode(), "application/json")

        def do_GET(self) -> None:  # noqa: N802 - the http.server API
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                from prometheus_client.exposition import CONTENT_TYPE_LATEST

                self._send(200, daemon.metrics_text(), CONTENT_TYPE_LATEST)
            elif path in ("/", "/dashboard"):
                from loomrl.scheduler.dashboard import DASHBOARD_HTML

                self._send(200, DASHBOARD_HTML.encode(), "text/html; charset=utf-8")
            elif path == "/healthz":
                self._json(200, {"ok": True})
            elif path == "/api/status":
                self._json(200, daemon.call("/api/status", {}))
            else:
                self._json(404, {"error": f"no such page {path!r}", "type": "NotFound"})

        def do_POST(self) -> None:  # noqa: N802
            length = int(self.headers.get("Content-Length") or 0)
            try:
                body = json.loads(self.rfile.read(length) or b"{}")
                self._json(200, daemon.call(self.path, body))
            except KeyError as err:
                status = 404 if err.args and err.args[0] == self.path else 400
                self._json(status, {"error": f"{self.path}: missing or unknown {err}", "type": "BadRequest"})
            except (ValueError, TypeError) as err:
                self._json(400, {"error": f"{self.path}: {err}", "type": "BadRequest"})
            except SchedulerError as err:
                self._json(ERROR_STATUS.get(type(err), HTTPStatus.CONFLICT), {"error": str(err), "type": type(err).__name__})

    return Handler
