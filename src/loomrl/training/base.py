"""The trainer's interface: the ``@endpoint`` methods the controller calls on its handle.

Plain data in and out (groups of rollouts, metrics, state dicts, paths), so the same
controller drives a trainer in a thread, a process or a Ray actor.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from loomrl.runtime.endpoints import endpoint
from loomrl.types import Group


class PublishAfterStepError(RuntimeError):
    """``train_step(..., publish=True)`` trained the step but could not publish it: the
    trainer is one version ahead of what the generators may hold."""


class TrainerEndpoints(ABC):
    @endpoint
    @abstractmethod
    def train_step(self, groups: list[Group], publish: bool = False) -> dict[str, float]:
        """One optimizer step on ``groups``; the version grows by one; step metrics.
        ``publish=True``: then ``publish()`` the new version in the same call (one round
        trip a step instead of two), its ``weight_sync/*`` metrics with the step's; a
        publish that fails raises ``PublishAfterStepError`` (the step itself stands)."""

    @endpoint
    @abstractmethod
    def publish(self, full: bool = False) -> dict[str, float]:
        """Send the current weights to the generators as the current version; ``weight_sync/*``.
        ``full=True``: a full snapshot even where a delta would do (a generator that was
        just restarted has no base for a delta)."""

    @endpoint
    @abstractmethod
    def state_dict(self) -> dict:
        """Model, optimizer, scheduler and version, for a checkpoint."""

    @endpoint
    @abstractmethod
    def load_state_dict(self, state: dict) -> None:
        """Continue from a checkpoint's ``state_dict``."""

    @endpoint
    @abstractmethod
    def save_checkpoint(self, root: str, step: int, extra: dict, keep: int) -> str:
        """Checkpoint the trainer plus ``extra`` atomically under ``root``; its path."""

    @endpoint
    @abstractmethod
    def save_pretrained(self, path: str) -> None:
        """The final model in ``save_pretrained`` format."""

    @endpoint
    def offload(self) -> float | None:
        """Release accelerator memory (weights, optimizer state) until ``restore``; the
        time-slicing scheduler and colocated turns call it. Implementations return the
        seconds it took; this default holds nothing on a device and releases nothing."""
        return None

    @endpoint
    def restore(self) -> float | None:
        """Reacquire what ``offload`` released; implementations return the seconds it took."""
        return None
