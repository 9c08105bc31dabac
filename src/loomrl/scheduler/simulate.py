"""A discrete-event model of jobs sharing devices, driving the real scheduler core.

Each job repeats a cycle of phases: ``("device", s)`` phases run inside a lease (plus a
restore when its state was evicted; plus an offload at the end when another job waits),
``("idle", s)`` phases leave the device (tool calls, sandboxed scoring, waiting for data).
The scheduler is the daemon's own ``core.Scheduler`` under the chosen policy, ticked every
``tick_s`` like the daemon, so what the model predicts is what the rules do.
"""

from __future__ import annotations

import heapq
import itertools
import json
import random
from dataclasses import asdict, dataclass, field
from typing import Any

from loomrl.scheduler.core import Scheduler


@dataclass
class SimJob:
    name: str
    phases: list[tuple[str, float]]  # one cycle: ("device", seconds) | ("idle", seconds)
    offload_s: float = 0.0
    restore_s: float = 0.0
    priority: int = 0
    weight: float = 1.0
    device: str = "dev0"
    start_s: float = 0.0
    jitter: float = 0.0  # each phase lasts its time times U(1 - jitter, 1 + jitter)


@dataclass
class SimResult:
    policy: str
    duration_s: float
    duty: dict[str, float]  # device -> share of the time held (leases and swaps)
    useful_duty: dict[str, float]  # device -> share of the time in device phases proper
    completions: dict[str, int]  # job -> cycles finished
    device_s: dict[str, float]
    swap_s: dict[str, float]
    jain: float
    swap_share: float
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


def jain(values: list[float]) -> float:
    """Jain's fairness index: 1 when all equal, 1/n when one has everything."""
    if not values or not any(values):
        return 1.0
    return sum(values) ** 2 / (len(values) * sum(v * v for v in values))


class _Sim:
    def __init__(
        self,
        jobs: list[SimJob],
        policy: str,
        *,
        switch_cost_multiple: float,
        max_hold_s: float | None,
        tick_s: float,
        quantum_s: float,
        seed: int,
        heartbeat_s: float = 0.0,
    ) -> None:
        self.heartbeat_s = heartbeat_s
        devices = sorted({j.device for j in jobs})
        self.core = Scheduler(
            {d: None for d in devices},
            policy,
            switch_cost_multiple=switch_cost_multiple,
            max_hold_s=max_hold_s,
            quantum_s=quantum_s,
        )
        self.jobs = jobs
        self.rng = random.Random(seed)
        self.tick_s = tick_s
        self.queue: list[tuple[float, int, str, int]] = []
        self.seq = itertools.count()
        self.ids = [
            self.core.register(
                j.name, 0.0, priority=j.priority, weight=j.weight, heartbeat_timeout_s=1e12
            ).id
            for j in jobs
        ]
        self.phase = [0] * len(jobs)
        self.pending: dict[int, str] = {}  # job index -> request id
        self.lease_of: dict[int, str] = {}
        self.lease_restore: dict[int, float] = {}
        self.offloaded = [False] * len(jobs)
        self.evicting: set[int] = set()
        self.completions = [0] * len(jobs)
        self.useful = {d: 0.0 for d in devices}

    def at(self, t: float, what: str, i: int = -1) -> None:
        heapq.heappush(self.queue, (t, next(self.seq), what, i))

    def length(self, i: int, seconds: float) -> float:
        j = self.jobs[i].jitter
        return seconds * (1 + self.rng.uniform(-j, j)) if j else seconds

    def run(self, duration_s: float) -> None:
        for i, job in enumerate(self.jobs):
            self.at(job.start_s, "next", i)
        self.at(0.0, "tick")
        while self.queue:
            t, _, what, i = heapq.heappop(self.queue)
            if t > duration_s:
                break
            getattr(self, f"_on_{what}")(t, i)
            self._start_granted(t)
            self._evict_idle_residents(t)
        self.now = duration_s

    def _on_tick(self, t: float, i: int) -> None:
        self.core.tick(t)
        self.at(t + self.tick_s, "tick")

    def _on_next(self, t: float, i: int) -> None:
        kind, seconds = self.jobs[i].phases[self.phase[i]]
        if kind == "idle":
            self.at(t + self.length(i, seconds), "advance", i)
        else:
            self.pending[i] = self.core.request(
                self.ids[i], [self.jobs[i].device], "device", t, expected_s=seconds
            ).id

    def _on_advance(self, t: float, i: int) -> None:
        self.phase[i] += 1
        if self.phase[i] == len(self.jobs[i].phases):
            self.phase[i] = 0
            self.completions[i] += 1
        self._on_next(t, i)

    def _start_granted(self, t: float) -> None:
        for i, rid in list(self.pending.items()):
            lease = next((x for x in self.core.leases.values() if x.request_id == rid), None)
            if lease is None:
                continue
            del self.pending[i]
            self.lease_of[i] = lease.id
            restore = self.jobs[i].restore_s if self.offloaded[i] else 0.0
            self.offloaded[i] = False
            seconds = self.length(i, self.jobs[i].phases[self.phase[i]][1])
            self.useful[self.jobs[i].device] += seconds
            self.at(t + restore + seconds, "release", i)
            self.lease_restore[i] = restore

    def _gap_after(self, i: int) -> float:
        """The idle time between this device phase and the job's next one."""
        phases, gap = self.jobs[i].phases, 0.0
        for step in range(1, len(phases) + 1):
            kind, seconds = phases[(self.phase[i] + step) % len(phases)]
            if kind == "device":
                break
            gap += seconds
        return gap

    def _on_release(self, t: float, i: int) -> None:
        gap = self._gap_after(i)
        out = self.core.release(
            self.lease_of.pop(i),
            self.ids[i],
            t,
            restore_s=self.lease_restore.pop(i, 0.0),
            expected_idle_s=gap,
        )
        if out["evict"]:
            self.offloaded[i] = True
            self.evicting.add(i)
            self.at(t + self.jobs[i].offload_s, "evicted", i)
        else:
            self._on_advance(t, i)

    def _on_evicted(self, t: float, i: int) -> None:
        self.core.evicted(self.ids[i], [self.jobs[i].device], t, offload_s=self.jobs[i].offload_s)
        if i in self.evicting:  # offload at the end of its own phase: then the job goes on
            self.evicting.discard(i)
            self._on_advance(t, i)

    def _on_idle_evicted(self, t: float, i: int) -> None:
        self.core.evicted(self.ids[i], [self.jobs[i].device], t, offload_s=self.jobs[i].offload_s)
        self.evicting.discard(-1 - i)

    def _evict_idle_residents(self, t: float) -> None:
        """A resident job that is between phases offloads when the scheduler asks (the
        daemon asks at its next heartbeat; here at once)."""
        for device in self.core.devices.values():
            if device.holder is None and device.resident and device.evict_for:
                i = self.ids.index(device.resident)
                if i not in self.lease_of and -1 - i not in self.evicting:
                    self.offloaded[i] = True
                    self.evicting.add(-1 - i)
                    # the client hears of it at its next heartbeat: on average half an interval
                    self.at(t + self.heartbeat_s / 2 + self.jobs[i].offload_s, "idle_evicted", i)


def simulate(
    jobs: list[SimJob],
    policy: str = "fair",
    duration_s: float = 600.0,
    *,
    switch_cost_multiple: float = 0.0,
    max_hold_s: float | None = None,
    tick_s: float = 0.05,
    quantum_s: float = 1.0,
    seed: int = 0,
    heartbeat_s: float = 0.0,
    hold_gap_s: float = 0.05,
) -> SimResult:
    sim = _Sim(
        jobs,
        policy,
        switch_cost_multiple=switch_cost_multiple,
        max_hold_s=max_hold_s,
        tick_s=tick_s,
        quantum_s=quantum_s,
        seed=seed,
        heartbeat_s=heartbeat_s,
    )
    sim.core.hold_gap_s = hold_gap_s
    sim.run(duration_s)
    core = sim.core
    for lease in list(core.leases.values()):  # count what is held at the end up to the end
        if lease.state == "held":
            core._charge_use(lease, duration_s - lease.granted_at)
    names = [j.name for j in jobs]
    device_s = {n: core.jobs[i].device_s for n, i in zip(names, sim.ids)}
    swap_s = {n: core.jobs[i].swap_s for n, i in zip(names, sim.ids)}
    duty = {d.name: min(1.0, d.busy_s / duration_s) for d in core.devices.values()}
    useful = {d: min(1.0, s / duration_s) for d, s in sim.useful.items()}
    return SimResult(
        policy=core.policy.name,
        duration_s=duration_s,
        duty=duty,
        useful_duty=useful,
        completions=dict(zip(names, sim.completions)),
        device_s=device_s,
        swap_s=swap_s,
        jain=jain(list(device_s.values())),
        swap_share=sum(swap_s.values()) / (duration_s * len(core.devices)),
    )


def llm_d_case(train_s: float = 194.0) -> list[SimJob]:
    """llm-d's published two-job case: one trainer GPU at a 41.6% duty cycle alone, 21 s to
    snapshot and 9 s to restore a job's GPU state. ``train_s`` (not published) sets the
    phase length; the idle gap follows from the 41.6%."""
    idle_s = train_s * (1 / 0.416 - 1)
    return [
        SimJob(
            name,
            [("device", train_s), ("idle", idle_s)],
            offload_s=21.0,
            restore_s=9.0,
            start_s=start,
        )
        for name, start in (("job-a", 0.0), ("job-b", train_s / 2))
    ]


def cluster_case(num_jobs: int, num_devices: int, seed: int = 0) -> list[SimJob]:
    """A mix of jobs (device phases 1-10 s, duty 20-70% alone, swaps 2-5% of a phase),
    spread round-robin over ``num_devices`` devices: to project sharing at scale."""
    rng = random.Random(seed)
    jobs = []
    for n in range(num_jobs):
        busy = rng.uniform(1.0, 10.0)
        alone = rng.uniform(0.2, 0.7)
        swap = busy * rng.uniform(0.02, 0.05)
        jobs.append(
            SimJob(
                f"job-{n}",
                [("device", busy), ("idle", busy * (1 / alone - 1))],
                offload_s=swap / 2,
                restore_s=swap / 2,
                device=f"dev{n % num_devices}",
                start_s=rng.uniform(0, busy),
                jitter=0.2,
            )
        )
    return jobs
