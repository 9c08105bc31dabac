"""The job side of time-slicing: register, heartbeat, and run each device phase in a lease.

    client = SchedulerClient("http://127.0.0.1:7878", "job-a")
    client.attach(Swappable(model, optimizer))     # what leaves the device on eviction
    with client.lease("cpu0", "train", expected_s=0.5):
        train_step()                               # pinned to cpu0's cores meanwhile
    client.close()

Registering needs the daemon's token: the client reads it from ``LOOMRL_SCHEDULER_TOKEN``
or the daemon's token file for the URL's port (``auth.read_token``), or takes ``token=``.
The job's secret that registration returns goes with every later call, unseen by callers.

Eviction is lazy: after a phase the job's state stays on the device unless another job is
waiting; then the client offloads before the device changes hands, and restores at the
start of its next lease. A background thread heartbeats and offloads when the scheduler
asks for a device this job is resident on. One job's phases run one at a time (a lock).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

from loomrl.scheduler.auth import read_token
from loomrl.scheduler.model import (
    MAX_BODY_BYTES,
    AcquireTimeout,
    BadRequest,
    Forbidden,
    LeaseLost,
    LockOrderError,
    SchedulerError,
    Unauthorized,
    UnknownJob,
)
from loomrl.telemetry import trace

logger = logging.getLogger(__name__)

ERRORS: dict[str, type[SchedulerError]] = {
    "AcquireTimeout": AcquireTimeout,
    "LeaseLost": LeaseLost,
    "LockOrderError": LockOrderError,
    "UnknownJob": UnknownJob,
    "BadRequest": BadRequest,
    "Unauthorized": Unauthorized,
    "Forbidden": Forbidden,
}


class Offloadable(Protocol):
    def offload(self) -> float: ...  # seconds taken
    def restore(self) -> float: ...


def post(url: str, route: str, body: dict[str, Any], timeout_s: float = 30.0) -> dict[str, Any]:
    data = json.dumps(body).encode()
    if len(data) > MAX_BODY_BYTES:  # the daemon would refuse it unread (413)
        raise BadRequest(
            f"{route}: a body of {len(data)} bytes is over the scheduler's limit of {MAX_BODY_BYTES}"
        )
    req = urllib.request.Request(
        url.rstrip("/") + route, data=data, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as err:
        try:
            payload = json.loads(err.read() or b"{}")
        except ValueError:
            payload = {}
        cls = ERRORS.get(payload.get("type", ""), SchedulerError)
        raise cls(
            payload.get("error") or f"scheduler answered HTTP {err.code} to {route}"
        ) from None
    except urllib.error.URLError as err:
        raise SchedulerError(f"cannot reach the scheduler at {url}: {err.reason}") from None


def get_json(url: str, route: str, timeout_s: float = 10.0) -> dict[str, Any]:
    try:
        with urllib.request.urlopen(url.rstrip("/") + route, timeout=timeout_s) as resp:
            return json.loads(resp.read())
    except urllib.error.URLError as err:
        raise SchedulerError(
            f"cannot reach the scheduler at {url}: {getattr(err, 'reason', err)}"
        ) from None


@dataclass
class Lease:
    id: str
    devices: list[str]
    cores: list[int] | None
    waited_s: float
    client: SchedulerClient
    phase: str = ""
    restore_s: float = 0.0
    stats: dict[str, float] = field(default_factory=dict)

    def boundary(self) -> bool:
        """At a phase boundary inside a long lease: True when the scheduler asks this job
        to yield (held past max_hold_s while others wait)."""
        out = self.client._post("/v1/boundary", {"lease_id": self.id})
        return bool(out["yield"])


def _register(
    url: str,
    name: str,
    priority: int,
    weight: float,
    heartbeat_timeout_s: float,
    token: str | None,
) -> dict[str, Any]:
    """Register job ``name`` with the daemon at ``url``: its id and secret."""
    return post(
        url,
        "/v1/register",
        {
            "name": name,
            "priority": priority,
            "weight": weight,
            "heartbeat_timeout_s": heartbeat_timeout_s,
            "token": token or read_token(url),
        },
    )


class SchedulerClient:
    def __init__(
        self,
        url: str,
        name: str,
        *,
        priority: int = 0,
        weight: float = 1.0,
        heartbeat_timeout_s: float = 10.0,
        heartbeat_interval_s: float | None = None,
        pin: bool = True,
        poll_s: float = 20.0,
        token: str | None = None,
    ) -> None:
        self.url, self.name, self.pin, self.poll_s = url, name, pin, poll_s
        out = _register(url, name, priority, weight, heartbeat_timeout_s, token)
        self.job_id: str = out["job_id"]
        self.job_secret: str = out["secret"]  # proves every later call is this job's
        self.state: list[Offloadable] = []
        self.offloaded = False
        self.lost: str | None = None
        self.state_lock = threading.Lock()  # one phase (or offload) of this job at a time
        self.stats = {
            "offload_s": 0.0,
            "restore_s": 0.0,
            "num_offloads": 0,
            "wait_s": 0.0,
            "held_s": 0.0,
            "num_leases": 0,
        }
        self._gap_ema_s: dict[str, float] = {}  # phase -> the gap after it, before the next acquire
        self._released: tuple[str, float] | None = None  # (phase, when) of the last release
        self._stop = threading.Event()
        self._heartbeat = self._start_heartbeat(heartbeat_interval_s or heartbeat_timeout_s / 4)

    def _start_heartbeat(self, interval_s: float) -> threading.Thread:
        """The thread that tells the daemon every ``interval_s`` that this job is alive."""
        thread = threading.Thread(
            target=self._heartbeat_loop,
            args=(interval_s,),
            daemon=True,
            name=f"scheduler-heartbeat-{self.name}",
        )
        thread.start()
        return thread

    def attach(self, state: Offloadable) -> None:
        """Something of this job's that must leave the device when another job takes it."""
        self.state.append(state)

    def _post(self, route: str, body: dict[str, Any], timeout_s: float = 30.0) -> dict[str, Any]:
        if self.lost:
            raise LeaseLost(self.lost)
        return post(
            self.url, route, {"job_id": self.job_id, "secret": self.job_secret, **body}, timeout_s
        )

    # -- leases --------------------------------------------------------------------------

    def acquire(
        self,
        devices: str | list[str],
        phase: str,
        *,
        expected_s: float | None = None,
        timeout_s: float | None = None,
    ) -> Lease:
        """Block until the devices are this job's, or raise ``AcquireTimeout`` past
        ``timeout_s`` with the reason it waited. Prefer ``with client.lease(...)``."""
        with trace.span("lease_wait", "scheduler", phase=phase):
            return self._acquire(devices, phase, expected_s, timeout_s)

    def _acquire(
        self,
        devices: str | list[str],
        phase: str,
        expected_s: float | None,
        timeout_s: float | None,
    ) -> Lease:
        devices = [devices] if isinstance(devices, str) else list(devices)
        t0 = time.time()
        if self._released is not None:
            last, at = self._released
            gap, ema = t0 - at, self._gap_ema_s.get(last)
            self._gap_ema_s[last] = gap if ema is None else 0.7 * ema + 0.3 * gap
            self._released = None
        body = {
            "devices": devices,
            "phase": phase,
            "expected_s": expected_s,
            "timeout_s": timeout_s,
            "poll_s": self.poll_s,
        }
        out = self._post("/v1/acquire", body, timeout_s=self.poll_s + 30)
        while "pending" in out:
            out = self._post(
                "/v1/wait", {"request_id": out["pending"], "poll_s": self.poll_s}, self.poll_s + 30
            )
        self.stats["wait_s"] += time.time() - t0
        return Lease(
            out["lease_id"], out["devices"], out["cores"], out["waited_s"], self, phase=phase
        )

    def begin(self, lease: Lease) -> None:
        """The start of a phase (holding ``state_lock``): bring the state back if it left."""
        lease.stats["begun_at"] = time.time()
        if self.offloaded:
            lease.restore_s = sum(s.restore() for s in self.state)
            self.offloaded = False
            self.stats["restore_s"] += lease.restore_s

    def end(self, lease: Lease) -> None:
        """The end of a phase (holding ``state_lock``): release; offload first if another
        job waits for the devices."""
        self.stats["held_s"] += time.time() - lease.stats.get("begun_at", time.time())
        self.stats["num_leases"] += 1
        if self.lost:
            return
        out = self._post(
            "/v1/release",
            {
                "lease_id": lease.id,
                "restore_s": lease.restore_s,
                "expected_idle_s": self._gap_ema_s.get(lease.phase),
            },
        )
        if out.get("evict"):
            self._offload(lease.devices)
        self._released = (lease.phase, time.time())

    def release(self, lease: Lease) -> None:
        """End a lease taken with ``acquire`` (offloading first if another job waits)."""
        with self.state_lock:
            self.end(lease)

    @contextmanager
    def lease(
        self,
        devices: str | list[str],
        phase: str,
        *,
        expected_s: float | None = None,
        timeout_s: float | None = None,
    ) -> Iterator[Lease]:
        """Run the body as a device phase: acquired, restored, pinned; then released."""
        # Not under the state lock while waiting: the heartbeat thread may have to offload
        # this job's state for the job the scheduler picks first.
        lease = self.acquire(devices, phase, expected_s=expected_s, timeout_s=timeout_s)
        with self.state_lock:
            try:
                self.begin(lease)
                with pinned(lease.cores if self.pin else None):
                    yield lease
            finally:
                self.end(lease)

    def _offload(self, devices: list[str]) -> None:
        """Move the state off (the caller holds ``state_lock``) and tell the scheduler."""
        seconds = 0.0
        if not self.offloaded and self.state:
            seconds = sum(s.offload() for s in self.state)
            self.offloaded = True
            self.stats["offload_s"] += seconds
            self.stats["num_offloads"] += 1
        self._post("/v1/evicted", {"devices": devices, "offload_s": seconds})

    # -- heartbeats ----------------------------------------------------------------------

    def _heartbeat_loop(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            try:
                out = self._post("/v1/heartbeat", {}, timeout_s=max(interval_s, 5.0))
            except (LeaseLost, UnknownJob, Forbidden) as err:
                self.lost = str(err)
                logger.error("scheduler: %s", err)
                return
            except SchedulerError as err:  # the daemon restarting: keep trying
                logger.warning("scheduler heartbeat failed: %s", err)
                continue
            # Offload now unless a phase of this job runs (then the device is not idle and
            # the scheduler asks again at the next heartbeat); never block the heartbeat.
            if out.get("evict") and self.state_lock.acquire(blocking=False):
                try:
                    self._offload(out["evict"])
                except SchedulerError as err:
                    logger.warning("scheduler: offload for another job failed: %s", err)
                finally:
                    self.state_lock.release()

    def close(self) -> None:
        self._stop.set()
        self._heartbeat.join(timeout=5)
        if not self.lost:
            try:
                self._post("/v1/unregister", {})
            except SchedulerError as err:
                logger.warning("scheduler unregister failed: %s", err)


@contextmanager
def pinned(cores: list[int] | None, *, whole_process: bool = False) -> Iterator[None]:
    """Run the calling thread (or every thread of this process) on ``cores`` meanwhile:
    a phase on a CPU device."""
    if not cores or not hasattr(os, "sched_setaffinity"):
        yield
        return
    tids = [int(t) for t in os.listdir("/proc/self/task")] if whole_process else [0]
    with pinned_threads(cores, tids):
        yield


@contextmanager
def pinned_threads(cores: list[int], tids: list[int]) -> Iterator[None]:
    """Threads ``tids`` (0: the caller) on ``cores`` meanwhile; each gets its own mask back."""
    before = {}
    for tid in tids:
        try:
            before[tid] = os.sched_getaffinity(tid)
            os.sched_setaffinity(tid, set(cores))
        except (ProcessLookupError, PermissionError):  # a thread that just ended
            before.pop(tid, None)
    try:
        yield
    finally:
        for tid, mask in before.items():
            try:
                os.sched_setaffinity(tid, mask)
            except (ProcessLookupError, PermissionError):
                pass
