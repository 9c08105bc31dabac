"""Per-sandbox memory, swap, TCP-buffer and pids limits through cgroup v1 or v2.

``detect(root)`` says which hierarchy this host offers us: ``"v2"`` (a unified hierarchy
with the memory and pids controllers, writable), ``"v1"`` (writable ``memory`` and
``pids`` hierarchies) or ``None``. ``CgroupLimits.create`` makes ``loomrl/<name>`` and sets

- v1: ``memory.limit_in_bytes``, ``memory.memsw.limit_in_bytes`` (no swap beyond it),
  ``memory.kmem.tcp.limit_in_bytes`` (TCP buffers are kernel memory that v1 does not
  charge to ``memory.limit_in_bytes``: without it one exec pinned 720 MiB of the host's
  shared TCP pool over loopback), ``pids.max``;
- v2: ``memory.max``, ``memory.swap.max = 0``, ``pids.max`` (v2 charges socket buffers to
  ``memory.max`` itself), after enabling ``+memory +pids`` in the parents'
  ``cgroup.subtree_control``.

It gives back the ``cgroup.procs`` files an exec child writes ``0`` into to join (the
server itself stays outside) and reads the OOM-kill counter (``memory.oom_control`` or
``memory.events``) so an exec killed by the OOM killer is reported as ``oom``. Every path
takes ``root``, so the logic is tested against a fake tree in a tmp dir.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal

logger = logging.getLogger(__name__)

CGROUP_ROOT = Path("/sys/fs/cgroup")
CGROUP_V1_ROOT = CGROUP_ROOT  # the v1 controllers are mounted under it
PARENT = "loomrl"
CgroupVersion = Literal["v1", "v2"]


def detect(root: Path = CGROUP_ROOT) -> CgroupVersion | None:
    """Which cgroup version gives us memory and pids limits here, if any."""
    controllers = root / "cgroup.controllers"
    if controllers.exists():
        available = set(controllers.read_text().split())
        if {"memory", "pids"} <= available and os.access(root, os.W_OK):
            return "v2"
        return None
    if all(
        (root / c / "cgroup.procs").exists() and os.access(root / c, os.W_OK)
        for c in ("memory", "pids")
    ):
        return "v1"
    return None


def cgroups_writable(root: Path = CGROUP_ROOT) -> bool:
    """Whether this host lets us give each sandbox memory and pids limits."""
    return detect(root) is not None


class CgroupLimits:
    """A sandbox's memory and pids cgroups (one directory on v2, two on v1)."""

    def __init__(self, memory_dir: Path, pids_dir: Path, version: CgroupVersion = "v1") -> None:
        self.memory_dir, self.pids_dir, self.version = memory_dir, pids_dir, version

    @classmethod
    def create(
        cls,
        name: str,
        memory_bytes: int,
        max_pids: int,
        tcp_bytes: int = 32 << 20,
        root: Path = CGROUP_ROOT,
        version: CgroupVersion | None = None,
    ) -> CgroupLimits:
        version = version or detect(root)
        if version == "v2":
            return cls._create_v2(name, memory_bytes, max_pids, root)
        if version == "v1":
            return cls._create_v1(name, memory_bytes, max_pids, tcp_bytes, root)
        raise OSError(f"no writable cgroup v1 or v2 memory and pids controllers under {root}")

    @classmethod
    def _create_v1(
        cls, name: str, memory_bytes: int, max_pids: int, tcp_bytes: int, root: Path
    ) -> CgroupLimits:
        memory_dir = root / "memory" / PARENT / name
        pids_dir = root / "pids" / PARENT / name
        for d in (memory_dir, pids_dir):
            d.mkdir(parents=True, exist_ok=True)
        (memory_dir / "memory.limit_in_bytes").write_text(str(memory_bytes))
        _write_optional(memory_dir / "memory.memsw.limit_in_bytes", memory_bytes, "swap")
        _write_optional(memory_dir / "memory.kmem.tcp.limit_in_bytes", tcp_bytes, "TCP buffer")
        (pids_dir / "pids.max").write_text(str(max_pids))
        return cls(memory_dir, pids_dir, "v1")

    @classmethod
    def _create_v2(cls, name: str, memory_bytes: int, max_pids: int, root: Path) -> CgroupLimits:
        parent = root / PARENT
        parent.mkdir(exist_ok=True)
        for d in (root, parent):
            enabled = (
                set((d / "cgroup.subtree_control").read_text().split())
                if (d / "cgroup.subtree_control").exists()
                else set()
            )
            if not {"memory", "pids"} <= enabled:
                (d / "cgroup.subtree_control").write_text("+memory +pids")
        group = parent / name
        group.mkdir(exist_ok=True)
        (group / "memory.max").write_text(str(memory_bytes))
        _write_optional(group / "memory.swap.max", 0, "swap")
        (group / "pids.max").write_text(str(max_pids))
        return cls(group, group, "v2")

    @property
    def procs_files(self) -> list[str]:
        """The files a single-threaded exec child writes ``0`` into to join.

        On v1 that is ``tasks`` (it moves one thread, without the global threadgroup lock
        whose RCU grace period made ``cgroup.procs`` cost ~1.5 ms per exec); on v2 it is
        ``cgroup.procs``.
        """
        if self.version == "v2":
            return [str(self.memory_dir / "cgroup.procs")]
        return [str(d / "tasks") for d in (self.memory_dir, self.pids_dir)]

    @property
    def pids_current_file(self) -> str:
        return str(self.pids_dir / "pids.current")

    def oom_kills(self) -> int:
        name = "memory.events" if self.version == "v2" else "memory.oom_control"
        try:
            for line in (self.memory_dir / name).read_text().splitlines():
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
        except OSError:
            pass
        return 0

    def pids(self) -> list[int]:
        found: set[int] = set()
        for d in {self.memory_dir, self.pids_dir}:
            try:
                found.update(int(x) for x in (d / "cgroup.procs").read_text().split())
            except OSError:
                pass
        return sorted(found)

    def remove(self, wait_s: float = 2.0) -> None:
        """Remove the groups once empty (the caller killed the sandbox; exits take a moment)."""
        deadline = time.monotonic() + wait_s
        while self.pids() and time.monotonic() < deadline:
            time.sleep(0.005)
        for d in {self.memory_dir, self.pids_dir}:
            try:
                d.rmdir()
            except FileNotFoundError:
                pass
            except OSError as err:
                logger.warning("could not remove cgroup %s: %s", d, err)


_warned: set[str] = set()


def _write_optional(path: Path, value: int, what: str) -> None:
    try:
        path.write_text(str(value))
    except OSError as err:
        if what not in _warned:  # once per process: the kernel will not change its mind
            _warned.add(what)
            logger.warning("no %s limit for sandboxes (%s: %s)", what, path.name, err)


def sandbox_parents(root: Path = CGROUP_ROOT) -> list[Path]:
    """The ``loomrl`` parent groups that hold sandboxes' groups, v1 and v2."""
    return [root / PARENT, root / "memory" / PARENT, root / "pids" / PARENT]


def remove_stale_cgroups(is_free: Callable[[int], bool], root: Path = CGROUP_ROOT) -> int:
    """Remove empty ``loomrl/sb-<uid>`` groups whose uid no live sandbox holds.

    ``is_free(uid)`` says whether no live sandbox holds the uid. Groups are left behind
    when a pool's process dies without closing it. Returns how many were removed.
    """
    removed = 0
    for parent in sandbox_parents(root):
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
