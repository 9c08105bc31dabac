"""Prometheus text for ``/metrics``, built from one status snapshot per scrape."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


class _SnapshotCollector:
    def __init__(self, snap: dict[str, Any]) -> None:
        self.snap = snap

    def collect(self):
        yield from _device_families(self.snap)
        yield from _job_families(self.snap)
        yield from _daemon_families(self.snap.get("daemon"))


def _device_families(snap: dict[str, Any]):
    """Per device: busy seconds, utilisation, who holds it; and the queue's length."""
    busy = CounterMetricFamily(
        "loomrl_scheduler_device_busy_seconds",
        "Seconds a device was held (leases and swaps).",
        labels=["device"],
    )
    util = GaugeMetricFamily(
        "loomrl_scheduler_device_utilisation",
        f"Share of the last {snap['window_s']:g} s a device was held.",
        labels=["device"],
    )
    held = GaugeMetricFamily(
        "loomrl_scheduler_device_held",
        "1 while a lease holds the device.",
        labels=["device", "job"],
    )
    for d in snap["devices"]:
        busy.add_metric([d["name"]], d["busy_s"])
        util.add_metric([d["name"]], d["utilisation"])
        held.add_metric(
            [d["name"], d["holder"]["job"] if d["holder"] else ""], 1.0 if d["holder"] else 0.0
        )
    yield from (busy, util, held)
    queue = GaugeMetricFamily("loomrl_scheduler_queue_length", "Requests waiting for a device.")
    queue.add_metric([], len(snap["queue"]))
    yield queue


def _job_families(snap: dict[str, Any]):
    """Per job: device, swap and wait seconds, grants, slowdown, whether it heartbeats."""
    fams = {
        "device_s": CounterMetricFamily(
            "loomrl_scheduler_job_device_seconds", "Device-seconds a job held.", labels=["job"]
        ),
        "swap_s": CounterMetricFamily(
            "loomrl_scheduler_job_swap_seconds",
            "Offload/restore seconds charged to a job.",
            labels=["job"],
        ),
        "wait_s": CounterMetricFamily(
            "loomrl_scheduler_job_wait_seconds",
            "Seconds a job waited for devices.",
            labels=["job"],
        ),
        "grants": CounterMetricFamily(
            "loomrl_scheduler_job_grants", "Leases granted to a job.", labels=["job"]
        ),
        "slowdown": GaugeMetricFamily(
            "loomrl_scheduler_job_slowdown",
            "elapsed / (elapsed - wait) of a job.",
            labels=["job"],
        ),
    }
    alive = GaugeMetricFamily(
        "loomrl_scheduler_job_alive", "1 while a job heartbeats.", labels=["job"]
    )
    for j in snap["jobs"]:
        for key, fam in fams.items():
            fam.add_metric([j["name"]], float(j[key]))
        alive.add_metric([j["name"]], 1.0 if j["state"] == "alive" else 0.0)
    yield from fams.values()
    yield alive


def _daemon_families(daemon: dict[str, Any] | None):
    """The daemon's own health: tick failures, tick age, connections."""
    if daemon is None:
        return
    specs = [
        (
            CounterMetricFamily,
            "tick_errors",
            "Scheduling passes that raised (logged; the loop went on).",
            "tick_errors",
        ),
        (
            GaugeMetricFamily,
            "tick_age_seconds",
            "Seconds since the last scheduling pass completed.",
            "tick_age_s",
        ),
        (
            GaugeMetricFamily,
            "healthy",
            "1 while /healthz is ok (the tick loop runs and completes).",
            "ok",
        ),
        (GaugeMetricFamily, "connections", "Open client connections.", "connections"),
        (
            CounterMetricFamily,
            "connections_evicted",
            "Idle connections closed to make room at the cap.",
            "connections_evicted",
        ),
        (
            CounterMetricFamily,
            "connections_refused",
            "Connections refused (503) at the cap, every one busy.",
            "connections_refused",
        ),
        (
            CounterMetricFamily,
            "connections_timed_out",
            "Connections closed at their deadline (no whole request in --idle-timeout-s).",
            "connections_timed_out",
        ),
    ]
    for cls, name, doc, key in specs:
        fam = cls(f"loomrl_scheduler_{name}", doc)
        fam.add_metric([], float(daemon[key]))
        yield fam


def render(snap: dict[str, Any]) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_SnapshotCollector(snap))
    return generate_latest(registry)
