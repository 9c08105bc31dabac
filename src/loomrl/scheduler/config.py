"""``[scheduler]``: whether the job's device phases run in a time-slicing scheduler's leases.

Imported with the job's config; nothing else of ``loomrl.scheduler`` is, unless ``url`` is set."""

from __future__ import annotations

from pydantic import Field

from loomrl.config_base import Section


class SchedulerConfig(Section):
    url: str | None = Field(
        None,
        description="A time-slicing scheduler to share devices with other jobs (`loomrl scheduler serve`, "
        "e.g. 'http://127.0.0.1:7878'): each device phase (generate, train, weight sync, checkpoint) then "
        "runs in a lease. None: this job has its devices to itself.",
    )
    device: str = Field(
        "cpu0", description="The scheduler's name of the device this job's phases run on."
    )
    priority: int = Field(
        0,
        ge=-1_000_000,
        le=1_000_000,
        description="Priority under the scheduler's 'priority' policy (higher first).",
    )
    weight: float = Field(
        1.0,
        ge=1e-3,
        le=1e3,
        description="Share under the 'fair' policy (device-seconds in proportion; the daemon "
        "refuses weights outside 0.001..1000).",
    )
    heartbeat_timeout_s: float = Field(
        30.0,
        ge=0.05,
        le=3600,
        description="Past this without a heartbeat the scheduler takes this job's leases "
        "away (the daemon refuses values outside 0.05..3600 s).",
    )
    acquire_timeout_s: float | None = Field(
        None,
        gt=0,
        description="Fail the job when a phase waits longer than this for its device (None: wait).",
    )
    offload: bool = Field(
        True,
        description="Move the trainer's and generators' state off the device when another job takes it.",
    )
    pin: bool = Field(
        True, description="On a CPU device, run the job's threads on its cores during a phase."
    )
