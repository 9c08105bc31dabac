"""A process-wide default pool for reward functions that need a sandbox.

``default_pool()`` creates a ``SandboxPool`` on first use (from the config given to
``set_default_pool`` / ``configure_default_pool``, else from ``SandboxConfig()``
defaults) and closes it when the interpreter exits. The job calls
``set_default_pool(pool)`` so reward code shares the job's pool and its metrics.
"""

from __future__ import annotations

import atexit
import logging
import threading

from loomrl.sandbox.pool import SandboxPool

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_pool: SandboxPool | None = None
_config: object | None = None
_owned = False


def configure_default_pool(config: object) -> None:
    """Use this ``SandboxConfig`` when the default pool is first created."""
    global _config
    _config = config


def set_default_pool(pool: SandboxPool | None) -> None:
    """Make ``pool`` the default (the caller keeps ownership and closes it)."""
    global _pool, _owned
    with _lock:
        _pool, _owned = pool, False


def default_pool() -> SandboxPool:
    """The process-wide pool, created lazily and closed at interpreter exit."""
    global _pool, _owned
    with _lock:
        if _pool is None:
            from loomrl.sandbox.config import SandboxConfig

            _pool = SandboxPool.from_config(_config or SandboxConfig())
            _owned = True
            atexit.register(close_default_pool)
        return _pool


def default_pool_metrics() -> dict[str, float]:
    """The default pool's ``sandbox/*`` metrics, or {} if no pool exists (none is created)."""
    with _lock:
        pool = _pool
    return pool.metrics() if pool is not None else {}


def close_default_pool() -> None:
    """Close the default pool if this module created it."""
    global _pool, _owned
    with _lock:
        pool, owned = _pool, _owned
        _pool, _owned = None, False
    if pool is not None and owned:
        pool.close()
