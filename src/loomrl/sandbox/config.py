"""``[sandbox]``: the warm pool's sizes and each sandbox's limits."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from loomrl.config_base import Section


class SandboxConfig(Section):
    backend: Literal["auto", "bwrap", "process"] = Field(
        "auto", description="Isolation backend; 'auto' takes bwrap where installed."
    )
    min_warm: int = Field(2, ge=0, description="Warm sandboxes kept ready at least.")
    max_warm: int = Field(16, gt=0, description="Warm sandboxes kept ready at most.")
    max_sandboxes: int = Field(32, gt=0, description="Sandboxes alive at most (backpressure).")
    timeout_s: float = Field(5.0, gt=0, description="Default wall time per exec.")
    memory_mb: int = Field(512, gt=0, description="Address-space / memory limit per sandbox.")
    cpu_s: int = Field(10, gt=0, description="CPU seconds per exec (RLIMIT_CPU).")
    max_processes: int = Field(
        64, gt=0, description="Processes per sandbox (RLIMIT_NPROC, pids cgroup)."
    )
    max_output_bytes: int = Field(
        1 << 20, gt=0, description="stdout+stderr bytes kept per exec; more kills it (output_cap)."
    )
    ttl_s: float = Field(600.0, gt=0, description="A sandbox retires after this many seconds.")
    max_retries: int = Field(
        2,
        ge=0,
        description="Retries of an exec after sandbox infrastructure failures (never for the code's own failures).",
    )
    uid_base: int = Field(
        880_000, gt=0, description="First of the dedicated unprivileged uids sandboxes run code as."
    )
    allow_no_memory_limit: bool = Field(
        False,
        description="Run sandboxes even where no cgroup (v1 or v2) can bound their memory "
        "(not root, or no writable memory/pids controllers); otherwise the pool refuses to start.",
    )

    @model_validator(mode="after")
    def _pool_sizes_nest(self) -> SandboxConfig:
        if not self.min_warm <= self.max_warm <= self.max_sandboxes:
            raise ValueError(
                f"sandbox sizes must satisfy min_warm <= max_warm <= max_sandboxes, got min_warm={self.min_warm}, "
                f"max_warm={self.max_warm}, max_sandboxes={self.max_sandboxes}"
            )
        return self
