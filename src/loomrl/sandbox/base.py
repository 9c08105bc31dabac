"""The Sandbox interface: run a Python snippet or a command in isolation.

A ``Sandbox`` runs one exec at a time; each exec gets a fresh process, a fresh work dir
holding the request's files, its own stdin, a wall-clock ``timeout_s`` and a cap on the
bytes it may print. The result says how it ended (``reason``) and how long it took.
Backends live next to this file: ``bwrap`` (namespaces, seccomp, cgroups) and
``process`` (rlimits and an unprivileged uid only).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Literal

ExecReason = Literal[
    "exit",  # the process exited by itself (any exit code)
    "timeout",  # wall-clock timeout: killed
    "output_cap",  # printed more than max_output_bytes: killed
    "cpu_limit",  # RLIMIT_CPU exceeded (SIGXCPU)
    "file_size_limit",  # RLIMIT_FSIZE exceeded (SIGXFSZ)
    "oom",  # killed by the sandbox's cgroup memory limit
    "signal",  # killed by some other signal (its own, or a crash)
    "sandbox_lost",  # the exec brought its sandbox down: the code's failure, never retried
]


@dataclass
class SandboxLimits:
    """Per-exec resource limits (rlimits; cgroups where writable)."""

    timeout_s: float = 5.0  # default wall time per exec
    memory_mb: int = 512  # address space of the exec (RLIMIT_AS) and the cgroup memory limit
    cpu_s: int = 10  # CPU seconds per exec (RLIMIT_CPU)
    processes: int = 64  # processes of the sandbox uid (RLIMIT_NPROC, cgroup pids.max)
    file_size_mb: int = 64  # largest file an exec may write (RLIMIT_FSIZE)
    open_files: int = 256  # RLIMIT_NOFILE
    max_output_bytes: int = 1 << 20  # stdout + stderr bytes kept; more is killed as output_cap
    tmpfs_mb: int = 256  # size of the sandbox's /tmp (work dirs); /dev is 1 MiB
    tcp_buffer_mb: int = 32  # TCP socket buffers (cgroup v1 memory.kmem.tcp; v2 counts them)
    cleanup_s: float = 1.0  # time to remove an exec's files; past it the sandbox is replaced

    def for_server(self) -> dict[str, int]:
        return {
            "cpu_s": self.cpu_s,
            "address_space_bytes": self.memory_mb << 20,
            "processes": self.processes,
            "file_size_bytes": self.file_size_mb << 20,
            "open_files": self.open_files,
        }


class SandboxError(RuntimeError):
    """The sandbox infrastructure failed (not the code it ran). Safe to retry elsewhere."""


@dataclass
class ExecResult:
    """What one exec produced. ``ok`` means it exited by itself with status 0."""

    stdout: str
    stderr: str
    exit_code: int | None  # None when killed by a signal
    signal: int | None
    reason: ExecReason
    truncated: bool = False  # output was cut at the cap
    leftover_killed: int = 0  # rounds of leftover (background) processes killed after it
    timings_ms: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.reason == "exit" and self.exit_code == 0


class Sandbox(ABC):
    """One isolated execution context; ``exec`` may be called many times, never concurrently."""

    backend: str = "?"

    @abstractmethod
    def exec(
        self,
        code: str | None = None,
        *,
        command: list[str] | None = None,
        files: dict[str, str | bytes] | None = None,
        stdin: str | bytes = b"",
        timeout_s: float | None = None,
        max_output_bytes: int | None = None,
    ) -> ExecResult:
        """Run a Python snippet (``code``) or an argv (``command``); exactly one of them."""

    @abstractmethod
    def close(self) -> None:
        """Kill the sandbox and everything in it."""

    @property
    @abstractmethod
    def alive(self) -> bool:
        """Whether the sandbox can still serve execs."""

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
