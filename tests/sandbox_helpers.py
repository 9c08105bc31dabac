"""Shared fixtures' helpers for the sandbox tests."""

from __future__ import annotations

import os
import shutil

import psutil
import pytest

from loomrl.sandbox.fork_sandbox import _is_zombie, uid_processes
from loomrl.sandbox.uids import DEFAULT_UID_BASE, DEFAULT_UID_COUNT, HOST_LOCK_DIR, _legacy_lock_dir

HAVE_BWRAP = shutil.which("bwrap") is not None
IS_ROOT = os.geteuid() == 0
BACKENDS = [
    pytest.param(
        "bwrap", marks=pytest.mark.skipif(not HAVE_BWRAP, reason="bubblewrap is not installed")
    ),
    "process",
]
SANDBOX_UIDS = range(DEFAULT_UID_BASE, DEFAULT_UID_BASE + DEFAULT_UID_COUNT)


def sandbox_code_processes() -> dict[int, list[int]]:
    """Live processes running under a sandbox uid (there should be none between execs).

    Zombies are not counted: a killed exec whose server was lost is re-parented to init,
    which reaps it in its own time. Nor are uids whose lease another process holds (another
    pytest-xdist worker's sandbox, busy with its own exec): each worker checks its own
    sandboxes, and a uid nobody holds any more is checked by every worker.
    """
    seen = uid_processes(SANDBOX_UIDS)  # first the processes, then the leases, then again
    elsewhere = uids_leased_elsewhere()
    found = {}
    for uid, pids in seen.items():
        if uid in elsewhere:
            continue
        if live := [p for p in pids if psutil.pid_exists(p) and not _is_zombie(p)]:
            found[uid] = live
    return found


def uids_leased_elsewhere() -> set[int]:
    """Sandbox uids whose lease (a ``flock`` on ``<lock dir>/<uid>.lock``, see
    ``loomrl.sandbox.uids``) is held by a process that is neither this one nor one of its
    descendants, read from ``/proc/locks``."""
    by_inode: dict[int, int] = {}
    for folder in (HOST_LOCK_DIR, _legacy_lock_dir()):
        try:
            entries = list(folder.glob("*.lock"))
        except OSError:
            continue
        for entry in entries:
            try:
                by_inode[entry.stat().st_ino] = int(entry.stem)
            except (OSError, ValueError):
                continue
    if not by_inode:
        return set()
    me = os.getpid()
    mine = {me} | {c.pid for c in psutil.Process(me).children(recursive=True)}
    held: set[int] = set()
    try:
        lines = open("/proc/locks").read().splitlines()
    except OSError:
        return held
    for line in lines:
        fields = line.split()
        if "->" in fields or len(fields) < 6 or fields[1] != "FLOCK":
            continue  # a waiter, or not a lease
        try:
            pid, inode = int(fields[4]), int(fields[5].rsplit(":", 1)[1])
        except (ValueError, IndexError):
            continue
        if inode in by_inode and pid not in mine:
            held.add(by_inode[inode])
    return held


def stronger_only(backend: str, what: str) -> None:
    """Skip a case that only the bwrap backend is expected to contain."""
    if backend != "bwrap":
        pytest.skip(f"{what}: only the bwrap backend isolates this (process backend is weaker)")


def needs_root(what: str) -> None:
    if not IS_ROOT:
        pytest.skip(f"{what}: needs root to run code under a dedicated unprivileged uid")
