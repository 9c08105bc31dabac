"""loomrl: asynchronous RL post-training for language models.

The package imports lazily: ``import loomrl`` pulls in no torch, so the CLI and the
config answer fast. ``loomrl.Job`` is the one-call public API.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["Job", "JobConfig", "__version__"]

if TYPE_CHECKING:
    from loomrl.config import JobConfig
    from loomrl.job import Job


def __getattr__(name: str) -> Any:
    if name == "Job":
        # lazy: `import loomrl` stays light: Job and JobConfig load on first use
        from loomrl.job import Job

        return Job
    if name == "JobConfig":
        # lazy: `import loomrl` stays light: Job and JobConfig load on first use
        from loomrl.config import JobConfig

        return JobConfig
    raise AttributeError(f"module 'loomrl' has no attribute {name!r}")
