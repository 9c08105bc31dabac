"""The fork server that lives inside each sandbox (standard library only).

It is started once per sandbox (inside ``bwrap`` or as a plain process), announces itself
ready, then serves exec requests one at a time over length-prefixed JSON frames on two
file descriptors. Before it reads any request it forks a *zygote*, a copy of itself that
never receives request data: each exec is forked from the zygote (through a short-lived
middle process, so the exec is re-parented to the server, its subreaper), and reads its
own request from a pipe. No exec can therefore find an earlier exec's code, stdin or
output in its memory. The exec joins the sandbox's cgroups itself (the server and the
zygote stay outside them, out of reach of the code's OOM kills), sets rlimits, drops to
the sandbox's unprivileged uid and runs a Python snippet (in the forked interpreter: no
interpreter start-up) or execs a command. The server enforces the wall-clock timeout and
the output cap, kills every process left under the sandbox uid as root (the code cannot
stop a root killer), and removes the work dir iteratively within a deadline; whatever it
cannot clean in time marks the sandbox dirty, so the host replaces it.

The frame codec (``read_frame``/``write_frame``) that the host shares lives in
``forkserver_io.py``.
"""

from __future__ import annotations

import base64
import ctypes
import os
import resource
import signal
import socket
import struct
import sys
import time
import traceback

if __package__:
    from loomrl.sandbox import forkserver_cleanup as cleanup
    from loomrl.sandbox.forkserver_io import (
        Pump,
        describe,
        read_exact,
        read_frame,
        readable,
        write_frame,
    )
else:  # run as a script (inside the sandbox): its helper modules sit next to this file
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import forkserver_cleanup as cleanup
    from forkserver_io import Pump, describe, read_exact, read_frame, readable, write_frame

    del sys.path[0]  # the exec's code must not import from here

_PID = struct.Struct("!i")
PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
KILL_DEADLINE_S = 2.0  # leftover processes must be gone within this
REMOVE_DEADLINE_S = 1.0  # default budget for removing an exec's files
WAIT_DEADLINE_S = 2.0  # a SIGKILLed exec must be reaped within this


def _prctl(option: int, value: int) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)
    except (OSError, AttributeError):
        pass


class Zygote:
    """Forks exec children from a state that has never seen a request.

    The server sends it one end of a fresh socket pair; nothing else crosses. The zygote
    forks a child holding that end and answers with the child's pid once the child has
    been re-parented to the server. The child then waits for its stdio and its request on
    that socket, so the server can fork the next child ahead of time, off the exec path.
    """

    def __init__(self, server: Server) -> None:
        self.server = server
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.pid = os.fork()
        if self.pid == 0:
            self.sock.close()
            self._serve(theirs)
        theirs.close()

    def request(self) -> socket.socket:
        """Ask for one waiting exec child; returns the socket to hand it work later."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            socket.send_fds(self.sock, [b"f"], [theirs.fileno()])
        except OSError:
            ours.close()
            raise
        finally:
            theirs.close()
        return ours

    def collect(self) -> int:
        """The pid of the child asked for by the oldest pending ``request``."""
        answer = self.sock.recv(_PID.size)
        if len(answer) != _PID.size:
            raise RuntimeError("zygote is gone")
        return _PID.unpack(answer)[0]

    def _serve(self, sock: socket.socket) -> None:
        """The zygote's loop (in the zygote process); never returns."""
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # not inherited: die with the server
        for fd in (self.server.in_fd, self.server.out_fd):
            os.close(fd)
        try:
            while True:
                msg, fds, _, _ = socket.recv_fds(sock, 16, 1)
                if not msg or len(fds) != 1:
                    break
                sock.send(_PID.pack(self._fork_child(fds)))
                for fd in fds:
                    os.close(fd)
        finally:
            os._exit(0)

    def _fork_child(self, fds: list[int]) -> int:
        """Fork a child whose parent is the server: ``clone(CLONE_PARENT)`` where it works
        (one fork), else a short-lived middle process (two forks)."""
        pid = _clone_parent()
        if pid == 0:
            self.server.child(fds)
        if pid > 0:
            return pid
        report_r, report_w = os.pipe()
        middle = os.fork()
        if middle == 0:
            os.close(report_r)
            child = os.fork()
            if child == 0:
                os.close(report_w)
                self.server.child(fds)
            os.write(report_w, _PID.pack(child))
            os._exit(0)
        os.close(report_w)
        data = read_exact(report_r, _PID.size)
        os.close(report_r)
        os.waitpid(middle, 0)  # after this the child's parent is the server (subreaper)
        return _PID.unpack(data)[0]


_CLONE_PARENT = 0x00008000
_SYS_CLONE = {"x86_64": 56, "aarch64": 220}.get(os.uname().machine)


_syscall = None  # libc's syscall(), looked up once


def _clone_parent() -> int:
    """``clone(CLONE_PARENT | SIGCHLD)``: ``fork`` (with CPython's own before/after-fork
    steps, at-fork hooks included), except that the child is the server's. Returns the
    pid, 0 in the child, or -1 where raw clone is not supported here."""
    if _SYS_CLONE is None or os.uname().machine != "x86_64":
        return -1  # the argument order of raw clone differs by architecture
    global _syscall
    if _syscall is None:
        _syscall = ctypes.PyDLL(None, use_errno=True).syscall  # PyDLL: keeps the GIL held
        _syscall.restype = ctypes.c_long
    api = ctypes.pythonapi
    api.PyOS_BeforeFork()
    pid = _syscall(
        ctypes.c_long(_SYS_CLONE),
        ctypes.c_ulong(_CLONE_PARENT | signal.SIGCHLD),
        ctypes.c_void_p(0),
        ctypes.c_void_p(0),
        ctypes.c_void_p(0),
        ctypes.c_ulong(0),
    )
    if pid == 0:
        api.PyOS_AfterFork_Child()
    else:
        api.PyOS_AfterFork_Parent()
    return int(pid) if pid >= 0 else -1


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
        self.cgroup_fds: list[int] = config.get("cgroup_procs_fds", [])
        self.pids_current_fd: int | None = config.get("pids_current_fd")
        self.scratch_dirs: list[str] = config.get("scratch_dirs", [])
        self.remove_deadline_s = float(config.get("cleanup_s", REMOVE_DEADLINE_S))
        self.seq = 0
        os.makedirs(self.work_root, mode=0o711, exist_ok=True)
        self._next: socket.socket | None = None  # the channel to the next, waiting child
        self.zygote = Zygote(self)

    # --- child side (forked from the zygote) ------------------------------------------
    def child(self, fds: list[int]) -> None:
        """Runs in the exec child; never returns. Waits for its stdio and request first."""
        try:
            for fd in self.cgroup_fds:
                os.write(fd, b"0")  # join the sandbox's cgroups (the server stays out)
            os.setsid()
            with open("/proc/self/oom_score_adj", "w") as f:
                f.write("1000")
            chan = socket.socket(fileno=fds[0])
            msg, fds, _, _ = socket.recv_fds(chan, 1, 3)
            if not msg or len(fds) != 3:
                os._exit(0)  # the server went away (or retired this child) first
            req = read_frame(chan.fileno())
        except BaseException:  # noqa: BLE001 - nothing to report to: the exec never began
            os._exit(126)
        try:
            for target, fd in enumerate(fds[:3]):
                os.dup2(fd, target)
            _close_fds_from(3)
            self._set_limits(req)
            if self.uid is not None:
                os.setgroups([])
                os.setgid(self.gid)
                os.setuid(self.uid)
            workdir = req["workdir"]
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
            self._run_python(req.get("code") or "")
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
            (resource.RLIMIT_MSGQUEUE, (0, 0)),  # no POSIX message queue can outlive an exec
            (resource.RLIMIT_MEMLOCK, (0, 0)),
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

    def prespawn(self) -> None:
        """Ask for the next exec child now, off the exec path: it forks, joins the cgroups
        and waits for its request while the host reads the last answer."""
        if self._next is None:
            self._next = self.zygote.request()

    def _spawn(self, req: dict, workdir: str) -> tuple[int, tuple[int, int, int]]:
        """Hand a waiting child its stdio and request; returns its pid and our pipe ends."""
        self.prespawn()
        chan, self._next = self._next, None
        try:
            pid = self.zygote.collect()
        except (OSError, RuntimeError):
            chan.close()
            raise
        stdin_r, stdin_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        theirs = [stdin_r, out_w, err_w]
        own = {"code": req.get("code"), "argv": req.get("argv"), "workdir": workdir}
        own["cpu_s"] = req.get("cpu_s")
        try:
            socket.send_fds(chan, [b"r"], theirs)
            write_frame(chan.fileno(), own)
        except OSError as err:
            for fd in (stdin_w, out_r, err_r):
                os.close(fd)
            raise RuntimeError(f"exec child {pid} is gone: {err!r}") from None
        finally:
            for fd in theirs:
                os.close(fd)
            chan.close()
        return pid, (stdin_w, out_r, err_r)

    def handle(self, req: dict) -> dict:
        t0 = time.perf_counter()
        workdir = self._prepare_workdir(req)
        pid, (stdin_w, out_r, err_r) = self._spawn(req, workdir)
        t_forked = time.perf_counter()
        pump = Pump(req, stdin_w, out_r, err_r)
        status, reason, killed_early = self._supervise(pid, pump)
        t_ran = time.perf_counter()
        result = describe(status, reason, bytes(pump.out), bytes(pump.err), pump.cap)
        dirty: list[str] = []
        try:
            result["leftover_killed"] = killed_early + self._kill_leftovers(dirty)
            self._remove_files(workdir, dirty)
            self._clean_ipc(dirty)
        except Exception as err:  # noqa: BLE001 - cannot clean: the host replaces the sandbox
            dirty.append(f"clean-up failed: {err!r}")
        result["dirty"] = dirty
        t_done = time.perf_counter()
        result["timings_ms"] = {
            "setup_ms": (t_forked - t0) * 1e3,
            "run_ms": (t_ran - t_forked) * 1e3,
            "cleanup_ms": (t_done - t_ran) * 1e3,
        }
        return result

    def _supervise(self, pid: int, pump: Pump) -> tuple[int | None, str | None, int]:
        """Run the exec to its end (or its deadline); returns wait status, reason, kills."""
        pidfd = os.pidfd_open(pid)
        status, killed_early = None, 0
        try:
            while status is None or pump.open_fds:
                wait_fds = [pidfd] if status is None else []
                if not pump.step(wait_fds):
                    break
                if status is None and readable(pidfd):
                    status = os.waitpid(pid, 0)[1]
                    # Background children may hold the pipes open: kill them now.
                    killed_early += self._kill_leftovers([])
            if status is None:
                cleanup.kill_quietly(pid)
                status = cleanup.wait_exit(pid, pidfd, time.monotonic() + WAIT_DEADLINE_S)
        finally:
            os.close(pidfd)
            pump.close()
        return status, pump.reason, killed_early

    def _kill_leftovers(self, dirty: list[str]) -> int:
        """SIGKILL (as root) every process of the sandbox uid; returns the kill rounds.

        The killer never takes the sandbox uid, so nothing the code does (``kill(-1,
        SIGSTOP)``, re-grouping, forking) can stop it; it gives up after
        ``KILL_DEADLINE_S`` and reports the sandbox dirty instead of waiting on.
        """
        if self.uid is None:
            return 0
        deadline = time.monotonic() + KILL_DEADLINE_S
        rounds = 0
        try:
            while True:
                pids = self._uid_processes()
                if not pids:
                    return rounds
                if time.monotonic() > deadline:
                    dirty.append(f"{len(pids)} processes survive SIGKILL")
                    return rounds
                rounds += 1
                for pid in pids:
                    cleanup.kill_as_root(pid, self.uid)
                time.sleep(0.0005 * min(rounds, 20))
        finally:
            # Reap only now: until then the killed hold their RLIMIT_NPROC and pids.max
            # slots as zombies, so a fork bomb cannot refill them faster than we kill.
            cleanup.reap()  # the killed orphans are ours (we are their subreaper)

    def _uid_processes(self) -> list[int]:
        """Live (non-zombie) processes of the sandbox uid."""
        if self.pids_current_fd is not None:
            try:
                if int(os.pread(self.pids_current_fd, 32, 0)) == 0:
                    return []  # nothing is left in the sandbox's pids cgroup
            except (OSError, ValueError):
                pass
        found = []
        for name in os.listdir("/proc"):
            if name.isdigit():
                try:
                    if os.stat(f"/proc/{name}").st_uid == self.uid and not cleanup.is_zombie(name):
                        found.append(int(name))
                except OSError:
                    pass
        return found

    def _remove_files(self, workdir: str, dirty: list[str]) -> None:
        """Remove the work dir and the uid's files in scratch dirs, within the deadline."""
        deadline = time.monotonic() + self.remove_deadline_s
        if not cleanup.remove_tree(workdir, deadline):
            dirty.append("work dir not removed in time")
        for scratch in self.scratch_dirs:
            for entry in cleanup.owned_entries(scratch, self.uid):
                if not cleanup.remove_tree(entry, deadline):
                    dirty.append(f"could not remove {entry}")

    def _clean_ipc(self, dirty: list[str]) -> None:
        """Remove the exec's SysV IPC objects; any that stay make the sandbox dirty.

        In its own IPC namespace (bwrap) every object is the code's; on the host's
        (process backend) only those of the sandbox uid are. Without CAP_SYS_ADMIN (bwrap)
        removal is refused, and the sandbox is replaced instead.
        """
        owner = None if self.scan_proc else self.uid
        if owner is None and not self.scan_proc:
            return  # no dedicated uid on the host's namespace: nothing is ours to judge
        for kind in ("shm", "msg", "sem"):
            for ident in cleanup.sysv_objects(kind, owner):
                cleanup.ipc_rmid(kind, ident)
            if cleanup.sysv_objects(kind, owner):
                dirty.append(f"sysv ipc {kind} objects left")

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
            try:
                self.prespawn()
            except (OSError, RuntimeError):
                pass  # the next exec tries again and reports it


def _close_fds_from(low: int) -> None:
    """Close every fd from ``low`` up (close_range(2) where the kernel has it)."""
    os.closerange(low, max(low, resource.getrlimit(resource.RLIMIT_NOFILE)[0]))


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
    server.prespawn()
    write_frame(out_fd, {"op": "ready", "pid": os.getpid()})
    server.serve()


if __name__ == "__main__":
    main()
