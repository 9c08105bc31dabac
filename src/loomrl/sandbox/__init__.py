"""Isolated execution of model actions: a ``Sandbox`` interface, backends and a warm pool.

``SandboxPool`` is what jobs use; ``default_pool()`` gives reward functions a lazily
created process-wide pool (``set_default_pool`` lets the job inject its own).
"""

from loomrl.sandbox.base import ExecResult, Sandbox, SandboxError, SandboxLimits
from loomrl.sandbox.default import (
    close_default_pool,
    configure_default_pool,
    default_pool,
    default_pool_metrics,
    set_default_pool,
)
from loomrl.sandbox.fork_sandbox import ForkServerSandbox
from loomrl.sandbox.pool import SandboxPool

__all__ = [
    "ExecResult",
    "ForkServerSandbox",
    "Sandbox",
    "SandboxError",
    "SandboxLimits",
    "SandboxPool",
    "close_default_pool",
    "configure_default_pool",
    "default_pool",
    "default_pool_metrics",
    "set_default_pool",
]
