"""The scheduler's records and its books, without its rules: what exists (jobs, devices,
waiting requests, held leases), how it persists (a store, an event log), and the accounting
of device time and swaps (per-job charges, per-device busy spans). ``core.Scheduler`` adds
the rules (who is granted what, and when) on top; the status snapshot and the simulator read
what is kept here."""

from __future__ import annotations

import logging
import secrets
from collections import deque
from typing import Any

from loomrl.scheduler.model import (
    Device,
    Job,
    Lease,
    LeaseLost,
    Record,
    Request,
    UnknownJob,
)
from loomrl.scheduler.policies import Policy

logger = logging.getLogger(__name__)

EMA = 0.3  # weight of the newest sample in the swap-cost moving averages


def moving_average(average_s: float | None, sample_s: float) -> float:
    """The swap-cost moving average after one more sample (the sample itself at first)."""
    return sample_s if average_s is None else (1 - EMA) * average_s + EMA * sample_s


class SchedulerBooks:
    def __init__(
        self,
        devices: dict[str, list[int] | None],
        policy: Policy,
        *,
        store: Any = None,
        now: float = 0.0,
        history_s: float = 600.0,
    ) -> None:
        self.policy = policy
        self.store = store
        self.started_at = now
        self.history_s = history_s
        self.jobs: dict[str, Job] = {}
        self.devices: dict[str, Device] = {}
        self.requests: dict[str, Request] = {}  # waiting ones
        self.leases: dict[str, Lease] = {}  # held or evicting ones
        self.finished: deque[Request] = deque(maxlen=200)  # timed out / cancelled, for status
        self.intervals: deque[dict[str, Any]] = deque()  # device busy spans, for the timeline
        self.events: deque[dict[str, Any]] = deque(maxlen=200)
        self._counter = 0
        if store is not None:
            self._load(store, now)
        for name, cores in devices.items():
            if name not in self.devices:
                self.devices[name] = Device(name=name, cores=cores, created_at=now)
                self.save(self.devices[name])

    # -- records -----------------------------------------------------------------------

    def job(self, job_id: str) -> Job:
        job = self.jobs.get(job_id)
        if job is None:
            raise UnknownJob(f"unknown job id {job_id!r}: register first")
        if job.state == "dead":
            raise LeaseLost(
                f"job {job.name!r} ({job_id}) missed its heartbeat deadline "
                f"({job.heartbeat_timeout_s:g} s) and lost its leases; register again"
            )
        if job.state == "done":
            raise UnknownJob(f"job {job.name!r} ({job_id}) has unregistered")
        return job

    def lookup(self, request_id: str) -> Request | None:
        if request_id in self.requests:
            return self.requests[request_id]
        if self.store is not None:
            return self.store.get(Request, request_id)
        return next((r for r in self.finished if r.id == request_id), None)

    def _finish_request(self, request: Request, state: str, error: str | None) -> None:
        request.state, request.error = state, error
        self.requests.pop(request.id, None)
        self.finished.append(request)
        self.save(request)

    # -- persistence -------------------------------------------------------------------

    def _load(self, store: Any, now: float) -> None:
        self._counter = store.get_meta("counter", 0)
        for job in store.load(Job):
            if job.state == "alive":
                job.last_heartbeat = now  # a restart gives every job a full heartbeat timeout
            self.jobs[job.id] = job
        self.devices = {d.name: d for d in store.load(Device)}
        self.requests = {r.id: r for r in store.load(Request) if r.state == "waiting"}
        self.leases = {x.id: x for x in store.load(Lease) if x.state in ("held", "evicting")}
        if self.jobs or self.requests:
            logger.info(
                "scheduler state restored: %d jobs, %d waiting, %d leases",
                len(self.jobs),
                len(self.requests),
                len(self.leases),
            )

    def save(self, record: Record) -> None:
        if self.store is not None:
            self.store.save(record)

    def _new_id(self, prefix: str) -> str:
        """In creation order (the counter); unguessable (the random tail)."""
        self._counter += 1
        if self.store is not None:
            self.store.set_meta("counter", self._counter)
        return f"{prefix}{self._counter:06d}-{secrets.token_hex(8)}"

    def event(
        self, now: float, kind: str, job: str | None = None, device: str | None = None, **data: Any
    ) -> None:
        name = self.jobs[job].name if job in self.jobs else job
        ev = {"t": now, "kind": kind, "job": name, "device": device, **data}
        self.events.append(ev)
        if self.store is not None:
            self.store.log_event(ev)

    # -- accounting --------------------------------------------------------------------

    def _charge_use(self, lease: Lease, held_s: float) -> None:
        job = self.jobs[lease.job_id]
        job.device_s += held_s * len(lease.devices)
        self.policy.on_charge(job, held_s * len(lease.devices))
        self.save(job)
        for name in lease.devices:
            self.devices[name].busy_s += held_s
        self._span(
            lease.devices, job, lease.phase, lease.granted_at, lease.granted_at + held_s, "lease"
        )

    def _charge_restore(self, job: Job, restore_s: float) -> None:
        """A restore at the start of the job's lease: its own swap time."""
        job.swap_s += restore_s
        job.restore_ema_s = moving_average(job.restore_ema_s, restore_s)
        self.policy.on_charge(job, restore_s)

    def _charge_swap(
        self,
        cause_id: str | None,
        evicted: Job,
        devices: list[str],
        seconds: float,
        start: float,
        end: float,
    ) -> None:
        cause = self.jobs.get(cause_id or "", evicted)
        cause.swap_s += seconds
        cause.num_swaps += 1
        self.policy.on_charge(cause, seconds)
        self.save(cause)
        self._span(devices, evicted, "offload", start, end, "swap")

    def _span(
        self, devices: list[str], job: Job, phase: str, start: float, end: float, kind: str
    ) -> None:
        for name in devices:
            self.intervals.append(
                {
                    "device": name,
                    "job": job.name,
                    "phase": phase,
                    "kind": kind,
                    "start": start,
                    "end": end,
                }
            )
        while self.intervals and self.intervals[0]["end"] < end - self.history_s:
            self.intervals.popleft()

    def _end_lease(self, lease: Lease, now: float, state: str) -> None:
        lease.state, lease.ended_at = state, now
        self.leases.pop(lease.id, None)
        for name in lease.devices:
            device = self.devices[name]
            if device.holder == lease.id:
                device.holder = None
                if state == "lost":
                    device.resident = None
                self.save(device)
        self.save(lease)

    # -- reporting ---------------------------------------------------------------------

    def why_waiting(self, request: Request, now: float) -> str:
        reasons = []
        for name in request.devices:
            device = self.devices[name]
            holder = self.leases.get(device.holder or "")
            if holder is not None:
                who = self.jobs[holder.job_id].name
                what = "offloading" if holder.state == "evicting" else f"phase {holder.phase!r}"
                reasons.append(
                    f"{name} held by job {who!r} ({what}) for {now - holder.granted_at:.2f} s"
                )
            elif device.resident not in (None, request.job_id):
                who = self.jobs[device.resident].name
                reasons.append(
                    f"{name} waits for job {who!r} to offload"
                    if device.evict_for
                    else f"{name} kept for job {who!r} (its idle gap is shorter than the switch cost)"
                )
        ahead = sum(
            1
            for r in self.requests.values()
            if r.requested_at < request.requested_at and set(r.devices) & set(request.devices)
        )
        if ahead:
            reasons.append(f"{ahead} request(s) ahead in the queue (policy {self.policy.name})")
        return "; ".join(reasons) or f"not picked yet by policy {self.policy.name}"

    # -- queries the policies ask -------------------------------------------------------

    def devices_free(self, request: Request, exclude: str | None = None) -> bool:
        return all(self.devices[d].holder is None for d in request.devices if d != exclude)

    def expected_free_at(self, devices: list[str], now: float) -> float:
        """When the busy ones of ``devices`` are expected to be free (inf if unknown)."""
        latest = now
        for name in devices:
            holder = self.leases.get(self.devices[name].holder or "")
            if holder is None:
                continue
            if holder.expected_s is None or holder.state == "evicting":
                return float("inf")
            latest = max(latest, holder.granted_at + holder.expected_s)
        return latest
