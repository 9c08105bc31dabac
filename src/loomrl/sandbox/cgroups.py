"""Per-sandbox cgroup v1 memory and pids limits, used where the hierarchy is writable.

``CgroupLimits.create`` makes ``<controller>/loomrl/<name>`` under each writable
controller, sets ``memory.limit_in_bytes`` / ``pids.max`` and gives back the
``cgroup.procs`` files a launcher writes its own pid into before it execs the sandbox.
``oom_kills`` reads the memory cgroup's ``oom_kill`` counter so an exec killed by the OOM
killer is reported as ``oom``. cgroup v2 is not handled (nothing here is writable on v2
hosts we target); without cgroups the rlimits still apply.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

logger = logging.getLogger(__name__)

CGROUP_V1_ROOT = Path("/sys/fs/cgroup")


def cgroups_writable(root: Path = CGROUP_V1_ROOT) -> bool:
    """Whether cgroup v1 memory and pids controllers exist and we may create groups."""
    return all(
        (root / c / "cgroup.procs").exists() and os.access(root / c, os.W_OK)
        for c in ("memory", "pids")
    )


class CgroupLimits:
    """A memory and a pids cgroup for one sandbox."""

    def __init__(self, memory_dir: Path, pids_dir: Path) -> None:
        self.memory_dir, self.pids_dir = memory_dir, pids_dir

    @classmethod
    def create(
        cls, name: str, memory_bytes: int, max_pids: int, root: Path = CGROUP_V1_ROOT
    ) -> CgroupLimits:
        memory_dir = root / "memory" / "loomrl" / name
        pids_dir = root / "pids" / "loomrl" / name
        for d in (memory_dir, pids_dir):
            d.mkdir(parents=True, exist_ok=True)
        (memory_dir / "memory.limit_in_bytes").write_text(str(memory_bytes))
        try:
            (memory_dir / "memory.memsw.limit_in_bytes").write_text(str(memory_bytes))
        except OSError:
            pass  # no swap accounting on this kernel
        (pids_dir / "pids.max").write_text(str(max_pids))
        return cls(memory_dir, pids_dir)

    @property
    def procs_files(self) -> list[str]:
        return [str(self.memory_dir / "cgroup.procs"), str(self.pids_dir / "cgroup.procs")]

    @property
    def pids_current_file(self) -> str:
        return str(self.pids_dir / "pids.current")

    def oom_kills(self) -> int:
        try:
            for line in (self.memory_dir / "memory.oom_control").read_text().splitlines():
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
        except OSError:
            pass
        return 0

    def pids(self) -> list[int]:
        found: set[int] = set()
        for d in (self.memory_dir, self.pids_dir):
            try:
                found.update(int(x) for x in (d / "cgroup.procs").read_text().split())
            except OSError:
                pass
        return sorted(found)

    def remove(self, wait_s: float = 2.0) -> None:
        """Remove both groups once empty (the caller killed the sandbox; exits take a moment)."""
        deadline = time.monotonic() + wait_s
        while self.pids() and time.monotonic() < deadline:
            time.sleep(0.005)
        for d in (self.memory_dir, self.pids_dir):
            try:
                d.rmdir()
            except FileNotFoundError:
                pass
            except OSError as err:
                logger.warning("could not remove cgroup %s: %s", d, err)


def remove_stale_cgroups(is_free, root: Path = CGROUP_V1_ROOT) -> int:
    """Remove empty ``loomrl/sb-<uid>`` groups whose uid no live sandbox holds.

    ``is_free(uid)`` says whether no live sandbox holds the uid. Groups are left behind
    when a pool's process dies without closing it. Returns how many were removed.
    """
    removed = 0
    for controller in ("memory", "pids"):
        parent = root / controller / "loomrl"
        try:
            names = [n for n in os.listdir(parent) if n.startswith("sb-")]
        except OSError:
            continue
        for name in names:
            try:
                uid = int(name[3:])
            except ValueError:
                continue
            if not is_free(uid):
                continue
            try:
                (parent / name).rmdir()
                removed += 1
            except OSError:
                pass  # still has processes: the reaper kills them first
    return removed
