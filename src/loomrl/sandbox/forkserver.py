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

The zygote and what an exec child does before it runs the code live in
``forkserver_child.py``; the frame codec (``read_frame``/``write_frame``) that the host
shares, in ``forkserver_io.py``.
"""

from __future__ import annotations

import base64
import os
import signal
import socket
import sys
import time

if __package__:
    from loomrl.sandbox import forkserver_cleanup as cleanup
    from loomrl.sandbox.forkserver_child import (
        PR_SET_CHILD_SUBREAPER,
        PR_SET_PDEATHSIG,
        ExecChild,
        Zygote,
        prctl,
    )
    from loomrl.sandbox.forkserver_io import Pump, describe, read_frame, readable, write_frame
else:  # run as a script (inside the sandbox): its helper modules sit next to this file
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import forkserver_cleanup as cleanup
    from forkserver_child import PR_SET_CHILD_SUBREAPER, PR_SET_PDEATHSIG, ExecChild, Zygote, prctl
    from forkserver_io import Pump, describe, read_frame, readable, write_frame

    del sys.path[0]  # the exec's code must not import from here

KILL_DEADLINE_S = 2.0  # leftover processes must be gone within this
REMOVE_DEADLINE_S = 1.0  # default budget for removing an exec's files
WAIT_DEADLINE_S = 2.0  # a SIGKILLed exec must be reaped within this
WORKSPACE_DIR = "ws"  # under the work root; the execs' own dirs are numbered


class Server:
    """One sandbox's exec loop; ``config`` is the first frame the host sends."""

    def __init__(self, in_fd: int, out_fd: int, config: dict) -> None:
        self.in_fd, self.out_fd = in_fd, out_fd
        self.uid: int | None = config.get("uid")
        self.gid: int | None = config.get("gid")
        self.work_root: str = config["work_root"]
        self.scan_proc: bool = config.get("pid_namespace", False)
        self.pids_current_fd: int | None = config.get("pids_current_fd")
        self.scratch_dirs: list[str] = config.get("scratch_dirs", [])
        self.remove_deadline_s = float(config.get("cleanup_s", REMOVE_DEADLINE_S))
        self.seq = 0
        os.makedirs(self.work_root, mode=0o711, exist_ok=True)
        self._next: socket.socket | None = None  # the channel to the next, waiting child
        self.zygote = Zygote(ExecChild(config), (in_fd, out_fd))

    def _workspace_dir(self, req: dict) -> str:
        """The episode's workspace: one dir that outlives the execs of its episode, created
        on first use, owned by the sandbox uid. Files reach it only through the code (which
        runs as that uid): the server, as root, never writes into a dir the code controls."""
        if req.get("files"):
            raise ValueError("a workspace exec takes no files: write them with an exec")
        workdir = os.path.join(self.work_root, WORKSPACE_DIR)
        if not os.path.isdir(workdir):
            os.mkdir(workdir, 0o700)
            if self.uid is not None:
                os.chown(workdir, self.uid, self.gid)
        return workdir

    def wipe_workspace(self) -> list[str]:
        """End the episode's workspace: kill what is left of the uid and remove the dir
        within the clean-up deadline; returns what could not be cleaned (dirty)."""
        dirty: list[str] = []
        self._kill_leftovers(dirty)
        workdir = os.path.join(self.work_root, WORKSPACE_DIR)
        deadline = time.monotonic() + self.remove_deadline_s
        if os.path.lexists(workdir) and not cleanup.remove_tree(workdir, deadline):
            dirty.append("workspace not removed in time")
        elif os.path.lexists(workdir):
            dirty.append("workspace still present after removal")
        return dirty

    def _prepare_workdir(self, req: dict) -> str:
        if req.get("workspace"):
            return self._workspace_dir(req)
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
        own["workspace"] = bool(req.get("workspace"))
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
            # A workspace's dir stays for the episode's next exec (wiped by its own op).
            self._remove_files(None if req.get("workspace") else workdir, dirty)
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

    def _remove_files(self, workdir: str | None, dirty: list[str]) -> None:
        """Remove the work dir (unless None) and the uid's files in scratch dirs, within
        the deadline."""
        deadline = time.monotonic() + self.remove_deadline_s
        if workdir is not None and not cleanup.remove_tree(workdir, deadline):
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
            if req.get("op") == "wipe_workspace":
                try:
                    dirty = self.wipe_workspace()
                except Exception as err:  # noqa: BLE001 - reported: the host replaces the sandbox
                    dirty = [f"wipe failed: {err!r}"]
                write_frame(self.out_fd, {"op": "wiped", "dirty": dirty})
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


def main() -> None:
    # Move the protocol channel off fds 0/1 so the exec child's stdio is clean.
    in_fd, out_fd = os.dup(0), os.dup(1)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1):
        os.dup2(devnull, fd)
    os.close(devnull)
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    prctl(PR_SET_CHILD_SUBREAPER, 1)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    config = read_frame(in_fd)
    server = Server(in_fd, out_fd, config)
    server.prespawn()
    write_frame(out_fd, {"op": "ready", "pid": os.getpid()})
    server.serve()


if __name__ == "__main__":
    main()
