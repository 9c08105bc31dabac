"""Trainer-side publishing and generator-side subscription of weight updates.

The trainer keeps fp32 master weights and publishes them cast to ``publish_dtype``; the
generator keeps a mirror in that dtype (the base that deltas apply to, bit-exactly) and may
compute in fp32. With ``codec="delta"`` the publisher sends a lossless delta against the
previous version and a full snapshot every ``full_every`` versions (and whenever a delta
cannot be sent). With ``quantized`` (``loomrl.weights.quantized``) the weights a quantized
generator quantizes are published as codes and scales computed from the fp32 masters instead.

The subscriber decodes and verifies an update without touching the mirror, then commits
it. With ``prefetch=True`` a background thread receives and verifies while the generator
works, so ``poll`` between requests only pays for the commit (the apply).
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np
import torch

from loomrl.weights.codec import CodecOptions
from loomrl.weights.manifest import bits_view
from loomrl.weights.params import published_copy
from loomrl.weights.quantized import QuantizedPublish
from loomrl.weights.transports.base import Receiver, Sender, TransportError
from loomrl.weights.update import (
    PreparedUpdate,
    WeightUpdate,
    WeightUpdateError,
    encode_update,
)

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def count_changed(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> tuple[int, int]:
    """(elements whose bits differ, elements compared) over the tensors both dicts share."""
    changed = total = 0
    for name, t in new.items():
        o = old.get(name)
        if o is not None and o.shape == t.shape and o.dtype == t.dtype:
            changed += int(np.count_nonzero(bits_view(o) != bits_view(t)))
            total += t.numel()
    return changed, total


class Publisher:
    """Casts, encodes and sends the trainer's weights; one call per published version."""

    def __init__(
        self,
        sender: Sender,
        *,
        codec: str = "full",
        full_every: int = 50,
        publish_dtype: str = "bfloat16",
        options: CodecOptions | None = None,
        quantized: QuantizedPublish | None = None,
    ) -> None:
        if codec not in ("full", "delta"):
            raise ValueError(f"codec must be 'full' or 'delta', got {codec!r}")
        if publish_dtype not in DTYPES:
            raise ValueError(
                f"publish_dtype must be one of {sorted(DTYPES)}, got {publish_dtype!r}"
            )
        if full_every < 1:
            raise ValueError(f"full_every must be >= 1, got {full_every}")
        self.sender = sender
        self.codec = codec
        self.full_every = full_every
        self.dtype = DTYPES[publish_dtype]
        self.options = options or CodecOptions()
        self.quantized = quantized  # weights published as codes + scales (None: none)
        self._last: dict[str, torch.Tensor] | None = None
        self._last_version: int | None = None
        self._last_digest: str | None = None
        self._since_full = 0
        self.num_send_failures = 0
        self.num_fulls = 0

    @property
    def last_snapshot(self) -> dict[str, torch.Tensor] | None:
        """The state last published on a byte lane, kept as the next delta's base (None
        before the first publish, and on the tensor lane, which keeps none)."""
        return self._last

    def _cast(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.quantized is not None:
            return self.quantized.cast(state, self.dtype)
        return {k: published_copy(v, self.dtype) for k, v in state.items()}

    def _send(self, new: dict[str, torch.Tensor], version: int, delta: bool) -> WeightUpdate:
        update = encode_update(
            self._last if delta else None,
            new,
            version=version,
            base_version=self._last_version if delta else None,
            base_digest=self._last_digest,
            options=self.options,
        )
        self._encode_s += time.perf_counter() - self._t
        self._t = time.perf_counter()
        try:
            self.sender.send(update)
        except TransportError as err:
            self.num_send_failures += 1
            if not delta:
                raise
            logger.warning("sending delta %s failed (%s); sending a full snapshot", version, err)
            self._transfer_s += time.perf_counter() - self._t
            self._t = time.perf_counter()
            return self._send(new, version, delta=False)
        self._transfer_s += time.perf_counter() - self._t
        return update

    def publish(
        self, state: dict[str, torch.Tensor], version: int, full: bool = False
    ) -> dict[str, float]:
        """Cast, encode and send ``state`` as ``version`` (``full``: as a full snapshot,
        whatever the codec); returns ``weight_sync/*`` metrics."""
        if self.sender.carries_tensors:
            if self.quantized is not None:
                raise ValueError(
                    "publishing quantized weights needs a byte lane (inproc, shm, files, "
                    "torch_dist); the tensor lane publishes one dtype"
                )
            return self._publish_tensors(state, version)
        t0 = time.perf_counter()
        new = self._cast(state)
        cast_s = time.perf_counter() - t0
        delta = (
            not full
            and self.codec == "delta"
            and self._last is not None
            and self._since_full + 1 < self.full_every
        )
        self._t, self._encode_s, self._transfer_s = time.perf_counter(), 0.0, 0.0
        update = self._send(new, version, delta)
        if update.is_full:
            self.num_fulls += 1
            self._since_full = 0
        else:
            self._since_full += 1
        metrics = {
            "weight_sync/version": float(version),
            "weight_sync/is_full": float(update.is_full),
            "weight_sync/bytes_full": float(update.model_nbytes),
            "weight_sync/bytes_sent": float(update.nbytes),
            "weight_sync/cast_s": cast_s,
            "weight_sync/encode_s": self._encode_s,
            "weight_sync/transfer_s": self._transfer_s,
            "weight_sync/send_failures": float(self.num_send_failures),
            "weight_sync/num_fulls": float(self.num_fulls),
        }
        if not update.is_full:
            metrics["weight_sync/changed_fraction"] = update.changed_fraction
        elif self._last is not None:
            changed, total = count_changed(self._last, new)
            metrics["weight_sync/changed_fraction"] = changed / max(total, 1)
        self._last, self._last_version, self._last_digest = new, version, update.digest
        return metrics

    def _publish_tensors(self, state: dict[str, torch.Tensor], version: int) -> dict[str, float]:
        """The tensor lane: cast into the lane's device buffer, digest there, send; always a
        full snapshot (``loomrl.weights.transports.tensor``)."""
        t0 = time.perf_counter()
        try:
            update = self.sender.pack(state, self.dtype, version)
            t1 = time.perf_counter()
            self.sender.send(update)
        except TransportError:
            self.num_send_failures += 1
            raise
        t2 = time.perf_counter()
        self.num_fulls += 1
        return {
            "weight_sync/version": float(version),
            "weight_sync/is_full": 1.0,
            "weight_sync/bytes_full": float(update.model_nbytes),
            "weight_sync/bytes_sent": float(update.nbytes),
            "weight_sync/cast_s": t1 - t0,  # cast and digest, on the device (the digest syncs)
            "weight_sync/encode_s": 0.0,
            "weight_sync/transfer_s": t2 - t1,
            "weight_sync/send_failures": float(self.num_send_failures),
            "weight_sync/num_fulls": float(self.num_fulls),
        }


class Subscriber:
    """Applies the updates a receiver hands out to a generator's mirror state dict."""

    def __init__(self, receiver: Receiver, *, prefetch: bool = False) -> None:
        self.receiver = receiver
        self.prefetch = prefetch
        self.version: int | None = None  # of the state, as far as this subscriber knows
        self.digest: str | None = None
        self.failures = 0
        self.num_applied = 0
        self.last: dict[str, float] = {}
        self._lock = threading.Lock()
        self._ready: PreparedUpdate | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._rejected: dict[tuple, None] = {}  # updates that failed verification (bounded)
        self._changed: dict[str, None] = {}  # tensors committed since take_changed (in order)

    def _knows(self, have_version: int | None) -> str | None:
        return self.digest if have_version is not None and have_version == self.version else None

    def prepare(
        self, state: dict[str, torch.Tensor], have_version: int | None
    ) -> PreparedUpdate | None:
        """Receive and verify the next update for ``state`` at ``have_version`` (reads the
        state only). A rejected delta is counted, remembered (never retried) and replaced by
        the latest full snapshot when that one moves the state."""
        t0 = time.perf_counter()
        update = self.receiver.receive(have_version)
        t1 = time.perf_counter()
        for _ in range(2):
            if update is None:
                return None
            key = (update.version, update.base_version, update.digest)
            if key not in self._rejected:
                try:
                    prepared = update.prepare(  # a WeightUpdate, or a tensor lane's TensorUpdate
                        state,
                        have_version=have_version,
                        have_digest=self._knows(have_version),
                    )
                except WeightUpdateError as err:
                    self.failures += 1
                    self._rejected[key] = None
                    while len(self._rejected) > 64:
                        self._rejected.pop(next(iter(self._rejected)))
                    logger.warning(
                        "rejected weight update %s->%s: %s",
                        update.base_version,
                        update.version,
                        err,
                    )
                else:
                    self.last.update(
                        {
                            "weight_sync/receive_s": t1 - t0,
                            "weight_sync/decode_s": time.perf_counter() - t1,
                        }
                    )
                    return prepared
            if update.is_full:
                return None
            update = self.receiver.receive(None)  # fall back to the latest snapshot
            if update is not None and update.version == have_version:
                return None
        return None

    def commit(self, state: dict[str, torch.Tensor], prepared: PreparedUpdate) -> float:
        """Write a prepared update into ``state``; returns the seconds it took."""
        t0 = time.perf_counter()
        self._changed.update(dict.fromkeys(prepared.commit(state)))
        seconds = time.perf_counter() - t0
        update = prepared.update
        self.version, self.digest = update.version, update.digest
        self.num_applied += 1
        self.last.update(
            {
                "weight_sync/apply_s": seconds,
                "weight_sync/changed_fraction": update.changed_fraction,
                "weight_sync/is_full": float(update.is_full),
            }
        )
        return seconds

    def take_changed(self) -> list[str]:
        """The names of the tensors committed since the last call (what an engine reloads)."""
        changed, self._changed = list(self._changed), {}
        return changed

    def poll(
        self, state: dict[str, torch.Tensor], have_version: int | None
    ) -> tuple[WeightUpdate | None, float]:
        """Apply every available update on top of ``have_version``; returns the last update
        applied (or None) and the seconds the state was paused for (decode and apply; the
        apply only, with ``prefetch``)."""
        if self.prefetch:
            return self._poll_prefetched(state, have_version)
        applied, seconds = None, 0.0
        for _ in range(10_000):  # each step moves the version; a bound against surprises
            t0 = time.perf_counter()
            prepared = self.prepare(state, have_version)
            if prepared is None:
                break
            self.commit(state, prepared)
            seconds += time.perf_counter() - t0
            applied, have_version = prepared.update, prepared.update.version
        return applied, seconds

    # -- background prefetch -------------------------------------------------------------
    def _poll_prefetched(
        self, state: dict[str, torch.Tensor], have_version: int | None
    ) -> tuple[WeightUpdate | None, float]:
        if self._thread is None:
            self.version = have_version
            self._thread = threading.Thread(
                target=self._prefetch_loop,
                args=(state,),
                name="loomrl-weights-prefetch",
                daemon=True,
            )
            self._thread.start()
        if not self._lock.acquire(blocking=False):  # still verifying: apply next time
            return None, 0.0
        try:
            ready, self._ready = self._ready, None
            if ready is None or not (
                ready.update.is_full or ready.update.base_version == self.version
            ):
                return None, 0.0
            return ready.update, self.commit(state, ready)
        finally:
            self._lock.release()

    def _prefetch_loop(self, state: dict[str, torch.Tensor]) -> None:
        while not self._stop.is_set():
            with self._lock:
                if self._ready is None:
                    self._ready = self.prepare(state, self.version)
                busy = self._ready is not None
            self._stop.wait(0.05 if busy else self.receiver.poll_interval_s * 10)

    def metrics(self) -> dict[str, float]:
        """``weight_sync/*`` metrics of the last update applied and the running counts."""
        stats = self.receiver.stats
        return {
            **self.last,
            "weight_sync/apply_failures": float(self.failures),
            "weight_sync/num_applied": float(self.num_applied),
            "weight_sync/bytes_received": float(stats.bytes_received),
            "weight_sync/receive_failures": float(stats.failures),
            "weight_sync/num_fulls_received": float(stats.num_fulls),
        }

    def close(self) -> None:
        """Stop the prefetch thread, if any."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
