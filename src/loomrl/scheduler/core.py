"""The scheduler as a state machine over explicit time.

Every call takes ``now``; nothing here sleeps, spawns or reads a clock. The daemon drives
it with the wall clock (under one lock) and the simulator with simulated time, so both
run the same rules:

- A request names the devices it needs; it is granted all of them at once or not at all,
  so a job never holds one device while waiting for another, and a job that already holds
  a device may only ask for devices that sort after it (one lock order; no deadlock).
- A request has a deadline; past it the request fails with the reason it waited.
- A job heartbeats; past its heartbeat deadline it is declared dead and loses its leases.
- Eviction is lazy: a job's state stays on a device after its lease ends (the device's
  ``resident``), and leaves only when another job is granted that device. The holder
  offloads before the device changes hands; the offload is charged to the job that asked.
- Switch-cost-aware grants: a waiter gets a device from a resident job only when that
  job's expected idle gap exceeds ``switch_cost_multiple`` times its swap cost.
- A lease held past ``max_hold_s`` while others wait is asked to yield at its next
  phase boundary.
- A job that expects to be back within ``hold_gap_s`` of its release (back-to-back
  phases) competes at its release as if it were still waiting; when the policy picks it,
  the device is kept for it that long (no swap, and the fair policy can give a job with
  more credit two turns in a row).
"""

from __future__ import annotations

import logging
from typing import Any

from loomrl.scheduler.books import SchedulerBooks, moving_average
from loomrl.scheduler.model import (
    MAX_WEIGHT,
    MIN_WEIGHT,
    Device,
    Job,
    Lease,
    LeaseLost,
    LockOrderError,
    Request,
    SchedulerError,
    check_number,
)
from loomrl.scheduler.policies import Policy, make_policy

logger = logging.getLogger(__name__)


class Scheduler(SchedulerBooks):
    """The rules over the books: jobs register and heartbeat, requests wait and are
    granted, leases end (kept, evicting or released)."""

    def __init__(
        self,
        devices: dict[str, list[int] | None],
        policy: str | Policy = "fifo",
        *,
        max_hold_s: float | None = None,
        switch_cost_multiple: float = 0.0,
        quantum_s: float = 1.0,
        hold_gap_s: float = 0.05,
        store: Any = None,
        now: float = 0.0,
        history_s: float = 600.0,
    ) -> None:
        self.max_hold_s = max_hold_s
        self.switch_cost_multiple = switch_cost_multiple
        self.hold_gap_s = hold_gap_s
        super().__init__(
            devices,
            make_policy(policy, quantum_s) if isinstance(policy, str) else policy,
            store=store,
            now=now,
            history_s=history_s,
        )

    # -- jobs ----------------------------------------------------------------------------

    def register(
        self,
        name: str,
        now: float,
        *,
        priority: int = 0,
        weight: float = 1.0,
        heartbeat_timeout_s: float = 10.0,
        secret_sha256: str | None = None,
    ) -> Job:
        weight = check_number("weight", weight, MIN_WEIGHT, MAX_WEIGHT)
        heartbeat_timeout_s = check_number("heartbeat_timeout_s", heartbeat_timeout_s, 1e-9)
        job = Job(
            id=self._new_id("j"),
            name=name,
            priority=priority,
            weight=weight,
            heartbeat_timeout_s=heartbeat_timeout_s,
            registered_at=now,
            last_heartbeat=now,
            seq=self._counter,
            secret_sha256=secret_sha256,
        )
        self.jobs[job.id] = job
        self.save(job)
        self.event(now, "register", job.id, priority=priority, weight=weight)
        return job

    def heartbeat(self, job_id: str, now: float) -> dict[str, Any]:
        """Keep the job alive; say what it must do: offload from devices another job is
        waiting for, and yield leases held past the max hold time."""
        job = self.job(job_id)
        job.last_heartbeat = now
        self.save(job)
        evict = [
            d.name
            for d in self.devices.values()
            if d.resident == job_id and d.holder is None and d.evict_for is not None
        ]
        yields = [x.id for x in self.leases.values() if x.job_id == job_id and x.yield_requested]
        return {"evict": evict, "yield": yields}

    def unregister(self, job_id: str, now: float) -> None:
        job = self.job(job_id)
        self._drop_job(job, now, "done", "unregister")

    def _drop_job(self, job: Job, now: float, state: str, why: str) -> None:
        for lease in [x for x in self.leases.values() if x.job_id == job.id]:
            if lease.state == "held":
                self._charge_use(lease, now - lease.granted_at)
            self._end_lease(lease, now, "lost" if state == "dead" else "released")
            self.event(
                now,
                "lease_lost" if state == "dead" else "release",
                job.id,
                ",".join(lease.devices),
                lease=lease.id,
                why=why,
            )
        for device in self.devices.values():
            if device.resident == job.id:
                device.resident, device.evict_for = None, None
                self.save(device)
        for request in [r for r in self.requests.values() if r.job_id == job.id]:
            self._finish_request(request, "cancelled", f"job {job.name!r}: {why}")
        job.state, job.ended_at = state, now
        self.save(job)
        self.event(now, why, job.id)

    # -- requests ------------------------------------------------------------------------

    def request(
        self,
        job_id: str,
        devices: list[str],
        phase: str,
        now: float,
        *,
        expected_s: float | None = None,
        timeout_s: float | None = None,
    ) -> Request:
        job = self.job(job_id)
        if expected_s is not None:
            expected_s = check_number("expected_s", expected_s)
        if timeout_s is not None:
            timeout_s = check_number("timeout_s", timeout_s)
        if not devices:
            raise SchedulerError("an acquire needs at least one device")
        unknown = [d for d in devices if d not in self.devices]
        if unknown:
            raise SchedulerError(
                f"unknown device(s) {unknown}; this scheduler has {sorted(self.devices)}"
            )
        wanted = sorted(set(devices))
        held = sorted({d for x in self.leases.values() if x.job_id == job_id for d in x.devices})
        if held and wanted[0] < held[-1] and wanted[0] not in held:
            raise LockOrderError(
                f"job {job.name!r} holds {held} and asked for {wanted}: devices are taken in name "
                f"order, so {wanted[0]!r} cannot be asked for while holding {held[-1]!r}; ask for all "
                "devices in one acquire, or release first"
            )
        request = Request(
            id=self._new_id("r"),
            job_id=job_id,
            devices=wanted,
            phase=phase,
            expected_s=expected_s,
            requested_at=now,
            deadline_at=None if timeout_s is None else now + timeout_s,
        )
        self.requests[request.id] = request
        self.save(request)
        self.event(now, "request", job_id, ",".join(wanted), phase=phase, request=request.id)
        self.schedule(now)
        return request

    def cancel(self, request_id: str, now: float, why: str = "cancelled by the job") -> None:
        request = self.requests.get(request_id)
        if request is not None:
            self._finish_request(request, "cancelled", why)
            self.schedule(now)

    # -- the scheduling pass -------------------------------------------------------------

    def tick(self, now: float) -> None:
        """Apply every deadline due by ``now`` (heartbeats, acquires, max hold), then grant."""
        for job in list(self.jobs.values()):
            if job.state == "alive" and now - job.last_heartbeat > job.heartbeat_timeout_s:
                logger.warning(
                    "job %r missed its heartbeat deadline; its leases are reclaimed", job.name
                )
                self._drop_job(
                    job,
                    now,
                    "dead",
                    f"missed its heartbeat deadline ({job.heartbeat_timeout_s:g} s)",
                )
        for request in list(self.requests.values()):
            if request.deadline_at is not None and now >= request.deadline_at:
                self._timeout(request, now)
        if self.max_hold_s is not None:
            for lease in self.leases.values():
                over = now - lease.granted_at > self.max_hold_s
                if (
                    over
                    and lease.state == "held"
                    and not lease.yield_requested
                    and self._others_wait(lease)
                ):
                    lease.yield_requested = True
                    self.save(lease)
                    self.event(
                        now,
                        "yield_requested",
                        lease.job_id,
                        ",".join(lease.devices),
                        lease=lease.id,
                    )
        self.schedule(now)

    def _timeout(self, request: Request, now: float) -> None:
        waited = now - request.requested_at
        job = self.jobs[request.job_id]
        job.wait_s += waited
        self.save(job)
        error = (
            f"acquire of {request.devices} for job {job.name!r} (phase {request.phase!r}) timed out "
            f"after {waited:.2f} s: {self.why_waiting(request, now)}"
        )
        self._finish_request(request, "timed_out", error)
        self.event(now, "timeout", request.job_id, ",".join(request.devices), request=request.id)

    def schedule(self, now: float) -> None:
        """Grant whatever the policy and the lease rules allow now."""
        progress = True
        while progress:
            progress = False
            for device in sorted(self.devices.values(), key=lambda d: d.name):
                if device.holder is not None:
                    continue
                waiters = [r for r in self.requests.values() if device.name in r.devices]
                kept = self._kept_for(device, now)
                if kept is not None:  # only the job it is kept for may have it now
                    waiters = [r for r in waiters if r.job_id == kept]
                pick = self.policy.pick(device.name, waiters, self, now) if waiters else None
                if pick is not None and self._try_grant(pick, now):
                    progress = True

    def _kept_for(self, device: Device, now: float) -> str | None:
        if device.reserved_for is not None and now < device.reserved_until:
            return device.reserved_for
        resident = self.jobs.get(device.resident or "")
        if (
            resident is not None
            and device.evict_for is None
            and self._switch_deferred(resident, now)
        ):
            return resident.id
        return None

    def _switch_deferred(self, resident: Job, now: float) -> bool:
        """Keep a device for its resident job when its expected gap is too short to pay
        for a swap (and it is not yet overdue)."""
        k, gap = self.switch_cost_multiple, resident.expected_idle_s
        if k <= 0 or gap is None or resident.released_at is None:
            return False
        cost = resident.swap_cost_s
        if gap >= k * cost:
            return False
        return now < resident.released_at + gap + cost  # overdue: give the device away

    def _try_grant(self, request: Request, now: float) -> bool:
        if not self.devices_free(request):
            return False
        for name in request.devices:
            device = self.devices[name]
            if device.reserved_for not in (None, request.job_id) and now < device.reserved_until:
                return False
        blocked = False
        for name in request.devices:
            device = self.devices[name]
            if device.resident in (None, request.job_id):
                continue
            blocked = True
            resident = self.jobs[device.resident]
            if device.evict_for is None and not self._switch_deferred(resident, now):
                device.evict_for = request.job_id  # the resident job offloads at its next heartbeat
                self.save(device)
                self.event(
                    now,
                    "evict_requested",
                    resident.id,
                    name,
                    for_job=self.jobs[request.job_id].name,
                )
        if blocked:
            return False
        self._grant(request, now)
        return True

    def _grant(self, request: Request, now: float) -> None:
        job = self.jobs[request.job_id]
        lease = Lease(
            id=self._new_id("l"),
            job_id=job.id,
            devices=request.devices,
            phase=request.phase,
            granted_at=now,
            expected_s=request.expected_s,
            request_id=request.id,
        )
        self.leases[lease.id] = lease
        for name in request.devices:
            device = self.devices[name]
            device.holder, device.resident, device.evict_for = lease.id, job.id, None
            device.reserved_for = None
            self.save(device)
        request.lease_id = lease.id
        self._finish_request(request, "granted", None)
        job.wait_s += now - request.requested_at
        job.num_grants += 1
        self.save(job)
        self.save(lease)
        self.policy.on_grant(job)
        self.event(
            now,
            "grant",
            job.id,
            ",".join(lease.devices),
            lease=lease.id,
            phase=lease.phase,
            waited_s=round(now - request.requested_at, 4),
        )

    def _others_wait(self, lease: Lease) -> bool:
        return any(
            r.job_id != lease.job_id and set(r.devices) & set(lease.devices)
            for r in self.requests.values()
        )

    # -- the end of a lease --------------------------------------------------------------

    def lease(self, lease_id: str, job_id: str) -> Lease:
        self.job(job_id)
        lease = self.leases.get(lease_id)
        if lease is None or lease.job_id != job_id:
            raise LeaseLost(f"lease {lease_id!r} is not held by job {job_id!r} (released, or lost)")
        return lease

    def release(
        self,
        lease_id: str,
        job_id: str,
        now: float,
        *,
        restore_s: float = 0.0,
        expected_idle_s: float | None = None,
    ) -> dict[str, Any]:
        """End a phase. Returns ``{"evict": True}`` when another job waits for these devices
        and should get them: the caller then offloads and calls ``evicted``. Otherwise the
        job's state stays resident (lazy eviction) and the devices are free."""
        restore_s = check_number("restore_s", restore_s)
        if expected_idle_s is not None:
            expected_idle_s = check_number("expected_idle_s", expected_idle_s)
        lease = self.lease(lease_id, job_id)
        if lease.state != "held":
            raise SchedulerError(f"lease {lease_id} is {lease.state}, not held")
        job = self.jobs[job_id]
        job.expected_idle_s, job.released_at = expected_idle_s, now
        if restore_s > 0:
            self._charge_restore(job, restore_s)
        self._charge_use(lease, now - lease.granted_at)  # before the policy looks at accounts
        back_soon = expected_idle_s is not None and expected_idle_s <= self.hold_gap_s
        waiter = self._next_waiter(lease, now, include_holder=back_soon)
        if waiter is not None and waiter.job_id == job_id:  # the policy would pick the holder again
            self._keep_for_holder(lease, now, expected_idle_s)
            return {"evict": False}
        if waiter is not None and not self._switch_deferred(job, now):
            lease.state, lease.evict_for = "evicting", waiter.job_id
            lease.extra["released_at"] = now
            self.save(lease)
            self.save(job)
            self.event(now, "release", job_id, ",".join(lease.devices), lease=lease.id, evict=True)
            return {"evict": True}
        self._end_lease(lease, now, "released")
        self.event(now, "release", job_id, ",".join(lease.devices), lease=lease.id, evict=False)
        self.schedule(now)
        return {"evict": False}

    def _keep_for_holder(self, lease: Lease, now: float, expected_idle_s: float) -> None:
        """End the lease but reserve its devices for its job, back within its idle gap."""
        self._end_lease(lease, now, "released")
        for name in lease.devices:
            device = self.devices[name]
            device.reserved_for, device.reserved_until = (
                lease.job_id,
                now + expected_idle_s + self.hold_gap_s,
            )
            self.save(device)
        self.event(
            now,
            "release",
            lease.job_id,
            ",".join(lease.devices),
            lease=lease.id,
            evict=False,
            kept=True,
        )

    def _next_waiter(
        self, lease: Lease, now: float, include_holder: bool = False
    ) -> Request | None:
        """The request the policy would grant next on the lease's devices; with
        ``include_holder``, the holder competes too, as a request made now."""
        for name in lease.devices:
            waiters = [
                r for r in self.requests.values() if name in r.devices and r.job_id != lease.job_id
            ]
            if not waiters:
                continue
            if include_holder:
                waiters.append(
                    Request(
                        id="~holder",
                        job_id=lease.job_id,
                        devices=lease.devices,
                        phase=lease.phase,
                        expected_s=lease.expected_s,
                        requested_at=now,
                        deadline_at=None,
                    )
                )
            return self.policy.pick(name, waiters, self, now) or waiters[0]
        return None

    def evicted(
        self, job_id: str, devices: list[str], now: float, *, offload_s: float = 0.0
    ) -> None:
        """The job's state has left ``devices``; the offload is charged to the job it made
        room for (and counts as one swap of that job)."""
        offload_s = check_number("offload_s", offload_s)
        job = self.job(job_id)
        if offload_s > 0:
            job.offload_ema_s = moving_average(job.offload_ema_s, offload_s)
        for lease in [
            x for x in self.leases.values() if x.job_id == job_id and x.state == "evicting"
        ]:
            if not set(lease.devices) & set(devices):
                continue
            start = lease.extra.get("released_at", now)
            for name in lease.devices:
                self.devices[name].busy_s += now - start
                self.devices[name].resident = None
            self._charge_swap(lease.evict_for, job, lease.devices, offload_s, start, now)
            self._end_lease(lease, now, "released")
        for name in devices:
            device = self.devices.get(name)
            if device is not None and device.resident == job_id and device.holder is None:
                self._charge_swap(device.evict_for, job, [name], offload_s, now - offload_s, now)
                device.resident, device.evict_for = None, None
                self.save(device)
        self.event(now, "evicted", job_id, ",".join(devices), offload_s=round(offload_s, 4))
        self.schedule(now)
