"""Clean-up after an exec, for the fork server (standard library only).

Kill the sandbox uid's processes as root (through pidfds, so pid reuse cannot redirect a
kill), reap them, remove files iteratively within a deadline, and remove SysV IPC
objects. Imported by ``forkserver.py`` (inside the sandbox it sits next to it) and by the
host (``remove_tree`` for the process backend's work dir).
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import stat
import time

_IPC_RMID = 0


def sysv_objects(kind: str, uid: int | None) -> list[int]:
    """Ids of the SysV IPC objects of ``kind`` (of ``uid``'s, unless None) in our namespace."""
    try:
        with open(f"/proc/sysvipc/{kind}") as f:
            header, *rows = [line.split() for line in f]
    except (OSError, ValueError):
        return []
    uid_at, cuid_at = header.index("uid"), header.index("cuid")
    return [
        int(row[1]) for row in rows if uid is None or uid in (int(row[uid_at]), int(row[cuid_at]))
    ]


def ipc_rmid(kind: str, ident: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if kind == "shm":
        libc.shmctl(ident, _IPC_RMID, None)
    elif kind == "msg":
        libc.msgctl(ident, _IPC_RMID, None)
    else:
        libc.semctl(ident, 0, _IPC_RMID, 0)


def wait_exit(pid: int, pidfd: int, deadline: float) -> int | None:
    """Reap a killed ``pid``; None if it did not die before ``deadline``."""
    while True:
        remaining = deadline - time.monotonic()
        if select.select([pidfd], [], [], max(0.0, remaining))[0]:
            return os.waitpid(pid, 0)[1]
        if remaining <= 0:
            return None


def reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def kill_as_root(pid: int, uid: int) -> None:
    """SIGKILL ``pid`` if it (still) belongs to ``uid``; a pidfd rules out pid reuse."""
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return
    try:
        if os.stat(f"/proc/{pid}").st_uid == uid:
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    except OSError:
        pass
    finally:
        os.close(pidfd)


def kill_quietly(pid: int) -> None:
    for kill in (os.killpg, os.kill):
        try:
            kill(pid, signal.SIGKILL)
        except OSError:
            pass


def is_zombie(pid: str) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return True


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def remove_tree(path: str, deadline: float) -> bool:
    """Remove ``path`` (a file or a tree) without recursion; False if not done by ``deadline``.

    It walks with directory fds (one open at a time, whatever the depth, and no path
    grows past ``PATH_MAX``), so thousands of nested directories neither overflow the
    stack nor the path length. Callers kill the tree's owner first: nothing races it.
    """
    try:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            os.unlink(path)
            return True
        fd = os.open(path, _DIR_FLAGS)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    names: list[str] = []  # the path from ``path`` down to where ``fd`` is
    try:
        while True:
            if time.monotonic() > deadline:
                return False
            child = _empty_dir_or_descend(fd, deadline)
            if child is not None:
                os.close(fd)
                fd, _ = child
                names.append(child[1])
                continue
            if not names:
                os.close(fd)
                fd = -1
                os.rmdir(path)
                return True
            parent = os.open("..", _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = parent
            os.rmdir(names.pop(), dir_fd=fd)
    except OSError:
        return False
    finally:
        if fd >= 0:
            os.close(fd)


def _empty_dir_or_descend(fd: int, deadline: float) -> tuple[int, str] | None:
    """Unlink the files in dir ``fd``; at the first subdir return (its fd, its name)."""
    with os.scandir(fd) as entries:
        for i, entry in enumerate(entries):
            if entry.is_dir(follow_symlinks=False):
                return os.open(entry.name, _DIR_FLAGS, dir_fd=fd), entry.name
            try:
                os.unlink(entry.name, dir_fd=fd)
            except FileNotFoundError:
                pass
            if i % 256 == 255 and time.monotonic() > deadline:
                raise TimeoutError("removal ran out of time")
    return None


def owned_entries(directory: str, uid: int | None) -> list[str]:
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
