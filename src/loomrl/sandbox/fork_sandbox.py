"""``ForkServerSandbox``: the host side of one sandbox (either backend).

It launches the backend's fork server (through a tiny ``sh`` that first joins the
sandbox's cgroups, when there are any), sends the server its config, waits for it to say
it is ready, then turns each ``exec`` into one request frame and one answer frame. Any
failure of the channel (EOF, garbage, no answer well past the exec's own timeout) raises
``SandboxError`` and leaves the sandbox dead: it is infrastructure, never the code's fault.
"""

from __future__ import annotations

import base64
import logging
import os
import select
import signal
import subprocess
import tempfile
import threading
import time

import psutil

from loomrl.sandbox import backends, forkserver_cleanup, forkserver_io
from loomrl.sandbox.base import ExecResult, Sandbox, SandboxError, SandboxLimits
from loomrl.sandbox.cgroups import CgroupLimits, cgroups_writable
from loomrl.sandbox.uids import UidAllocator, UidLease

logger = logging.getLogger(__name__)

READY_TIMEOUT_S = 30.0
ANSWER_GRACE_S = 10.0  # how long past an exec's timeout the server may take to answer
CLOSE_TIMEOUT_S = 10.0
WORK_DIR_PREFIX = "loomrl-sandbox-"  # process backend: <prefix><host pid>-<random> in TMPDIR


def _b64(data: str | bytes) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


def _read_frame_until(fd: int, deadline: float) -> dict:
    remaining = deadline - time.monotonic()
    ready, _, _ = select.select([fd], [], [], max(0.0, remaining))
    if not ready:
        raise TimeoutError("sandbox server did not answer in time")
    return forkserver_io.read_frame(fd)


class ForkServerSandbox(Sandbox):
    """One sandbox: a fork server in ``bwrap`` or a plain process, under a dedicated uid."""

    # the server's stderr, for the message when it fails (None until the server starts)
    _stderr_file = None

    def __init__(
        self,
        backend: str = "auto",
        limits: SandboxLimits | None = None,
        uids: UidAllocator | None = None,
        use_cgroups: bool = True,
    ) -> None:
        self.backend = backends.resolve_backend(backend)
        self.limits = limits or SandboxLimits()
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._dead = False
        self.num_execs = 0
        self.started_at = time.monotonic()
        self.lease: UidLease | None = None
        self.cgroup: CgroupLimits | None = None
        self._host_work_dir: str | None = None
        try:
            self._start(uids, use_cgroups)
        except BaseException:
            self.close()
            raise
        self.ready_s = time.monotonic() - self.started_at

    # --- start-up -------------------------------------------------------------------
    def _start(self, uids: UidAllocator | None, use_cgroups: bool) -> None:
        if os.geteuid() == 0:
            self.lease = (uids or UidAllocator()).acquire()
        if use_cgroups and self.lease and cgroups_writable():
            self.cgroup = CgroupLimits.create(
                f"sb-{self.lease.uid}",
                memory_bytes=(self.limits.memory_mb + 128) << 20,
                max_pids=self.limits.processes + 16,
                tcp_bytes=self.limits.tcp_buffer_mb << 20,
            )
        elif use_cgroups:
            logger.warning("sandbox runs without a memory cgroup (only RLIMIT_AS bounds memory)")
        spec = self._launch_spec()
        self._stderr_file = tempfile.TemporaryFile()
        try:
            self._proc = subprocess.Popen(
                spec.argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=self._stderr_file,
                pass_fds=spec.pass_fds,
                start_new_session=True,
                env=dict(backends.CHILD_ENV),
            )
        finally:
            for fd in spec.pass_fds:
                os.close(fd)
        self._await_ready(spec.server_config)

    def _launch_spec(self) -> backends.LaunchSpec:
        """The backend's launch spec, with the cgroup files the exec children join."""
        server_config = {
            "uid": self.lease.uid if self.lease else None,
            "gid": self.lease.gid if self.lease else None,
            "limits": self.limits.for_server(),
            "env": backends.CHILD_ENV,
            "cleanup_s": self.limits.cleanup_s,
        }
        if self.backend == "bwrap":
            spec = backends.bwrap_launch(server_config, tmpfs_bytes=self.limits.tmpfs_mb << 20)
        else:
            # The host pid in the name lets a later pool remove it if this process is
            # killed before it can (``sweep_stale_work_dirs``).
            self._host_work_dir = tempfile.mkdtemp(prefix=f"{WORK_DIR_PREFIX}{os.getpid()}-")
            os.chmod(self._host_work_dir, 0o711)
            spec = backends.process_launch(server_config, os.path.join(self._host_work_dir, "w"))
        if self.cgroup:
            # The server and its zygote stay outside the cgroups (the code cannot OOM-kill
            # or starve them); each exec child joins them itself through these fds.
            procs = [os.open(f, os.O_WRONLY | os.O_CLOEXEC) for f in self.cgroup.procs_files]
            current = os.open(self.cgroup.pids_current_file, os.O_RDONLY | os.O_CLOEXEC)
            spec.pass_fds += [*procs, current]
            spec.server_config["cgroup_procs_fds"] = procs
            spec.server_config["pids_current_fd"] = current
        return spec

    def _await_ready(self, server_config: dict) -> None:
        forkserver_io.write_frame(self._proc.stdin.fileno(), server_config)
        try:
            hello = _read_frame_until(
                self._proc.stdout.fileno(), time.monotonic() + READY_TIMEOUT_S
            )
        except (EOFError, TimeoutError, ValueError) as err:
            raise SandboxError(
                f"{self.backend} sandbox failed to start: {err}; {self._stderr_tail()}"
            ) from None
        if hello.get("op") != "ready":
            raise SandboxError(f"{self.backend} sandbox sent {hello!r} instead of ready")

    def _stderr_tail(self) -> str:
        try:
            self._stderr_file.seek(0)
            return self._stderr_file.read()[-2000:].decode(errors="replace").strip()
        except (OSError, AttributeError, ValueError):
            return ""

    # --- exec -----------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return not self._dead and self._proc is not None and self._proc.poll() is None

    def exec(
        self,
        code: str | None = None,
        *,
        command: list[str] | None = None,
        files: dict[str, str | bytes] | None = None,
        stdin: str | bytes = b"",
        timeout_s: float | None = None,
        max_output_bytes: int | None = None,
        workspace: bool = False,
    ) -> ExecResult:
        """``Sandbox.exec``; with ``workspace`` the exec runs in the sandbox's workspace dir,
        which outlives it (see ``wipe_workspace``), and takes no ``files``."""
        if (code is None) == (command is None):
            raise ValueError("exec needs exactly one of code (a Python snippet) or command (argv)")
        if command is not None and (not command or not all(isinstance(a, str) for a in command)):
            raise ValueError(f"command must be a non-empty list of strings, got {command!r}")
        timeout_s = float(timeout_s if timeout_s is not None else self.limits.timeout_s)
        request = {
            "code": code,
            "argv": command,
            "files": {name: _b64(content) for name, content in (files or {}).items()},
            "stdin": _b64(stdin),
            "timeout_s": timeout_s,
            "max_output_bytes": int(max_output_bytes or self.limits.max_output_bytes),
            "workspace": workspace,
        }
        with self._lock:
            if not self.alive:
                raise SandboxError("sandbox is not running")
            return self._roundtrip(request, timeout_s)

    def _roundtrip(self, request: dict, timeout_s: float) -> ExecResult:
        t0 = time.perf_counter()
        oom_before = self.cgroup.oom_kills() if self.cgroup else 0
        try:
            forkserver_io.write_frame(self._proc.stdin.fileno(), request)
        except OSError as err:  # the request never reached a server: infrastructure
            self._dead = True
            raise SandboxError(f"sandbox channel failed: {err!r}; {self._stderr_tail()}") from None
        try:
            answer = _read_frame_until(
                self._proc.stdout.fileno(), time.monotonic() + timeout_s + ANSWER_GRACE_S
            )
        except (OSError, EOFError, TimeoutError, ValueError) as err:
            # The server cannot be killed or hung by its code on purpose, so losing it while
            # the code runs is the code's doing: a result, never an infrastructure retry.
            self._dead = True
            logger.warning("sandbox lost during an exec: %r; %s", err, self._stderr_tail())
            return _lost_result(f"sandbox lost during the exec: {err!r}", t0)
        self.num_execs += 1
        if answer.get("reason") == "sandbox_error":
            self._dead = True
            raise SandboxError(f"sandbox server error: {answer.get('error')}")
        if answer.get("dirty"):
            self._dead = True  # served this exec, but must not serve another
            logger.warning("sandbox left dirty after exec: %s", answer["dirty"])
        reason = answer["reason"]
        if reason == "signal" and answer["signal"] == signal.SIGKILL and self.cgroup:
            if self.cgroup.oom_kills() > oom_before:
                reason = "oom"
        timings = dict(answer.get("timings_ms", {}))
        timings["total_ms"] = (time.perf_counter() - t0) * 1e3
        return ExecResult(
            stdout=base64.b64decode(answer["stdout"]).decode(errors="replace"),
            stderr=base64.b64decode(answer["stderr"]).decode(errors="replace"),
            exit_code=answer["exit_code"],
            signal=answer["signal"],
            reason=reason,
            truncated=answer["truncated"],
            leftover_killed=answer.get("leftover_killed", 0),
            timings_ms=timings,
        )

    def wipe_workspace(self) -> list[str]:
        """Remove the workspace dir and every process of the uid; returns what was left
        (empty when clean). Anything left, or a failed channel, kills the sandbox."""
        with self._lock:
            if not self.alive:
                return ["sandbox is not running"]
            deadline = time.monotonic() + self.limits.cleanup_s + ANSWER_GRACE_S
            try:
                forkserver_io.write_frame(self._proc.stdin.fileno(), {"op": "wipe_workspace"})
                answer = _read_frame_until(self._proc.stdout.fileno(), deadline)
            except (OSError, EOFError, TimeoutError, ValueError) as err:
                self._dead = True
                return [f"sandbox channel failed during the wipe: {err!r}"]
            dirty = list(answer.get("dirty", ["garbled answer to the wipe"]))
            if dirty:
                self._dead = True
            return dirty

    @property
    def dirty(self) -> bool:
        """True once the sandbox must not serve again (failed channel or unclean exec)."""
        return self._dead

    # --- shutdown -------------------------------------------------------------------
    def close(self) -> None:
        self._dead = True
        proc = self._proc
        if proc is not None:
            for stream in (proc.stdin, proc.stdout):
                try:
                    stream.close()
                except OSError:
                    pass
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                proc.wait(timeout=CLOSE_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                logger.error("sandbox server %d did not die within %ss", proc.pid, CLOSE_TIMEOUT_S)
            self._proc = None
        if self.lease is not None:
            leftovers = kill_uid_processes(self.lease.uid)
            if leftovers:
                logger.warning(
                    "killed %d leftover processes of sandbox uid %d", leftovers, self.lease.uid
                )
        if self.cgroup is not None:
            self.cgroup.remove()
            self.cgroup = None
        if self.lease is not None:
            self.lease.release()
            self.lease = None
        if self._host_work_dir:
            # Iterative: code can leave thousands of nested dirs (no RecursionError here).
            if not forkserver_cleanup.remove_tree(self._host_work_dir, time.monotonic() + 60):
                logger.error("could not remove sandbox work dir %s", self._host_work_dir)
            self._host_work_dir = None
        if self._stderr_file is not None:
            self._stderr_file.close()


def sweep_stale_work_dirs() -> int:
    """Remove process-backend work dirs whose host process is gone (killed before it could
    remove them: a workspace's files would otherwise outlive its episode); returns how many."""
    removed = 0
    root = tempfile.gettempdir()
    try:
        names = [n for n in os.listdir(root) if n.startswith(WORK_DIR_PREFIX)]
    except OSError:
        return 0
    for name in names:
        pid, dash, _ = name[len(WORK_DIR_PREFIX) :].partition("-")
        if not (dash and pid.isdigit()) or psutil.pid_exists(int(pid)):
            continue
        if forkserver_cleanup.remove_tree(os.path.join(root, name), time.monotonic() + 10):
            removed += 1
    return removed


def _lost_result(message: str, t0: float) -> ExecResult:
    return ExecResult(
        stdout="",
        stderr=message + "\n",
        exit_code=None,
        signal=None,
        reason="sandbox_lost",
        timings_ms={"total_ms": (time.perf_counter() - t0) * 1e3},
    )


def uid_processes(uids: set[int] | range) -> dict[int, list[int]]:
    """Host pids per (effective) uid, for the given uids (one pass over the process table)."""
    found: dict[int, list[int]] = {}
    for proc in psutil.process_iter(["uids"]):
        uid_info = proc.info["uids"]
        if uid_info is not None and uid_info.effective in uids:
            found.setdefault(uid_info.effective, []).append(proc.pid)
    return found


def kill_uid_processes(uid: int, rounds: int = 50) -> int:
    """SIGKILL every host process of ``uid`` until none is left; returns how many were killed.

    A killed process can still look alive on the next round (a loaded machine takes a while
    to deliver SIGKILL), so it is signalled again but counted once.
    """
    killed: set[int] = set()
    for _ in range(rounds):
        pids = uid_processes({uid}).get(uid, [])
        live = [p for p in pids if not _is_zombie(p)]
        if not live:
            return len(killed)
        for pid in live:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            except ProcessLookupError:
                pass
        time.sleep(0.01)
    logger.error("processes of sandbox uid %d survive %d kill rounds", uid, rounds)
    return len(killed)


def _is_zombie(pid: int) -> bool:
    """Dead (a zombie) or gone."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True
