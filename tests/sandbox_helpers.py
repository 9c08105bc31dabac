"""Shared fixtures' helpers for the sandbox tests."""

from __future__ import annotations

import os
import shutil

import pytest

from loomrl.sandbox.fork_sandbox import _is_zombie, uid_processes
from loomrl.sandbox.uids import DEFAULT_UID_BASE, DEFAULT_UID_COUNT

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
    """Live processes running under any sandbox uid (there should be none between execs).

    Zombies are not counted: a killed exec whose server was lost is re-parented to init,
    which reaps it in its own time.
    """
    found = {}
    for uid, pids in uid_processes(SANDBOX_UIDS).items():
        if live := [p for p in pids if not _is_zombie(p)]:
            found[uid] = live
    return found


def stronger_only(backend: str, what: str) -> None:
    """Skip a case that only the bwrap backend is expected to contain."""
    if backend != "bwrap":
        pytest.skip(f"{what}: only the bwrap backend isolates this (process backend is weaker)")


def needs_root(what: str) -> None:
    if not IS_ROOT:
        pytest.skip(f"{what}: needs root to run code under a dedicated unprivileged uid")
