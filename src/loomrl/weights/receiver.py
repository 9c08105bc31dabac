"""The generator side of weight sync, shared by every engine.

A ``WeightReceiver`` holds the mirror (the published weights, in the published dtype: the
base deltas apply to bit-exactly), the ``Subscriber`` that fills it from a transport, and
the version it holds. Each time it applies updates it hands the engine exactly the tensors
those updates committed, as ``(name, tensor)`` pairs, the shape of vLLM's
``model.load_weights``; an engine never reads the transport or decodes an update itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch

from loomrl.telemetry import trace
from loomrl.weights.publisher import Subscriber

NamedTensors = Iterable[tuple[str, torch.Tensor]]
LoadWeights = Callable[[NamedTensors], None]  # an engine's load_weights


@dataclass
class WeightsApplied:
    """What a generator's ``apply_weights`` did: the version it holds after it, and the
    seconds it paused for (0.0 when nothing was applied)."""

    version: int
    apply_s: float = 0.0
    num_updates: int = 0
    weight_metrics: dict[str, float] = field(default_factory=dict)  # the subscriber's weight_sync/*


class WeightReceiver:
    """Receives, verifies and applies weight updates into a mirror; hands the changed
    tensors to the engine's ``load_weights``."""

    def __init__(
        self,
        mirror: dict[str, torch.Tensor],
        load_weights: LoadWeights,
        subscriber: Subscriber | None = None,
        wait_timeout_s: float = 300.0,
    ) -> None:
        self.mirror = mirror
        self.load_weights = load_weights
        self.subscriber = subscriber
        self.version = -1  # no version applied yet; the trainer publishes version 0 first
        self.num_updates_applied = 0
        self.wait_timeout_s = wait_timeout_s  # how long apply_newest waits for its min_version

    def _named(self, names: Iterable[str]) -> Iterator[tuple[str, torch.Tensor]]:
        return ((name, self.mirror[name]) for name in names)

    def _adopt(self, version: int, changed: Iterable[str]) -> int:
        """The mirror now holds ``version``: load what changed into the engine."""
        self.load_weights(self._named(changed))
        self.version = version
        self.num_updates_applied += 1
        return version

    def apply(self, update) -> int:
        """Apply one ``WeightUpdate`` handed over directly (not through a transport)."""
        changed = update.prepare(self.mirror).commit(self.mirror)  # either lane's update
        return self._adopt(update.version, changed)

    def poll(self) -> int:
        """Apply whatever the subscriber has; returns the version held."""
        if self.subscriber is None:
            return self.version
        start = time.time_ns()
        update, _ = self.subscriber.poll(self.mirror, self.version if self.version >= 0 else None)
        changed = self.subscriber.take_changed()
        if update is None:
            return self.version
        version = self._adopt(update.version, changed)
        if (tracer := trace.current()) is not None:  # a span only for polls that applied one
            tracer.add("apply_weights", "weights", start, time.time_ns(), args={"version": version})
        return version

    def apply_newest(self, min_version: int = 0) -> WeightsApplied:
        """Apply the newest updates, waiting until the version held is at least
        ``min_version`` (a prefetched or torch_dist update may land a moment after the
        trainer's publish returned)."""
        applied_before, t0 = self.num_updates_applied, time.perf_counter()
        deadline = time.monotonic() + self.wait_timeout_s
        self.poll()
        # none: weights come by hand
        while self.version < min_version and self.subscriber is not None:
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"generator at version {self.version} waited {self.wait_timeout_s:g} s for version "
                    f"{min_version} and it never arrived; check the weight transport and the trainer's log"
                )
            time.sleep(0.001)
            self.poll()
        num_updates = self.num_updates_applied - applied_before
        return WeightsApplied(
            self.version,
            time.perf_counter() - t0 if num_updates else 0.0,
            num_updates,
            self.subscriber.metrics() if self.subscriber is not None else {},
        )

    def close(self) -> None:
        """Stop the subscriber's background work (prefetch thread), if any."""
        if self.subscriber is not None:
            self.subscriber.close()
