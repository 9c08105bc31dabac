"""The fork server that lives inside each sandbox (standard library only).

It is started once per sandbox (inside ``bwrap`` or as a plain process), announces itself
ready, then serves exec requests one at a time over length-prefixed JSON frames on two
file descriptors. Per request it forks a fresh child from its own pristine state, so no
state leaks between execs: the child starts a new session, sets rlimits, drops to the
sandbox's unprivileged uid, writes the request's files into a fresh work dir and runs a
Python snippet (in the forked interpreter: no interpreter start-up) or execs a command.
The server enforces the wall-clock timeout and the output cap, then kills every process
left under the sandbox uid (``kill(-1)`` from that uid, repeated until none is left),
reaps them as a child subreaper and wipes the work dir before it answers.

This file is also imported by the host for the frame codec (``read_frame``/``write_frame``).
"""

from __future__ import annotations

import base64
import ctypes
import json
import os
import resource
import select
import shutil
import signal
import struct
import sys
import time
import traceback

_HEADER = struct.Struct("!I")
MAX_FRAME_BYTES = 256 * 1024 * 1024
PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36


def write_frame(fd: int, message: dict) -> None:
    """Write one length-prefixed JSON frame to a blocking fd."""
    body = json.dumps(message, separators=(",", ":")).encode()
    data = memoryview(_HEADER.pack(len(body)) + body)
    while data:
        written = os.write(fd, data)
        data = data[written:]


def _read_exact(fd: int, size: int) -> bytes:
    chunks = []
    while size:
        chunk = os.read(fd, min(size, 1 << 20))
        if not chunk:
            raise EOFError("channel closed")
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def read_frame(fd: int) -> dict:
    """Read one frame written by ``write_frame`` from a blocking fd."""
    (size,) = _HEADER.unpack(_read_exact(fd, _HEADER.size))
    if size > MAX_FRAME_BYTES:
        raise ValueError(f"frame of {size} bytes is over the limit")
    return json.loads(_read_exact(fd, size))


def _prctl(option: int, value: int) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)
    except (OSError, AttributeError):
        pass


class Server:
    """One sandbox's exec loop; ``config`` is the first frame the host sends."""

    def __init__(self, in_fd: int, out_fd: int, config: dict) -> None:
        self.in_fd, self.out_fd = in_fd, out_fd
        self.uid: int | None = config.get("uid")
        self.gid: int | None = config.get("gid")
        self.work_root: str = config["work_root"]
        self.limits: dict = config["limits"]
        self.env: dict = config["env"]
        self.scan_proc: bool = config.get("pid_namespace", False)
        self.pids_current_file: str | None = config.get("pids_current_file")
        self.scratch_dirs: list[str] = config.get("scratch_dirs", [])
        self.seq = 0
        os.makedirs(self.work_root, mode=0o711, exist_ok=True)

    # --- child side -----------------------------------------------------------------
    def _child(self, req: dict, workdir: str, fds: tuple[int, int, int]) -> None:
        """Runs in the forked child; never returns."""
        try:
            os.setsid()
            try:
                with open("/proc/self/oom_score_adj", "w") as f:
                    f.write("1000")
            except OSError:
                pass
            for target, fd in enumerate(fds):
                os.dup2(fd, target)
            _close_fds_from(3)
            self._set_limits(req)
            if self.uid is not None:
                os.setgroups([])
                os.setgid(self.gid)
                os.setuid(self.uid)
            os.chdir(workdir)
            env = dict(self.env, HOME=workdir, TMPDIR=workdir, PWD=workdir)
            os.environ.clear()
            os.environ.update(env)
            signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        except BaseException as err:  # noqa: BLE001 - report any set-up failure
            os.write(2, f"sandbox setup failed: {err!r}\n".encode())
            os._exit(126)
        try:
            if req.get("argv"):
                self._exec_command(req["argv"], env)
            self._run_python(req.get("code", ""))
        finally:
            os._exit(126)

    def _set_limits(self, req: dict) -> None:
        lim = self.limits
        cpu_s = max(1, int(req.get("cpu_s") or lim["cpu_s"]))
        pairs = [
            (resource.RLIMIT_CPU, (cpu_s, cpu_s + 1)),
            (resource.RLIMIT_AS, (lim["address_space_bytes"],) * 2),
            (resource.RLIMIT_NPROC, (lim["processes"],) * 2),
            (resource.RLIMIT_FSIZE, (lim["file_size_bytes"],) * 2),
            (resource.RLIMIT_NOFILE, (lim["open_files"],) * 2),
            (resource.RLIMIT_CORE, (0, 0)),
        ]
        for which, value in pairs:
            resource.setrlimit(which, value)

    def _exec_command(self, argv: list[str], env: dict) -> None:
        try:
            os.execvpe(argv[0], argv, env)
        except OSError as err:
            os.write(2, f"exec failed: {argv[0]}: {err.strerror}\n".encode())
            os._exit(127)

    def _run_python(self, code: str) -> None:
        sys.argv = ["<snippet>"]
        status = 0
        try:
            exec(compile(code, "<snippet>", "exec"), {"__name__": "__main__"})
        except SystemExit as err:
            status = err.code if isinstance(err.code, int) else (0 if err.code is None else 1)
            if err.code is not None and not isinstance(err.code, int):
                print(err.code, file=sys.stderr)
        except BaseException:  # noqa: BLE001 - the snippet's own error
            traceback.print_exc()
            status = 1
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except BaseException:  # noqa: BLE001
            pass
        os._exit(status & 0xFF)

    # --- server side ----------------------------------------------------------------
    def _prepare_workdir(self, req: dict) -> str:
        self.seq += 1
        workdir = os.path.join(self.work_root, str(self.seq))
        os.mkdir(workdir, 0o700)
        for name, content in (req.get("files") or {}).items():
            path = os.path.normpath(os.path.join(workdir, name))
            if not path.startswith(workdir + os.sep):
                raise ValueError(f"file name {name!r} leaves the work dir")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(base64.b64decode(content))
        if self.uid is not None:
            for root, dirs, files in os.walk(workdir):
                for entry in [root] + [os.path.join(root, n) for n in dirs + files]:
                    os.chown(entry, self.uid, self.gid)
        return workdir

    def handle(self, req: dict) -> dict:
        t0 = time.perf_counter()
        workdir = self._prepare_workdir(req)
        stdin_r, stdin_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            self._child(req, workdir, (stdin_r, out_w, err_w))
        t_forked = time.perf_counter()
        for fd in (stdin_r, out_w, err_w):
            os.close(fd)
        result = self._supervise(pid, req, stdin_w, out_r, err_r)
        t_ran = time.perf_counter()
        result["leftover_killed"] = result.pop("killed_early", 0) + self._kill_leftovers()
        shutil.rmtree(workdir, ignore_errors=True)
        result["dirty"] = self._dirty(workdir)
        t_done = time.perf_counter()
        result["timings_ms"] = {
            "setup_ms": (t_forked - t0) * 1e3,
            "run_ms": (t_ran - t_forked) * 1e3,
            "cleanup_ms": (t_done - t_ran) * 1e3,
        }
        return result

    def _supervise(self, pid: int, req: dict, stdin_w: int, out_r: int, err_r: int) -> dict:
        deadline = time.monotonic() + float(req["timeout_s"])
        cap = int(req["max_output_bytes"])
        stdin_data = memoryview(base64.b64decode(req.get("stdin") or ""))
        if not stdin_data:
            os.close(stdin_w)
            stdin_w = -1
        else:
            os.set_blocking(stdin_w, False)
        pidfd = os.pidfd_open(pid)
        out, err = bytearray(), bytearray()
        buffers = {out_r: out, err_r: err}
        reason, status, killed_early = None, None, 0
        poller = select.poll()
        for fd in (out_r, err_r, pidfd):
            poller.register(fd, select.POLLIN)
        if stdin_w >= 0:
            poller.register(stdin_w, select.POLLOUT)
        open_fds = {out_r, err_r}
        while status is None or open_fds:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                reason = reason or "timeout"
                break
            for fd, _event in poller.poll(remaining * 1e3):
                if fd == pidfd:
                    _, status = os.waitpid(pid, 0)
                    poller.unregister(pidfd)
                    # Background children may hold the pipes open: kill them now.
                    killed_early += self._kill_leftovers()
                elif fd == stdin_w:
                    try:
                        written = os.write(stdin_w, stdin_data[:65536])
                        stdin_data = stdin_data[written:]
                    except (BrokenPipeError, BlockingIOError):
                        stdin_data = stdin_data[:0]
                    if not stdin_data:
                        poller.unregister(stdin_w)
                        os.close(stdin_w)
                        stdin_w = -1
                else:
                    chunk = os.read(fd, 65536)
                    if not chunk:
                        poller.unregister(fd)
                        open_fds.discard(fd)
                        continue
                    buffers[fd] += chunk
                    if len(out) + len(err) > cap:
                        reason = "output_cap"
            if reason == "output_cap":
                break
        if status is None:
            _kill_quietly(pid)
            _, status = os.waitpid(pid, 0)
        for fd in (stdin_w, out_r, err_r, pidfd):
            if fd >= 0:
                os.close(fd)
        result = self._describe(status, reason, bytes(out), bytes(err), cap)
        result["killed_early"] = killed_early
        return result

    @staticmethod
    def _describe(status: int, reason: str | None, out: bytes, err: bytes, cap: int) -> dict:
        exit_code = os.waitstatus_to_exitcode(status)
        sig = -exit_code if exit_code < 0 else None
        if reason is None:
            if sig == signal.SIGXCPU:
                reason = "cpu_limit"
            elif sig == signal.SIGXFSZ:
                reason = "file_size_limit"
            elif sig is not None:
                reason = "signal"
            else:
                reason = "exit"
        truncated = len(out) + len(err) > cap
        out = out[:cap]
        err = err[: max(0, cap - len(out))]
        return {
            "exit_code": exit_code if sig is None else None,
            "signal": sig,
            "reason": reason,
            "truncated": truncated,
            "stdout": base64.b64encode(out).decode(),
            "stderr": base64.b64encode(err).decode(),
        }

    def _kill_leftovers(self) -> int:
        """Kill every process of the sandbox uid; returns how many kill rounds it took.

        ``kill(-1)`` from the sandbox uid reaches exactly that uid's processes (in the pid
        namespace, or on the host for the process backend), however they re-grouped.
        """
        if self.uid is None:
            return 0
        rounds = 0
        self._reap()
        while self._uid_processes():
            rounds += 1
            if rounds > 200:
                raise RuntimeError("sandbox processes survive repeated SIGKILL")
            reaper = os.fork()
            if reaper == 0:
                try:
                    os.setgid(self.gid)
                    os.setuid(self.uid)
                    os.kill(-1, signal.SIGKILL)
                finally:
                    os._exit(0)
            while os.waitpid(-1, 0)[0] != reaper:
                pass  # reaps the killed orphans too (we are their subreaper)
            self._reap()
        return rounds

    def _uid_processes(self) -> list[int]:
        """Live (non-zombie) processes of the sandbox uid."""
        if self.pids_current_file:
            try:
                with open(self.pids_current_file) as f:
                    if int(f.read()) <= 1:  # only this server is left in the cgroup
                        return []
            except (OSError, ValueError):
                pass
        found = []
        for name in os.listdir("/proc"):
            if name.isdigit():
                try:
                    if os.stat(f"/proc/{name}").st_uid == self.uid and not _zombie(name):
                        found.append(int(name))
                except OSError:
                    pass
        return found

    @staticmethod
    def _reap() -> None:
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return

    def _dirty(self, workdir: str) -> list[str]:
        """What an exec left behind that the server could not clean."""
        problems = []
        if os.path.exists(workdir):
            problems.append("work dir not removed")
        for scratch in self.scratch_dirs:
            for entry in _owned_entries(scratch, self.uid):
                _remove(entry)
                if os.path.lexists(entry):
                    problems.append(f"could not remove {entry}")
        for kind in ("shm", "msg", "sem"):
            try:
                with open(f"/proc/sysvipc/{kind}") as f:
                    if len(f.read().splitlines()) > 1 and self.scan_proc:
                        problems.append(f"sysv ipc {kind} objects left")
            except OSError:
                pass
        if self._uid_processes():
            problems.append("processes left")
        return problems

    def serve(self) -> None:
        while True:
            try:
                req = read_frame(self.in_fd)
            except EOFError:
                return
            if req.get("op") == "ping":
                write_frame(self.out_fd, {"op": "pong"})
                continue
            try:
                result = self.handle(req)
            except Exception as err:  # noqa: BLE001 - reported to the host as infra error
                result = {"reason": "sandbox_error", "error": repr(err)}
            write_frame(self.out_fd, result)


def _kill_quietly(pid: int) -> None:
    for kill in (os.killpg, os.kill):
        try:
            kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _zombie(pid: str) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return True


def _close_fds_from(low: int) -> None:
    for name in os.listdir("/proc/self/fd") if os.path.isdir("/proc/self/fd") else []:
        if int(name) >= low:
            try:
                os.close(int(name))
            except OSError:
                pass


def _remove(path: str) -> None:
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.unlink(path)
    except OSError:
        pass


def _owned_entries(directory: str, uid: int | None) -> list[str]:
    found = []
    try:
        names = os.listdir(directory)
    except OSError:
        return found
    for name in names:
        path = os.path.join(directory, name)
        try:
            if os.lstat(path).st_uid == uid:
                found.append(path)
        except OSError:
            pass
    return found


def main() -> None:
    # Move the protocol channel off fds 0/1 so the exec child's stdio is clean.
    in_fd, out_fd = os.dup(0), os.dup(1)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1):
        os.dup2(devnull, fd)
    os.close(devnull)
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    config = read_frame(in_fd)
    server = Server(in_fd, out_fd, config)
    write_frame(out_fd, {"op": "ready", "pid": os.getpid()})
    server.serve()


if __name__ == "__main__":
    main()
