"""Who gets a free device next. A policy orders the requests waiting for one device.

Each policy returns the request to grant on ``device`` (or None to leave it idle for now);
the core checks the rest (all devices of a multi-device request free, the resident job's
state evicted, the switch cost worth paying). ``on_charge`` tells the policy what a job
used, so the fair policy can keep its accounts.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

from loomrl.scheduler.model import Job, Request

Scheduler = Any  # loomrl.scheduler.core.Scheduler (not imported: core imports this module)


class Policy(Protocol):
    name: str

    def pick(
        self, device: str, waiters: list[Request], sched: Scheduler, now: float
    ) -> Request | None: ...

    def on_grant(self, job: Job) -> None:
        """``job`` was just granted a lease (a round-robin policy moves past it)."""

    def on_charge(self, job: Job, seconds: float) -> None: ...


class Fifo:
    """First come, first served; the head of the queue blocks the rest (no overtaking)."""

    name = "fifo"

    def pick(
        self, device: str, waiters: list[Request], sched: Scheduler, now: float
    ) -> Request | None:
        return min(waiters, key=lambda r: (r.requested_at, r.id)) if waiters else None

    def on_grant(self, job: Job) -> None:
        pass

    def on_charge(self, job: Job, seconds: float) -> None:
        pass


class PriorityBackfill:
    """Highest priority first (fifo within a priority). When the first in line cannot
    start because another of its devices is busy, a lower one may start here only if its
    expected duration ends before that device is expected to be free (backfill), so it
    never delays the higher one."""

    name = "priority"

    def pick(
        self, device: str, waiters: list[Request], sched: Scheduler, now: float
    ) -> Request | None:
        ordered = sorted(
            waiters, key=lambda r: (-sched.jobs[r.job_id].priority, r.requested_at, r.id)
        )
        if not ordered:
            return None
        head = ordered[0]
        if sched.devices_free(head, exclude=device):
            return head
        start_at = sched.expected_free_at(head.devices, now)
        for request in ordered[1:]:
            fits = request.expected_s is not None and now + request.expected_s <= start_at
            if fits and sched.devices_free(request, exclude=device):
                return request
        return head  # nothing fits before it: the device waits for the head

    def on_grant(self, job: Job) -> None:
        pass

    def on_charge(self, job: Job, seconds: float) -> None:
        pass


class FairShare:
    """Weighted fair share by deficit round robin on device-seconds.

    Of the waiting jobs with positive credit (``deficit_s``), the one with the most credit
    per weight is served (ties: registration order, starting after the last one served);
    what it then uses (lease time, and swap time it caused) is taken off its credit. When
    no waiting job has credit, every live job gets ``quantum_s * weight`` per round, as many
    rounds as it takes for one waiting job to have some. Credit is capped at one quantum, so a job cannot bank time while
    it does not ask; debt is kept, so a job that took long phases waits its turn out.
    """

    name = "fair"

    def __init__(self, quantum_s: float = 1.0) -> None:
        if quantum_s <= 0:
            raise ValueError(f"quantum_s must be > 0, got {quantum_s}")
        self.quantum_s = quantum_s
        self.last_seq = -1

    def pick(
        self, device: str, waiters: list[Request], sched: Scheduler, now: float
    ) -> Request | None:
        if not waiters:
            return None
        by_job: dict[str, Request] = {}
        for r in sorted(waiters, key=lambda r: (r.requested_at, r.id)):
            by_job.setdefault(r.job_id, r)
        jobs = sorted((sched.jobs[j] for j in by_job), key=lambda j: j.seq)
        # round-robin order: the jobs after the one served last, then the rest
        jobs = [j for j in jobs if j.seq > self.last_seq] + [
            j for j in jobs if j.seq <= self.last_seq
        ]
        if not any(j.deficit_s > 0 for j in jobs):
            # Rounds go to every live job, also those between phases (their idle gap is
            # part of their work), so a job with short gaps is not starved of credit.
            rounds = min(math.floor(-j.deficit_s / (self.quantum_s * j.weight)) + 1 for j in jobs)
            for j in sched.jobs.values():
                if j.state == "alive":
                    j.deficit_s = min(
                        j.deficit_s + rounds * self.quantum_s * j.weight, self.quantum_s * j.weight
                    )
                    sched.save(j)
        # The most credit per weight first (ties in round-robin order): a job that was away
        # between phases (a tool call) and returns with credit is served before jobs that
        # spent theirs, so short-phase jobs with gaps are not left behind by long-phase ones.
        chosen = max((j for j in jobs if j.deficit_s > 0), key=lambda j: j.deficit_s / j.weight)
        return by_job[chosen.id]

    def on_grant(self, job: Job) -> None:
        self.last_seq = job.seq

    def on_charge(self, job: Job, seconds: float) -> None:
        job.deficit_s -= seconds


def make_policy(name: str, quantum_s: float = 1.0) -> Policy:
    if name == "fifo":
        return Fifo()
    if name == "priority":
        return PriorityBackfill()
    if name == "fair":
        return FairShare(quantum_s)
    raise ValueError(f"unknown scheduler policy {name!r}; expected 'fifo', 'priority' or 'fair'")


POLICIES = ("fifo", "priority", "fair")
