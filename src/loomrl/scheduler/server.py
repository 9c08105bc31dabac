"""The scheduler daemon: the core behind an HTTP API on loopback, with SQLite state,
Prometheus ``/metrics`` and a dashboard page. The API is a Starlette app (``routes.py``)
served by uvicorn on a thread of the daemon (``httpd.py``: connection caps, deadlines).

API (JSON bodies; errors come back as ``{"error": message, "type": name}``; the bodies
and their bounds are ``api.py``'s models; who may call what is ``auth.py``):

    POST /v1/register   {name, token, priority?, weight?, heartbeat_timeout_s?}
                        -> {job_id, secret, heartbeat_timeout_s}
    POST /v1/heartbeat  {job_id, secret} -> {evict: [device], yield: [lease]}
    POST /v1/acquire    {job_id, secret, devices, phase, expected_s?, timeout_s?, poll_s?}
                        -> {lease_id, devices, cores, waited_s} | {pending: request_id}
    POST /v1/wait       {job_id, secret, request_id, poll_s?} -> as acquire
    POST /v1/release    {job_id, secret, lease_id, restore_s?, expected_idle_s?} -> {evict: bool}
    POST /v1/evicted    {job_id, secret, devices, offload_s?}
    POST /v1/boundary   {job_id, secret, lease_id} -> {yield: bool, waiting: int}
    POST /v1/cancel     {job_id, secret, request_id}
    POST /v1/unregister {job_id, secret}
    GET  /api/status    the snapshot (``status.snapshot``), no job ids or secrets in it
    GET  /metrics       Prometheus text format
    GET  /healthz       200 {ok: true, ...}; 503 with ``why`` when the tick loop is dead
                        or has not completed a pass for ``stall_s``
    GET  /              the dashboard

Status codes: 400 a bad body (the field and bound named), 401 no or a wrong daemon token,
403 a job call without that job's secret, 404 an unknown job or route, 408 an acquire past
its deadline, 410 a lease lost, 413 a body over 64 KiB, 409 another refusal, 500 a
failure inside the daemon (logged), 503 no free connection; a request HTTP cannot parse
gets 400 (431 for a head over 64 KiB), another method 405.

An acquire blocks (long poll) until granted, past its deadline (HTTP 408 with the reason
it waited) or ``poll_s``; with no deadline the client polls again with ``/v1/wait``.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from pathlib import Path
from typing import Any

from loomrl.scheduler import api, auth
from loomrl.scheduler.core import Scheduler
from loomrl.scheduler.httpd import IDLE_TIMEOUT_S, SchedulerHTTPServer
from loomrl.scheduler.model import (
    AcquireTimeout,
    Forbidden,
    LeaseLost,
    Request,
    SchedulerError,
    Unauthorized,
    UnknownJob,
)
from loomrl.scheduler.status import snapshot
from loomrl.scheduler.store import SqliteStore

logger = logging.getLogger(__name__)

TICK_ERROR_LOG_EVERY_S = 10.0  # a failing tick is logged at most this often (and counted always)


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
                raise ValueError(
                    f"bad core list {cores!r} in device spec {spec!r}: expected e.g. 0-1,3"
                ) from None
        devices[name] = ids
    return devices


class SchedulerDaemon:
    def __init__(
        self,
        devices: dict[str, list[int] | None],
        *,
        policy: str = "fair",
        db_path: str = ":memory:",
        host: str = "127.0.0.1",
        port: int = 0,
        tick_s: float = 0.05,
        max_hold_s: float | None = None,
        switch_cost_multiple: float = 0.0,
        quantum_s: float = 1.0,
        token_file: str | Path | None = None,
        max_connections: int | None = None,
        max_connections_per_client: int | None = None,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
        stall_s: float | None = None,
    ) -> None:
        self.store = SqliteStore(db_path)
        self.lock = threading.Condition()
        self.core = Scheduler(
            devices,
            policy,
            max_hold_s=max_hold_s,
            switch_cost_multiple=switch_cost_multiple,
            quantum_s=quantum_s,
            store=self.store,
            now=time.time(),
        )
        self.tick_s = tick_s
        self.stall_s = stall_s if stall_s is not None else max(2.0, 50 * tick_s)
        self.httpd = SchedulerHTTPServer(
            self,
            host,
            port,
            max_connections=max_connections,
            max_per_client=max_connections_per_client,
            idle_timeout_s=idle_timeout_s,
        )
        self.token_file, self.token = self._write_token(token_file)
        self.tick_errors = 0
        self.last_tick_ok = time.time()
        self.last_tick_error: str | None = None
        self._last_error_logged = 0.0
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def _write_token(self, token_file: str | Path | None) -> tuple[Path, str]:
        """The token jobs register with, written to ``token_file`` (default: one per port);
        the listening socket is closed if it cannot be written."""
        path = (
            Path(token_file)
            if token_file
            else auth.default_token_file(self.httpd.server_address[1])
        )
        try:
            return path, auth.write_token_file(path)
        except OSError:
            self.httpd.server_close()
            raise

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> SchedulerDaemon:
        for target in (self.httpd.serve_forever, self._tick_loop):
            thread = threading.Thread(
                target=target, daemon=True, name=f"scheduler-{target.__name__}"
            )
            thread.start()
            self._threads.append(thread)
        logger.info(
            "scheduler listening on %s (policy %s, devices %s; token in %s)",
            self.url,
            self.core.policy.name,
            sorted(self.core.devices),
            self.token_file,
        )
        return self

    def serve_forever(self) -> None:
        """Serve until Ctrl-C or SIGTERM (then stop cleanly: the token file goes too)."""
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, lambda *_: self._stop.set())
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
        with self.lock:  # long polls in flight end now, answered "pending"
            self.lock.notify_all()
        self.httpd.shutdown()
        self.httpd.server_close()
        for thread in self._threads:
            thread.join(timeout=5)
        auth.remove_token_file(self.token_file, self.token)
        with self.lock:
            self.store.close()

    # -- the tick loop and its health ----------------------------------------------------

    def _tick_loop(self) -> None:
        """Deadlines and grants every ``tick_s``. An exception in a pass is logged and
        counted, and the next pass runs: one bad pass never stops reaping and granting."""
        while not self._stop.wait(self.tick_s):
            try:
                with self.lock:
                    self.core.tick(time.time())
                    self.lock.notify_all()
            except Exception as err:  # noqa: BLE001 - counted and reported by _tick_failed
                self._tick_failed(err)
            else:
                self.last_tick_ok = time.time()

    def _tick_failed(self, err: Exception) -> None:
        self.tick_errors += 1
        self.last_tick_error = f"{type(err).__name__}: {err}"
        now = time.time()
        if now - self._last_error_logged >= TICK_ERROR_LOG_EVERY_S:
            self._last_error_logged = now
            logger.error(
                "scheduler: a scheduling pass failed (%d so far); the loop goes on",
                self.tick_errors,
                exc_info=err,
            )

    def health(self) -> dict[str, Any]:
        """Not ok when the tick thread has ended or no pass completed for ``stall_s``
        (each one failing, or one stuck). Reads no lock: it answers while the core is stuck."""
        age = time.time() - self.last_tick_ok
        thread = self._threads[1] if len(self._threads) > 1 else None
        why = None
        if thread is None or not thread.is_alive():
            why = "the tick loop is not running"
        elif age > self.stall_s:
            why = f"no scheduling pass completed for {age:.1f} s (limit {self.stall_s:g} s)"
            if self.last_tick_error:
                why += f"; the last one failed: {self.last_tick_error}"
        return {
            "ok": why is None,
            "why": why,
            "tick_age_s": round(age, 3),
            "tick_errors": self.tick_errors,
        }

    # -- the API, under the lock ---------------------------------------------------------

    def call(self, route: str, body: Any) -> dict[str, Any]:
        """Answer ``POST route`` with ``body`` (decoded JSON): checked (``api.parse``),
        authenticated (the daemon token to register, the job's secret for the rest), done."""
        req = api.parse(route, body)
        if isinstance(req, (api.Acquire, api.Wait)):
            return self._acquire(req)
        with self.lock:
            now = time.time()
            if isinstance(req, api.Register):
                out = self._register(req, now)
            else:
                self._authorize(req)
                out = self._job_call(req, now)
            self.lock.notify_all()
            return out

    def _register(self, req: api.Register, now: float) -> dict[str, Any]:
        if not auth.same(req.token, self.token):
            raise Unauthorized(
                f"registering needs the daemon's token ({'a wrong one was given' if req.token else 'none given'}): "
                f"a job of the daemon's user reads it from {self.token_file}; others get it from "
                f"the daemon's owner and set {auth.TOKEN_ENV}"
            )
        secret, secret_sha256 = auth.new_secret()
        job = self.core.register(
            req.name,
            now,
            priority=req.priority,
            weight=req.weight,
            heartbeat_timeout_s=req.heartbeat_timeout_s,
            secret_sha256=secret_sha256,
        )
        return {"job_id": job.id, "secret": secret, "heartbeat_timeout_s": job.heartbeat_timeout_s}

    def _authorize(self, req: api.JobCall) -> None:
        job = self.core.jobs.get(req.job_id)
        if job is None:
            raise UnknownJob(f"unknown job id {req.job_id!r}: register first")
        if job.secret_sha256 is None or not auth.same(
            auth.digest(req.secret or ""), job.secret_sha256
        ):
            raise Forbidden(
                f"a call for job {job.name!r} needs that job's secret (returned when it registered)"
            )

    def _job_call(self, req: api.JobCall, now: float) -> dict[str, Any]:
        core = self.core
        if isinstance(req, api.Heartbeat):
            return core.heartbeat(req.job_id, now)
        if isinstance(req, api.Release):
            return core.release(
                req.lease_id,
                req.job_id,
                now,
                restore_s=req.restore_s,
                expected_idle_s=req.expected_idle_s,
            )
        if isinstance(req, api.Evicted):
            core.evicted(req.job_id, list(req.devices), now, offload_s=req.offload_s)
        elif isinstance(req, api.Boundary):
            lease = core.lease(req.lease_id, req.job_id)
            waiting = sum(
                1
                for r in core.requests.values()
                if r.job_id != lease.job_id and set(r.devices) & set(lease.devices)
            )
            return {"yield": lease.yield_requested, "waiting": waiting}
        elif isinstance(req, api.Cancel):
            core.job(req.job_id)
            request = core.requests.get(req.request_id)
            if request is not None and request.job_id == req.job_id:
                core.cancel(req.request_id, now)
        elif isinstance(req, api.Unregister):
            core.unregister(req.job_id, now)
        return {}

    def _acquire(self, req: api.Acquire | api.Wait) -> dict[str, Any]:
        """A new request (``Acquire``) or one already made (``Wait``), waited on for up to
        ``poll_s``: the lease if granted by then, else the request's id to wait on again."""
        with self.lock:
            self._authorize(req)
            now = time.time()
            request = self._request_of(req, now)
            self._wait_while_waiting(request, now + req.poll_s)
            if request.state == "waiting":
                return {"pending": request.id}
            if request.state == "granted":
                return self._granted(request)
            if request.state == "timed_out":
                raise AcquireTimeout(request.error or "acquire timed out")
            raise SchedulerError(request.error or f"request {request.id} was {request.state}")

    def _request_of(self, req: api.Acquire | api.Wait, now: float) -> Request:
        """The request ``req`` names: made now (``Acquire``) or looked up (``Wait``)."""
        if isinstance(req, api.Acquire):
            request = self.core.request(
                req.job_id,
                list(req.devices),
                req.phase,
                now,
                expected_s=req.expected_s,
                timeout_s=req.timeout_s,
            )
            self.lock.notify_all()
            return request
        self.core.job(req.job_id)
        request = self.core.lookup(req.request_id)
        if request is None or request.job_id != req.job_id:
            raise SchedulerError(f"unknown request {req.request_id!r} for job {req.job_id!r}")
        return request

    def _wait_while_waiting(self, request: Request, poll_end: float) -> None:
        """Hold the lock's condition until ``request`` leaves "waiting", ``poll_end`` comes
        or its deadline has passed by a tick (the tick loop times it out)."""
        while request.state == "waiting" and not self._stop.is_set():
            now = time.time()
            limit = (
                poll_end
                if request.deadline_at is None
                else min(poll_end, request.deadline_at + self.tick_s)
            )
            if now >= limit:
                break
            self.lock.wait(timeout=min(limit - now, 0.5))

    def _granted(self, request: Request) -> dict[str, Any]:
        """The lease a granted request got: its devices, their cores, how long it waited."""
        lease = self.core.leases.get(request.lease_id or "")
        if lease is None:
            raise LeaseLost(
                f"lease {request.lease_id} was granted and then lost before it was collected"
            )
        cores = sorted({c for d in lease.devices for c in (self.core.devices[d].cores or [])})
        return {
            "lease_id": lease.id,
            "devices": lease.devices,
            "cores": cores or None,
            "waited_s": lease.granted_at - request.requested_at,
        }

    # -- what anyone may read ------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        with self.lock:
            return snapshot(self.core, time.time())

    def metrics_text(self) -> bytes:
        # lazy: prometheus_client loads only when /metrics is asked for
        from loomrl.scheduler.metrics import render

        snap = self.status()
        snap["daemon"] = {
            **self.health(),
            "connections": self.httpd.num_connections(),
            "connections_evicted": self.httpd.counts["evicted"],
            "connections_refused": self.httpd.counts["refused"],
            "connections_timed_out": self.httpd.counts["timed_out"],
        }
        return render(snap)
