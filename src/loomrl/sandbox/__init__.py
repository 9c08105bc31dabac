"""Isolated execution of model actions: a ``Sandbox`` interface, backends and a warm pool.

``SandboxPool`` is what jobs use; ``default_pool()`` gives reward functions a lazily
created process-wide pool (``set_default_pool`` lets the job inject its own).

The names below import on first use: the job's config reads ``loomrl.sandbox.config``
without loading the pool and its backends.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "ExecResult": "loomrl.sandbox.base",
    "Sandbox": "loomrl.sandbox.base",
    "SandboxError": "loomrl.sandbox.base",
    "SandboxLimits": "loomrl.sandbox.base",
    "close_default_pool": "loomrl.sandbox.default",
    "configure_default_pool": "loomrl.sandbox.default",
    "default_pool": "loomrl.sandbox.default",
    "default_pool_metrics": "loomrl.sandbox.default",
    "set_default_pool": "loomrl.sandbox.default",
    "ForkServerSandbox": "loomrl.sandbox.fork_sandbox",
    "SandboxPool": "loomrl.sandbox.pool",
    "Workspace": "loomrl.sandbox.workspace",
    "WorkspaceLost": "loomrl.sandbox.workspace",
    "workspace_tools": "loomrl.sandbox.tools",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'loomrl.sandbox' has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)
