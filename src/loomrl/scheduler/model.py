"""The scheduler's records: jobs, devices, requests (queue entries) and leases.

Plain dataclasses that serialise to JSON, so the store can keep them and the HTTP API and
the dashboard can show them. Times are seconds on the caller's clock (wall clock in the
daemon, so a restart keeps deadlines; simulated time in the simulator).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any

# Bounds on what a job may ask for: the API refuses values outside them (and non-finite
# ones), the core checks them again, so no number can stop the scheduling pass.
MIN_WEIGHT, MAX_WEIGHT = 1e-3, 1e3  # fair share
MAX_PRIORITY = 1_000_000  # |priority|
# at most an hour: no job holds a device forever unheard
MIN_HEARTBEAT_TIMEOUT_S, MAX_HEARTBEAT_TIMEOUT_S = 0.05, 3600.0
MAX_DURATION_S = 7 * 86400.0  # expected_s, timeout_s, restore_s, offload_s, expected_idle_s
MAX_POLL_S = 60.0
MAX_NAME_CHARS = 128  # job names, phases, device names
MAX_DEVICES = 64  # per request
MAX_BODY_BYTES = 64 * 1024  # a request body; a larger one gets a 413 before it is read


class SchedulerError(RuntimeError):
    """Something the scheduler refused: the message says what and why."""


class AcquireTimeout(SchedulerError):
    """An acquire that was not granted before its deadline."""


class LeaseLost(SchedulerError):
    """The job missed its heartbeat deadline (or the lease was revoked): it holds nothing."""


class LockOrderError(SchedulerError):
    """A job asked for a device that sorts before one it already holds."""


class UnknownJob(SchedulerError):
    """A job id the scheduler does not know (never registered, or declared dead)."""


class BadRequest(SchedulerError):
    """A request the API refuses as written: a missing field, a number out of range or
    not finite, a name too long. The message names the field and the bound."""


class Unauthorized(SchedulerError):
    """Registering without the daemon's token (or with a wrong one)."""


class Forbidden(SchedulerError):
    """A call for a job without that job's secret."""


def check_number(name: str, value: float, lo: float = 0.0, hi: float = math.inf) -> float:
    """``value`` if it is a finite number in [lo, hi], else ``BadRequest`` naming it: one
    NaN or infinity in a job's accounts would stop every scheduling pass after it."""
    if not (isinstance(value, (int, float)) and math.isfinite(value) and lo <= value <= hi):
        raise BadRequest(f"{name} must be a finite number in [{lo:g}, {hi:g}], got {value!r}")
    return float(value)


@dataclass
class Record:
    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]):
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


@dataclass
class Job(Record):
    id: str
    name: str
    priority: int = 0
    weight: float = 1.0
    heartbeat_timeout_s: float = 10.0
    registered_at: float = 0.0
    last_heartbeat: float = 0.0
    state: str = "alive"  # alive | dead (missed its heartbeat) | done (unregistered)
    seq: int = 0  # registration order: the round-robin order of the fair policy
    device_s: float = 0.0  # seconds holding leases (per device, summed)
    swap_s: float = 0.0  # offload/restore seconds charged to this job (it caused them)
    wait_s: float = 0.0  # seconds its granted or expired requests waited in the queue
    num_grants: int = 0
    num_swaps: int = 0
    deficit_s: float = 0.0  # fair policy: deficit round robin credit, in device-seconds
    expected_idle_s: float | None = None  # the gap it expects before its next acquire
    released_at: float | None = None
    offload_ema_s: float | None = None  # moving averages of its reported offload/restore times
    restore_ema_s: float | None = None
    ended_at: float | None = None
    secret_sha256: str | None = None  # the job's secret, hashed: every call of the job proves it

    @property
    def swap_cost_s(self) -> float:
        """What moving this job's state off a device and back costs, as measured so far."""
        return (self.offload_ema_s or 0.0) + (self.restore_ema_s or 0.0)


@dataclass
class Device(Record):
    name: str
    cores: list[int] | None = None  # a CPU device: the cores a phase runs on
    holder: str | None = None  # lease id
    resident: str | None = None  # job id whose state is on the device (lazy eviction)
    evict_for: str | None = None  # job id that waits for the resident job to offload
    reserved_for: str | None = None  # job id the device is kept for, until reserved_until
    reserved_until: float = 0.0
    busy_s: float = 0.0
    created_at: float = 0.0


@dataclass
class Request(Record):
    id: str
    job_id: str
    devices: list[str]
    phase: str
    expected_s: float | None
    requested_at: float
    deadline_at: float | None
    state: str = "waiting"  # waiting | granted | timed_out | cancelled
    lease_id: str | None = None
    error: str | None = None


@dataclass
class Lease(Record):
    id: str
    job_id: str
    devices: list[str]
    phase: str
    granted_at: float
    expected_s: float | None = None
    state: str = "held"  # held | evicting | released | lost
    yield_requested: bool = False
    ended_at: float | None = None
    evict_for: str | None = None  # the waiter whose grant made this holder offload
    restore_s: float = 0.0
    request_id: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
