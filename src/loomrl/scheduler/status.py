"""One snapshot of the scheduler for the API, the dashboard and ``loomrl scheduler status``:
devices (holder, utilisation), the queue with each job's wait and why, jobs with their
device-seconds, swap time and slowdown, and the recent lease timeline. Anyone who can reach
the daemon may read it, so it names jobs but never shows a job's id or secret (a job's
calls need its secret; its id alone is no use, but stays private all the same)."""

from __future__ import annotations

from typing import Any

from loomrl.scheduler.core import Scheduler

WINDOW_S = 60.0


def busy_in_window(sched: Scheduler, device: str, start: float, end: float) -> float:
    """Seconds ``device`` was held (leases and swaps) within [start, end]."""
    busy = 0.0
    for span in sched.intervals:
        if span["device"] == device:
            busy += max(0.0, min(end, span["end"]) - max(start, span["start"]))
    holder = sched.leases.get(sched.devices[device].holder or "")
    if holder is not None:
        busy += max(0.0, end - max(start, holder.granted_at))
    return min(busy, end - start)


def snapshot(sched: Scheduler, now: float, window_s: float = WINDOW_S) -> dict[str, Any]:
    return {
        "now": now,
        "policy": sched.policy.name,
        "window_s": window_s,
        "devices": _devices(sched, now, window_s),
        "queue": _queue(sched, now),
        "jobs": _jobs(sched, now),
        "leases": _leases(sched, now),
        "timeline": _timeline(sched, now, window_s),
        "events": list(sched.events)[-30:],
    }


def _devices(sched: Scheduler, now: float, window_s: float) -> list[dict[str, Any]]:
    """Each device: its holder, the job resident on it, its utilisation over the window."""
    window_start = max(sched.started_at, now - window_s)
    span = max(now - window_start, 1e-9)
    devices = []
    for d in sorted(sched.devices.values(), key=lambda d: d.name):
        holder = sched.leases.get(d.holder or "")
        resident = sched.jobs.get(d.resident or "")
        devices.append(
            {
                "name": d.name,
                "cores": d.cores,
                "holder": None
                if holder is None
                else {
                    "lease": holder.id,
                    "job": sched.jobs[holder.job_id].name,
                    "phase": holder.phase,
                    "state": holder.state,
                    "held_s": now - holder.granted_at,
                    "yield_requested": holder.yield_requested,
                },
                "resident": None if resident is None else resident.name,
                "utilisation": busy_in_window(sched, d.name, window_start, now) / span,
                "busy_s": d.busy_s,
            }
        )
    return devices


def _queue(sched: Scheduler, now: float) -> list[dict[str, Any]]:
    """The waiting requests, oldest first, each with why it waits."""
    queue = []
    for r in sorted(sched.requests.values(), key=lambda r: (r.requested_at, r.id)):
        queue.append(
            {
                "request": r.id,
                "job": sched.jobs[r.job_id].name,
                "phase": r.phase,
                "devices": r.devices,
                "waited_s": now - r.requested_at,
                "deadline_in_s": None if r.deadline_at is None else r.deadline_at - now,
                "why": sched.why_waiting(r, now),
            }
        )
    return queue


def _jobs(sched: Scheduler, now: float) -> list[dict[str, Any]]:
    """Each job in registration order: device-seconds, swaps, waits and slowdown."""
    jobs = []
    for j in sorted(sched.jobs.values(), key=lambda j: j.seq):
        end = j.ended_at if j.ended_at is not None else now
        elapsed = max(end - j.registered_at, 1e-9)
        waiting_now = sum(now - r.requested_at for r in sched.requests.values() if r.job_id == j.id)
        wait = j.wait_s + waiting_now
        jobs.append(
            {
                "name": j.name,
                "state": j.state,
                "priority": j.priority,
                "weight": j.weight,
                "device_s": j.device_s,
                "swap_s": j.swap_s,
                "wait_s": wait,
                "grants": j.num_grants,
                "swaps": j.num_swaps,
                "deficit_s": j.deficit_s,
                "elapsed_s": elapsed,
                # what waiting for devices stretched its run by: elapsed / (elapsed - wait)
                "slowdown": elapsed / max(elapsed - wait, 1e-9),
                "heartbeat_age_s": now - j.last_heartbeat,
            }
        )
    return jobs


def _leases(sched: Scheduler, now: float) -> list[dict[str, Any]]:
    return [
        {
            "lease": x.id,
            "job": sched.jobs[x.job_id].name,
            "devices": x.devices,
            "phase": x.phase,
            "state": x.state,
            "held_s": now - x.granted_at,
        }
        for x in sched.leases.values()
    ]


def _timeline(sched: Scheduler, now: float, window_s: float) -> list[dict[str, Any]]:
    """The spans of the window: ended ones, then the leases held now (up to ``now``)."""
    timeline = [s for s in sched.intervals if s["end"] >= now - window_s]
    timeline += [
        {
            "device": n,
            "job": sched.jobs[x.job_id].name,
            "phase": x.phase,
            "kind": "swap" if x.state == "evicting" else "lease",
            "start": x.granted_at,
            "end": now,
        }
        for x in sched.leases.values()
        for n in x.devices
    ]
    return timeline
