"""Trainer-side publishing and generator-side subscription of weight updates.

The trainer keeps fp32 master weights and publishes them cast to ``publish_dtype``; the
generator keeps a mirror in that dtype (the base that deltas apply to, bit-exactly) and may
compute in fp32.
"""

from __future__ import annotations

import time

import torch

from loomrl.weights.transports.base import Receiver, Sender
from loomrl.weights.update import WeightUpdate, apply_update, encode_update

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Publisher:
    def __init__(
        self, sender: Sender, *, codec: str = "full", full_every: int = 50, publish_dtype: str = "bfloat16"
    ) -> None:
        self.sender = sender
        self.codec = codec
        self.full_every = full_every
        self.dtype = DTYPES[publish_dtype]
        self._last: dict[str, torch.Tensor] | None = None
        self._last_version: int | None = None
        self._since_full = 0

    def publish(self, state: dict[str, torch.Tensor], version: int) -> dict[str, float]:
        """Cast, encode and send ``state`` as ``version``; returns ``weight_sync/*`` metrics."""
        t0 = time.perf_counter()
        new = {k: v.detach().to(self.dtype).clone() for k, v in state.items()}
        use_delta = (
            self.codec == "delta" and self._last is not None and self._since_full < self.full_every
        )
        base = self._last if use_delta else None
        update = encode_update(
            base, new, version=version, base_version=self._last_version if use_delta else None
        )
        t1 = time.perf_counter()
        self.sender.send(update)
        t2 = time.perf_counter()
        self._since_full = self._since_full + 1 if use_delta else 0
        self._last, self._last_version = new, version
        full_bytes = sum(t.numel() * t.element_size() for t in new.values())
        return {
            "weight_sync/bytes_full": float(full_bytes),
            "weight_sync/bytes_sent": float(update.nbytes),
            "weight_sync/encode_s": t1 - t0,
            "weight_sync/transfer_s": t2 - t1,
        }


class Subscriber:
    def __init__(self, receiver: Receiver) -> None:
        self.receiver = receiver
        self.failures = 0

    def poll(
        self, state: dict[str, torch.Tensor], have_version: int | None
    ) -> tuple[WeightUpdate | None, float]:
        """Apply every available update on top of ``have_version``; returns the last update
        applied (or None) and the seconds spent applying."""
        applied, seconds = None, 0.0
        while True:
            update = self.receiver.receive(have_version)
            if update is None:
                return applied, seconds
            t0 = time.perf_counter()
            apply_update(state, update)
            seconds += time.perf_counter() - t0
            applied, have_version = update, update.version
