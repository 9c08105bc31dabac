"""Host-wide leases on dedicated sandbox uids.

Each live sandbox runs its code under a uid of its own, so ``RLIMIT_NPROC`` and
"kill every process of this uid" are per sandbox. A lease is an exclusive ``flock`` on
``<lock_dir>/<uid>.lock``: several pools (in several processes) never share a uid, and a
crashed pool's leases free themselves. Needs root (to ``setuid`` to arbitrary uids).
"""

from __future__ import annotations

import fcntl
import logging
import os
import pwd
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_UID_BASE = 880_000
DEFAULT_UID_COUNT = 4096


class UidLease:
    """Holds one uid (and the gid of the same number) until ``release``."""

    def __init__(self, uid: int, lock_fd: int) -> None:
        self.uid = uid
        self.gid = uid
        self._lock_fd = lock_fd

    def release(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1


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
        self.lock_dir = Path(lock_dir or Path(tempfile.gettempdir()) / "loomrl-sandbox-uids")
        self.lock_dir.mkdir(mode=0o700, exist_ok=True)
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
        fd = os.open(self.lock_dir / f"{uid}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise
        return UidLease(uid, fd)

    def acquire(self) -> UidLease:
        for _ in range(self.count):
            uid = self.base + self._next
            self._next = (self._next + 1) % self.count
            try:
                return self.acquire_specific(uid)
            except BlockingIOError:
                continue
        raise RuntimeError(f"all {self.count} sandbox uids from {self.base} are in use")
