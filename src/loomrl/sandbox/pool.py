"""``SandboxPool``: pre-warmed sandboxes with adaptive buffering, TTLs, retries and quarantine.

A claim takes a ready (idle) sandbox; a sandbox is reused across execs because every exec
is a fresh fork inside it, and the server cleans up after each one. A background thread
keeps ``warm_target`` sandboxes idle, where

    warm_target = clamp(ceil(claim_rate * p95_time_to_ready * safety), min_warm, max_warm)

with the claim rate measured over the last few seconds and the time to ready over the
last cold starts. Idle sandboxes beyond the peak concurrency of the last 30 s plus that
target retire, so a bursty load finds its sandboxes still there at the next burst. A claim that finds no idle sandbox is a *buffer miss*: it starts one
itself if fewer than ``max_sandboxes`` exist, else waits for a release (backpressure).

Only infrastructure failures (``SandboxError``: a dead or garbled sandbox) are retried, on
another sandbox; the code's own failures (non-zero exit, timeout, crash) are results.
A sandbox that failed, or that an exec left dirty, is quarantined: taken out of service,
killed, counted. Sandboxes retire after ``ttl_s`` or ``max_execs_per_sandbox``. A reaper
kills processes of released sandbox uids that somehow outlived their sandbox.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import os
import threading
import time
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from loomrl.sandbox.backends import resolve_backend
from loomrl.sandbox.base import ExecResult, SandboxError, SandboxLimits
from loomrl.sandbox.cgroups import cgroups_writable, remove_stale_cgroups
from loomrl.sandbox.fork_sandbox import (
    ForkServerSandbox,
    kill_uid_processes,
    sweep_stale_work_dirs,
    uid_processes,
)
from loomrl.sandbox.uids import DEFAULT_UID_BASE, DEFAULT_UID_COUNT, UidAllocator
from loomrl.sandbox.workspace import Workspace
from loomrl.telemetry import trace

logger = logging.getLogger(__name__)

MAX_CONCURRENT_STARTS = 4
PEAK_WINDOW_S = 30.0  # idle sandboxes up to the peak concurrency of this window are kept
KILL_REASONS = (
    "timeout",
    "output_cap",
    "cpu_limit",
    "file_size_limit",
    "oom",
    "signal",
    "sandbox_lost",
)


def _percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values``, one of the values itself; 0.0 for none."""
    return float(np.quantile(values, q, method="nearest")) if values else 0.0


def _check_memory_limits(allowed_without: bool) -> None:
    """Refuse to run code without per-sandbox memory limits unless the user opted in."""
    if os.geteuid() == 0 and cgroups_writable():
        return
    why = "not root" if os.geteuid() != 0 else "no writable cgroup v1 or v2 memory+pids"
    if not allowed_without:
        raise SandboxError(
            f"sandboxes would run without memory limits ({why}); set "
            "sandbox.allow_no_memory_limit = true to run them anyway (RLIMIT_AS only)"
        )
    logger.warning("sandboxes run without memory limits (%s): opted in", why)


class SandboxPool:
    """Thread-safe pool; ``exec`` blocks, ``aexec`` awaits (runs ``exec`` in a thread)."""

    def __init__(
        self,
        backend: str = "auto",
        *,
        limits: SandboxLimits | None = None,
        min_warm: int = 2,
        max_warm: int = 16,
        max_sandboxes: int = 32,
        ttl_s: float = 600.0,
        max_execs_per_sandbox: int = 5000,
        claim_timeout_s: float = 60.0,
        max_retries: int = 2,
        safety: float = 2.0,
        uid_base: int = DEFAULT_UID_BASE,
        uid_count: int = DEFAULT_UID_COUNT,
        reaper_interval_s: float = 5.0,
        allow_no_memory_limit: bool = False,
    ) -> None:
        if not 0 <= min_warm <= max_warm <= max_sandboxes:
            raise ValueError(
                f"need 0 <= min_warm <= max_warm <= max_sandboxes, got "
                f"{min_warm}, {max_warm}, {max_sandboxes}"
            )
        self._counts: Counter[str] = Counter()
        self.backend = self._pick_backend(backend)
        self.limits = limits or SandboxLimits()
        _check_memory_limits(allow_no_memory_limit)
        self.min_warm, self.max_warm, self.max_sandboxes = min_warm, max_warm, max_sandboxes
        self.ttl_s, self.max_execs_per_sandbox = ttl_s, max_execs_per_sandbox
        self.claim_timeout_s, self.max_retries, self.safety = claim_timeout_s, max_retries, safety
        self.reaper_interval_s = reaper_interval_s
        self._uids = UidAllocator(uid_base, uid_count)
        self._cond = threading.Condition()
        self._idle: deque[ForkServerSandbox] = deque()
        self._num_busy = self._num_starting = 0
        self._closed = False
        self._claim_times: deque[float] = deque(maxlen=4096)
        self._ready_s: deque[float] = deque(maxlen=128)
        self._busy_history: deque[tuple[float, int]] = deque(maxlen=4096)
        self._latency_ms: deque[float] = deque(maxlen=4096)
        self._used_uids: set[int] = set()
        self._workspaces: set[ForkServerSandbox] = set()
        self._workspace_open_ms: deque[float] = deque(maxlen=4096)
        self._start_threads()

    def _pick_backend(self, backend: str) -> str:
        """The backend ``backend`` means here; a fall back from ``auto`` to the weaker
        ``process`` backend is counted and warned about."""
        resolved = resolve_backend(backend)
        if backend == "auto" and resolved == "process":
            self._counts["backend_fallbacks"] += 1
            logger.warning(
                "sandbox.backend = 'auto' fell back to the weaker 'process' backend (bubblewrap "
                "is not installed): sandboxed code sees the host filesystem and network"
            )
        return resolved

    def _start_threads(self) -> None:
        """The exec threads, the spawner threads and the filler that keeps sandboxes warm
        (after cgroups left by an earlier process are removed)."""
        self._executor = ThreadPoolExecutor(
            self.max_sandboxes + 4, thread_name_prefix="sandbox-exec"
        )
        remove_stale_cgroups(self._uid_is_free)
        if self.backend == "process" and (swept := sweep_stale_work_dirs()):
            logger.warning("removed %d work dirs left by killed sandbox hosts", swept)
        # Sandboxes die with the thread that started them (PR_SET_PDEATHSIG is per thread),
        # so they are only ever started from these long-lived threads.
        self._spawner = ThreadPoolExecutor(
            MAX_CONCURRENT_STARTS, thread_name_prefix="sandbox-spawn"
        )
        self._filler = threading.Thread(target=self._fill_loop, name="sandbox-filler", daemon=True)
        self._filler.start()

    @classmethod
    def from_config(cls, config: object) -> SandboxPool:
        """Build from a ``loomrl.config.SandboxConfig``."""
        limits = SandboxLimits(
            timeout_s=config.timeout_s,
            memory_mb=config.memory_mb,
            cpu_s=config.cpu_s,
            processes=config.max_processes,
            max_output_bytes=config.max_output_bytes,
        )
        return cls(
            config.backend,
            limits=limits,
            min_warm=config.min_warm,
            max_warm=config.max_warm,
            max_sandboxes=config.max_sandboxes,
            ttl_s=config.ttl_s,
            max_retries=config.max_retries,
            uid_base=config.uid_base,
            allow_no_memory_limit=config.allow_no_memory_limit,
        )

    # --- sizing ---------------------------------------------------------------------
    @property
    def warm_target(self) -> int:
        """Idle sandboxes to keep ready: claim rate x p95 time-to-ready x safety, clamped."""
        now = time.monotonic()
        window_s = 5.0
        recent = sum(1 for t in self._claim_times if now - t <= window_s)
        rate = recent / window_s
        ready_p95 = _percentile(list(self._ready_s), 0.95) if self._ready_s else 0.1
        wanted = math.ceil(rate * ready_p95 * self.safety)
        return max(self.min_warm, min(self.max_warm, wanted))

    def _total(self) -> int:
        return len(self._idle) + self._num_busy + self._num_starting

    def _start_one(self) -> ForkServerSandbox | None:
        """Start a sandbox (caller counted it in ``_num_starting``); None if it failed."""
        try:
            sandbox = ForkServerSandbox(self.backend, self.limits, self._uids)
        except (SandboxError, OSError, RuntimeError) as err:
            self._counts["start_failures"] += 1
            logger.warning("sandbox failed to start: %s", err)
            return None
        self._counts["started"] += 1
        self._ready_s.append(sandbox.ready_s)
        if sandbox.lease:
            self._used_uids.add(sandbox.lease.uid)
        return sandbox

    def _request_start_locked(self) -> None:
        self._num_starting += 1
        self._spawner.submit(self._spawn_job)

    def _spawn_job(self) -> None:
        sandbox = self._start_one() if not self._closed else None
        with self._cond:
            self._num_starting -= 1
            if sandbox is not None and not self._closed:
                self._idle.append(sandbox)
                sandbox = None
            self._cond.notify_all()
        if sandbox is not None:
            sandbox.close()

    def _fill_loop(self) -> None:
        last_reap = time.monotonic()
        while True:
            with self._cond:
                if self._closed:
                    return
                deficit = self.warm_target - len(self._idle) - self._num_starting
                room = self.max_sandboxes - self._total()
                slots = MAX_CONCURRENT_STARTS - self._num_starting
                for _ in range(max(0, min(deficit, room, slots))):
                    self._request_start_locked()
                expired = self._expire_idle_locked()
                self._cond.wait(0.05)
            for sandbox in expired:
                sandbox.close()
            if time.monotonic() - last_reap > self.reaper_interval_s:
                self.reap_leaked()
                last_reap = time.monotonic()

    def _expire_idle_locked(self) -> list[ForkServerSandbox]:
        """Retire idle sandboxes past their TTL, and those beyond the recent peak need."""
        now, expired, keep = time.monotonic(), [], deque()
        recent_peak = max(
            (busy for t, busy in self._busy_history if now - t <= PEAK_WINDOW_S), default=0
        )
        surplus = len(self._idle) + self._num_busy - (recent_peak + self.warm_target)
        for sandbox in self._idle:
            if now - sandbox.started_at > self.ttl_s:
                expired.append(sandbox)
                self._counts["retired_ttl"] += 1
            elif surplus > 0:
                expired.append(sandbox)
                surplus -= 1
                self._counts["retired_surplus"] += 1
            else:
                keep.append(sandbox)
        self._idle = keep
        return expired

    # --- claim / release ------------------------------------------------------------
    def _claim(self, deadline: float | None = None) -> ForkServerSandbox:
        """An idle sandbox, waiting until ``deadline`` (``time.monotonic()``; default: the
        claim timeout from now) at most."""
        if deadline is None:
            deadline = time.monotonic() + self.claim_timeout_s
        with self._cond:
            if self._closed:
                raise SandboxError("sandbox pool is closed")
            if time.monotonic() >= deadline:  # an aexec that waited its claim timeout for a thread
                raise SandboxError(f"no sandbox free within {self.claim_timeout_s}s (backpressure)")
            self._counts["claims"] += 1
            self._claim_times.append(time.monotonic())
            if not self._idle:
                self._counts["buffer_misses"] += 1
                if self._total() < self.max_sandboxes:
                    self._request_start_locked()
            while not self._idle:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._closed:
                    raise SandboxError(
                        f"no sandbox free within {self.claim_timeout_s}s (backpressure)"
                    )
                self._cond.wait(remaining)
            self._num_busy += 1
            self._busy_history.append((time.monotonic(), self._num_busy))
            return self._idle.popleft()  # the longest idle: its next child is ready

    def _release(self, sandbox: ForkServerSandbox, quarantine: str | None = None) -> None:
        retire = quarantine or self._closed or not sandbox.alive or sandbox.dirty
        if not retire and (
            sandbox.num_execs >= self.max_execs_per_sandbox
            or time.monotonic() - sandbox.started_at > self.ttl_s
        ):
            self._counts["retired_ttl"] += 1
            retire = True
        if retire and (quarantine or sandbox.dirty):
            self._counts["quarantined"] += 1
            logger.warning("quarantined a sandbox: %s", quarantine or "left dirty by an exec")
        with self._cond:
            self._num_busy -= 1
            if not retire:
                self._idle.append(sandbox)
            self._cond.notify_all()
        if retire:
            sandbox.close()

    # --- exec -----------------------------------------------------------------------
    def exec(self, code: str | None = None, **kwargs: object) -> ExecResult:
        """Run a snippet (or ``command=[...]``) in a pooled sandbox; see ``Sandbox.exec``."""
        with trace.span("sandbox_exec", "sandbox"):
            return self._exec(code, kwargs, None)

    def _exec(self, code: str | None, kwargs: dict, claim_deadline: float | None) -> ExecResult:
        """``exec``; the first claim waits until ``claim_deadline`` at most (retries after
        an infrastructure failure claim with a timeout of their own)."""
        t0 = time.perf_counter()
        for attempt in range(self.max_retries + 1):
            sandbox = self._claim(claim_deadline if attempt == 0 else None)
            try:
                result = sandbox.exec(code, **kwargs)
            except SandboxError as err:
                self._counts["infra_failures"] += 1
                self._release(sandbox, quarantine=str(err))
                if attempt == self.max_retries:
                    raise
                self._counts["infra_retries"] += 1
                continue
            except BaseException:
                self._release(sandbox)
                raise
            self._release(sandbox)
            self._record(result, (time.perf_counter() - t0) * 1e3)
            return result
        raise AssertionError("unreachable")

    # --- workspaces -----------------------------------------------------------------
    def workspace(
        self, timeout_s: float | None = None, max_output_bytes: int | None = None
    ) -> Workspace:
        """A ``Workspace`` for one episode: a warm sandbox held until its ``close``, whose
        working dir persists across the episode's execs and is wiped at the end.
        ``timeout_s`` is its calls' default wall time (else the pool's)."""
        t0 = time.perf_counter()
        for attempt in range(self.max_retries + 1):
            sandbox = self._claim()
            if sandbox.alive:
                break
            self._counts["infra_failures"] += 1
            self._release(sandbox, quarantine="died while idle")
            if attempt == self.max_retries:
                raise SandboxError("no live sandbox for a workspace (all died while idle)")
            self._counts["infra_retries"] += 1
        with self._cond:
            self._workspaces.add(sandbox)
            self._counts["workspaces_opened"] += 1
            self._workspace_open_ms.append((time.perf_counter() - t0) * 1e3)
        return Workspace(
            sandbox,
            release=self._release_workspace,
            record=self._record,
            timeout_s=timeout_s or self.limits.timeout_s,
            max_output_bytes=max_output_bytes or self.limits.max_output_bytes,
        )

    def _release_workspace(self, sandbox: ForkServerSandbox, dirty: list[str]) -> None:
        """Back to the pool once wiped clean; quarantined when anything was left."""
        with self._cond:
            if sandbox not in self._workspaces:
                return  # the pool closed first and killed it
            self._workspaces.discard(sandbox)
            self._counts["workspaces_closed"] += 1
            self._counts["workspace_wipe_failures"] += bool(dirty)
        self._release(sandbox, quarantine="workspace: " + "; ".join(dirty) if dirty else None)

    async def aexec(self, code: str | None = None, **kwargs: object) -> ExecResult:
        """``exec`` without blocking the event loop. The claim timeout counts from this
        call, so time queued for an exec thread in a burst counts against it: the wait is
        bounded by the claim timeout, then the exec by its own timeout."""
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + self.claim_timeout_s
        return await loop.run_in_executor(
            self._executor, functools.partial(self._exec, code, kwargs, deadline)
        )

    def _record(self, result: ExecResult, latency_ms: float) -> None:
        self._latency_ms.append(latency_ms)
        self._counts["execs"] += 1
        if result.reason in KILL_REASONS:
            self._counts[f"kills_{result.reason}"] += 1
        if result.leftover_killed:
            self._counts["kills_leftover"] += 1

    # --- health ---------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        """``sandbox/*`` metrics: latency percentiles, buffer misses, kills by reason ..."""
        latencies = list(self._latency_ms)
        claims = self._counts["claims"]
        out = {
            "sandbox/exec_p50_ms": _percentile(latencies, 0.50),
            "sandbox/exec_p99_ms": _percentile(latencies, 0.99),
            "sandbox/ready_p95_ms": _percentile(list(self._ready_s), 0.95) * 1e3,
            "sandbox/miss_rate": self._counts["buffer_misses"] / claims if claims else 0.0,
            "sandbox/warm_target": float(self.warm_target),
            "sandbox/warm": float(len(self._idle)),
            "sandbox/busy": float(self._num_busy),
            "sandbox/workspaces_open": float(len(self._workspaces)),
            "sandbox/workspace_open_p50_ms": _percentile(list(self._workspace_open_ms), 0.5),
        }
        names = ["claims", "buffer_misses", "execs", "started", "start_failures", "quarantined"]
        names += ["infra_failures", "infra_retries", "retired_ttl", "retired_surplus", "reaped"]
        names += ["backend_fallbacks", "workspaces_opened", "workspaces_closed"]
        names += ["workspace_wipe_failures"]
        names += [f"kills_{r}" for r in (*KILL_REASONS, "leftover")]
        out.update({f"sandbox/{n}": float(self._counts[n]) for n in names})
        return out

    def _uid_is_free(self, uid: int) -> bool:
        try:
            self._uids.acquire_specific(uid).release()
        except BlockingIOError:
            return False
        return True

    def reap_leaked(self) -> int:
        """Kill processes of sandbox uids this pool used that no live sandbox holds."""
        with self._cond:
            held = {s.lease.uid for s in self._idle if s.lease}
        candidates = self._used_uids - held
        if not candidates:
            return 0
        killed = 0
        for uid in uid_processes(candidates):
            try:
                lease = self._uids.acquire_specific(uid)
            except BlockingIOError:
                continue  # a live sandbox (busy, or another pool's) holds it
            try:
                killed += kill_uid_processes(uid)
            finally:
                lease.release()
        if killed:
            self._counts["reaped"] += killed
            logger.warning("reaper killed %d leaked sandbox processes", killed)
        return killed

    def close(self) -> None:
        """Kill every sandbox; afterwards no process of this pool is left."""
        with self._cond:
            self._closed = True
            idle, self._idle = list(self._idle), deque()
            self._cond.notify_all()
        self._filler.join(timeout=30)
        self._spawner.shutdown(wait=True)
        with self._cond:
            idle += list(self._idle)
            self._idle.clear()
            # Workspaces still open lose their sandbox: killing it wipes their files.
            idle += list(self._workspaces)
            self._workspaces.clear()
        for sandbox in idle:
            sandbox.close()
        self._executor.shutdown(wait=True)
        self.reap_leaked()
        remove_stale_cgroups(self._uid_is_free)

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
