"""Host-wide leases on dedicated sandbox uids.

Each live sandbox runs its code under a uid of its own, so ``RLIMIT_NPROC`` and
"kill every process of this uid" are per sandbox. A lease is an exclusive ``flock`` on
``<lock_dir>/<uid>.lock`` in one fixed, root-owned directory (``/run/loomrl/sandbox-uids``,
whatever ``TMPDIR`` says: two jobs with different ``TMPDIR`` once leased the same uid and
killed each other's processes): several pools (in several processes) never share a uid,
and a crashed pool's leases free themselves. Needs root (to ``setuid`` to arbitrary uids).
While older loomrl versions may run on the same host, the lock in their old location
(``$TMPDIR/loomrl-sandbox-uids``, where it exists) is taken too.
"""

from __future__ import annotations

import fcntl
import logging
import os
import pwd
import stat
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_UID_BASE = 880_000
DEFAULT_UID_COUNT = 4096
HOST_LOCK_DIR = Path("/run/loomrl/sandbox-uids")


def _legacy_lock_dir() -> Path:
    return Path(tempfile.gettempdir()) / "loomrl-sandbox-uids"


def _private_dir(path: Path) -> bool:
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o022


def _checked_dir(path: Path) -> Path:
    """Create ``path`` (0700) if needed and make sure nobody else owns or can write it."""
    path.parent.mkdir(mode=0o755, exist_ok=True)
    path.mkdir(mode=0o700, exist_ok=True)
    if not _private_dir(path):
        st = os.lstat(path)
        raise RuntimeError(
            f"uid lease dir {path} must be a directory owned by uid {os.geteuid()} and "
            f"writable by nobody else (mode {stat.filemode(st.st_mode)}, owner {st.st_uid})"
        )
    return path


class UidLease:
    """Holds one uid (and the gid of the same number) until ``release``."""

    def __init__(self, uid: int, lock_fds: list[int]) -> None:
        self.uid = uid
        self.gid = uid
        self._lock_fds = lock_fds

    def release(self) -> None:
        for fd in self._lock_fds:
            os.close(fd)
        self._lock_fds = []


class UidAllocator:
    """Hands out uids in ``[base, base + count)`` that no other live sandbox holds."""

    def __init__(
        self,
        base: int = DEFAULT_UID_BASE,
        count: int = DEFAULT_UID_COUNT,
        lock_dir: str | None = None,
    ) -> None:
        if base <= 0 or count <= 0:
            raise ValueError(f"uid range must be positive, got base={base} count={count}")
        self.base, self.count = base, count
        self.lock_dir = Path(lock_dir) if lock_dir else HOST_LOCK_DIR
        self._legacy_dir = None if lock_dir else _legacy_lock_dir()
        self._dir_checked = False
        self._next = 0
        self._check_range_unused()

    def _check_range_unused(self) -> None:
        taken = [
            p.pw_name for p in pwd.getpwall() if self.base <= p.pw_uid < self.base + self.count
        ]
        if taken:
            raise ValueError(
                f"sandbox uid range {self.base}..{self.base + self.count - 1} overlaps real "
                f"users {taken}; choose another sandbox.uid_base"
            )

    def acquire_specific(self, uid: int) -> UidLease:
        """Lease exactly ``uid``; raises ``BlockingIOError`` if someone holds it."""
        if not self._dir_checked:
            _checked_dir(self.lock_dir)
            self._dir_checked = True
        dirs = [self.lock_dir]
        if self._legacy_dir is not None and _private_dir(self._legacy_dir):
            dirs.append(self._legacy_dir)
        fds: list[int] = []
        try:
            for d in dirs:
                fds.append(_lock(d / f"{uid}.lock"))
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        return UidLease(uid, fds)

    def acquire(self) -> UidLease:
        for _ in range(self.count):
            uid = self.base + self._next
            self._next = (self._next + 1) % self.count
            try:
                return self.acquire_specific(uid)
            except BlockingIOError:
                continue
        raise RuntimeError(f"all {self.count} sandbox uids from {self.base} are in use")


def _lock(path: Path) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise
    return fd
