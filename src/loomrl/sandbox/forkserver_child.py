"""The exec side of the fork server (standard library only): the zygote that forks exec
children from a state that never saw a request, and what each child does before it runs
the code. Imported by ``forkserver.py``; inside the sandbox it sits next to it.
"""

from __future__ import annotations

import ctypes
import os
import resource
import signal
import socket
import struct
import sys
import traceback

if __package__:
    from loomrl.sandbox.forkserver_io import read_exact, read_frame
else:  # imported by the fork server run as a script: its helper modules sit next to it
    from forkserver_io import read_exact, read_frame

_PID = struct.Struct("!i")
PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36


def prctl(option: int, value: int) -> None:
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

    def __init__(self, child: ExecChild, close_in_zygote: tuple[int, ...]) -> None:
        self.child, self.close_in_zygote = child, close_in_zygote
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
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # not inherited: die with the server
        for fd in self.close_in_zygote:
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
            self.child.run(fds)
        if pid > 0:
            return pid
        report_r, report_w = os.pipe()
        middle = os.fork()
        if middle == 0:
            os.close(report_r)
            child = os.fork()
            if child == 0:
                os.close(report_w)
                self.child.run(fds)
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


class ExecChild:
    """What an exec child does once forked: join the sandbox's cgroups, take its stdio and
    request from the server, set rlimits, drop to the sandbox's uid, then run the code or
    exec the command. ``config`` is the server's (the host's first frame)."""

    def __init__(self, config: dict) -> None:
        self.uid: int | None = config.get("uid")
        self.gid: int | None = config.get("gid")
        self.limits: dict = config["limits"]
        self.env: dict = config["env"]
        self.cgroup_fds: list[int] = config.get("cgroup_procs_fds", [])

    def run(self, fds: list[int]) -> None:
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
            self._run_python(req.get("code") or "", req.get("workspace", False))
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

    def _run_python(self, code: str, workspace: bool) -> None:
        sys.argv = ["<snippet>"]
        if workspace:
            # As ``python -c`` would: the workspace's own modules import.
            sys.path.insert(0, "")
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


def _close_fds_from(low: int) -> None:
    """Close every fd from ``low`` up (close_range(2) where the kernel has it)."""
    os.closerange(low, max(low, resource.getrlimit(resource.RLIMIT_NOFILE)[0]))
