"""WeightUpdate: a manifest plus payload taking a receiver from version a to version b.

``encode_update(None, new, ...)`` gives a full update (raw bytes); with a base it gives a
lossless delta (``loomrl.weights.codec``). ``apply_update`` decodes every tensor into
temporaries, verifies each tensor's crc32 and the whole-model digest, and only then writes
into ``state``: on any error ``state`` is left unchanged and a ``WeightUpdateError`` says why.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from loomrl.weights.codec import CodecOptions, DecodedTensor, decode_tensor, encode_delta
from loomrl.weights.manifest import (
    FORMAT_VERSION,
    MODE_RAW,
    TensorEntry,
    WeightUpdateError,
    bits_view,
    check_tiling,
    checksum,
    digest_of,
    pack_frame,
    parse_dtype,
    state_digest,
    unpack_frame,
)

logger = logging.getLogger(__name__)

CODEC_FULL = "raw"
CODEC_DELTA = "xor-zstd"

__all__ = [
    "WeightUpdate",
    "WeightUpdateError",
    "PreparedUpdate",
    "apply_update",
    "encode_update",
    "prepare_update",
    "state_digest",
]


@dataclass
class WeightUpdate:
    """Takes a state from ``base_version`` (None: from anything, a full update) to ``version``."""

    version: int
    base_version: int | None  # None: a full update
    codec: str
    tensors: list[TensorEntry] = field(default_factory=list)
    digest: str = ""  # digest of the model this update produces
    payload: bytes | bytearray | memoryview = b""
    base_digest: str = ""  # digest of the model a delta applies to ("" for a full update)

    @property
    def is_full(self) -> bool:
        return self.base_version is None

    @property
    def nbytes(self) -> int:
        """Serialized size: manifest plus payload."""
        return len(self.header()) + memoryview(self.payload).nbytes

    @property
    def model_nbytes(self) -> int:
        """Size of the model this update produces, as raw tensors."""
        return sum(e.numel * parse_dtype(e.dtype).itemsize for e in self.tensors)

    @property
    def changed_fraction(self) -> float:
        """Fraction of elements whose bits differ from the base (1.0 for a full update)."""
        numel = sum(e.numel for e in self.tensors)
        return sum(e.changed for e in self.tensors) / numel if numel else 0.0

    def prepare(
        self,
        state: dict[str, torch.Tensor],
        *,
        have_version: int | None = None,
        have_digest: str | None = None,
    ) -> PreparedUpdate:
        """``prepare_update(state, self, ...)``: what a subscriber calls on any lane's update."""
        return prepare_update(state, self, have_version=have_version, have_digest=have_digest)

    def manifest(self) -> dict:
        return {
            "format": FORMAT_VERSION,
            "version": self.version,
            "base_version": self.base_version,
            "codec": self.codec,
            "digest": self.digest,
            "base_digest": self.base_digest,
            "payload_nbytes": memoryview(self.payload).nbytes,
            "tensors": [e.to_json() for e in self.tensors],
        }

    def header(self) -> bytes:
        """The serialized bytes before the payload."""
        return pack_frame(self.manifest())

    def frames(self) -> tuple[bytes, memoryview]:
        """``to_bytes()`` as two pieces (header, payload), for transports that avoid a copy."""
        return self.header(), memoryview(self.payload).cast("B")

    def to_bytes(self) -> bytes:
        header, payload = self.frames()
        return header + payload

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> WeightUpdate:
        """Parse and check the framing (the payload is referenced, not copied)."""
        return cls.from_frames(data, None)

    @classmethod
    def from_frames(
        cls, header: bytes | bytearray | memoryview, payload: bytes | bytearray | memoryview | None
    ) -> WeightUpdate:
        """Inverse of ``frames()``; ``payload`` None: ``header`` holds the whole update."""
        manifest, payload = unpack_frame(header, payload)
        raw_tensors = manifest.get("tensors")
        if not isinstance(raw_tensors, list):
            raise WeightUpdateError("malformed manifest: no tensor list")
        tensors = [TensorEntry.from_json(t) for t in raw_tensors]
        check_tiling(tensors, len(payload))
        try:
            version = int(manifest["version"])
            base = manifest["base_version"]
            base_version = None if base is None else int(base)
            update = cls(
                version,
                base_version,
                str(manifest["codec"]),
                tensors,
                str(manifest["digest"]),
                payload,
                str(manifest["base_digest"]),
            )
        except (KeyError, TypeError, ValueError) as err:
            raise WeightUpdateError(f"malformed manifest: {err!r}") from None
        if update.is_full and any(t.mode != MODE_RAW for t in tensors):
            raise WeightUpdateError("a full update may only hold raw tensors")
        return update


def _encode_entry(
    name: str, t: torch.Tensor, old: torch.Tensor | None, offset: int, opts: CodecOptions
) -> tuple[TensorEntry, Any]:
    """One tensor's manifest entry and payload chunk: raw bits, or a delta against ``old``
    when ``old`` has the same shape and dtype."""
    bits = bits_view(t)
    shape, dtype = tuple(t.shape), str(t.dtype)
    if old is None or tuple(old.shape) != shape or old.dtype != t.dtype:
        return TensorEntry(
            name, shape, dtype, checksum(bits), MODE_RAW, offset, bits.nbytes, bits.size
        ), bits
    enc = encode_delta(bits_view(old), bits, opts)
    nbytes = len(enc.chunk)
    entry = TensorEntry(
        name,
        shape,
        dtype,
        enc.checksum,
        enc.mode,
        offset,
        nbytes,
        enc.changed,
        checksum(enc.chunk) if nbytes else 0,
        enc.gap_bytes,
    )
    return entry, enc.chunk


def _join_chunks(entries: list[TensorEntry], chunks: list, nbytes: int) -> bytearray:
    """The payload: every chunk at its entry's offset."""
    payload = bytearray(nbytes)
    out = np.frombuffer(payload, dtype=np.uint8)
    for entry, chunk in zip(entries, chunks, strict=True):
        if entry.nbytes:
            out[entry.offset : entry.offset + entry.nbytes] = np.frombuffer(chunk, dtype=np.uint8)
    return payload


def encode_update(
    base: dict[str, torch.Tensor] | None,
    new: dict[str, torch.Tensor],
    *,
    version: int,
    base_version: int | None,
    base_digest: str | None = None,
    options: CodecOptions | None = None,
) -> WeightUpdate:
    """Encode ``new`` as a full update (``base`` None) or as a delta against ``base``.

    Both are state dicts in the published dtype. ``base_digest`` (the digest of ``base``,
    which a publisher already knows) saves a pass over ``base``.
    """
    opts = options or CodecOptions()
    if base is not None and base_version is None:
        raise ValueError("a delta needs base_version (the version of `base`)")
    entries: list[TensorEntry] = []
    chunks: list = []
    offset = 0
    for name in sorted(new):
        old = base.get(name) if base is not None else None
        entry, chunk = _encode_entry(name, new[name], old, offset, opts)
        entries.append(entry)
        chunks.append(chunk)
        offset += entry.nbytes
    payload = _join_chunks(entries, chunks, offset)
    if base is None:
        return WeightUpdate(version, None, CODEC_FULL, entries, digest_of(entries), payload)
    if base_digest is None:
        base_digest = state_digest(base)
    return WeightUpdate(
        version, base_version, CODEC_DELTA, entries, digest_of(entries), payload, base_digest
    )


@dataclass
class PreparedUpdate:
    """A decoded and verified update, ready to be written into the state it was checked
    against. Preparing only reads the state, so it may run while the state is in use."""

    update: WeightUpdate
    decoded: list[DecodedTensor]

    def commit(self, state: dict[str, torch.Tensor]) -> list[str]:
        """Write the update into ``state``; returns the names of the tensors it changed."""
        changed = []
        for d in self.decoded:
            if d.values is None:
                continue
            changed.append(d.entry.name)
            _commit_tensor(state, d)
        return changed


def _as_tensor(bits: np.ndarray, entry: TensorEntry) -> torch.Tensor:
    dtype = parse_dtype(entry.dtype)
    signed = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}[bits.dtype.itemsize]
    return torch.from_numpy(bits.view(signed)).view(dtype).reshape(entry.shape)


def _commit_tensor(state: dict[str, torch.Tensor], d: DecodedTensor) -> None:
    entry, target = d.entry, state.get(d.entry.name)
    fits = (
        target is not None
        and tuple(target.shape) == entry.shape
        and str(target.dtype) == entry.dtype
    )
    if not fits:  # a new tensor, or a full update that changes its shape or dtype
        state[entry.name] = _as_tensor(d.values.copy(), entry)
        return
    in_place = target.device.type == "cpu" and target.is_contiguous() and target.numel() > 0
    if in_place:
        bits = bits_view(target)  # shares memory with target
        if d.where is None:
            bits[:] = d.values
        else:
            bits[d.where] = d.values
        return
    if d.where is None:
        target.copy_(_as_tensor(d.values, entry))
    else:
        bits = bits_view(target).copy()
        bits[d.where] = d.values
        target.copy_(_as_tensor(bits, entry))


def _check_base(update: WeightUpdate, have_version: int | None, have_digest: str | None) -> None:
    """Reject a delta for another base before any decoding."""
    if update.is_full:
        return
    if have_version is not None and have_version != update.base_version:
        raise WeightUpdateError(
            f"delta {update.base_version}->{update.version} does not apply to version "
            f"{have_version}"
        )
    if have_digest and update.base_digest and have_digest != update.base_digest:
        raise WeightUpdateError(
            f"delta {update.base_version}->{update.version}: state digest {have_digest} "
            f"is not the base digest {update.base_digest}"
        )


def _decode_entry(
    state: dict[str, torch.Tensor], update: WeightUpdate, entry: TensorEntry, payload: memoryview
) -> DecodedTensor:
    """Decode (and verify) one tensor of ``update``; a delta's base is read from ``state``."""
    base_bits = None
    if entry.mode != MODE_RAW:
        target = state.get(entry.name)
        if target is None or tuple(target.shape) != entry.shape or str(target.dtype) != entry.dtype:
            raise WeightUpdateError(
                f"delta {update.base_version}->{update.version}: state has no tensor "
                f"{entry.name!r} of shape {list(entry.shape)} and dtype {entry.dtype} "
                "(wrong base?)"
            )
        base_bits = bits_view(target)
    bits_dtype = bits_view(torch.empty(0, dtype=parse_dtype(entry.dtype))).dtype
    chunk = payload[entry.offset : entry.offset + entry.nbytes]
    return decode_tensor(entry, chunk, base_bits, bits_dtype)


def prepare_update(
    state: dict[str, torch.Tensor],
    update: WeightUpdate,
    *,
    have_version: int | None = None,
    have_digest: str | None = None,
) -> PreparedUpdate:
    """Decode and verify ``update`` against ``state`` without modifying it.

    ``have_version`` / ``have_digest`` (the version and digest the caller knows ``state`` to
    be at) reject a delta for another base before any decoding; without them a wrong base is
    still caught by the checksums.
    """
    _check_base(update, have_version, have_digest)
    payload = memoryview(update.payload).cast("B")
    check_tiling(update.tensors, len(payload))
    decoded = [_decode_entry(state, update, entry, payload) for entry in update.tensors]
    digest = digest_of(update.tensors)  # each entry's checksum was verified on its result
    if digest != update.digest:
        raise WeightUpdateError(
            f"update {update.version}: model digest {digest} does not match the manifest's "
            f"{update.digest}"
        )
    return PreparedUpdate(update, decoded)


def apply_update(
    state: dict[str, torch.Tensor],
    update: WeightUpdate,
    *,
    have_version: int | None = None,
    have_digest: str | None = None,
) -> list[str]:
    """Apply ``update`` to ``state`` in place; on any error ``state`` is left unchanged and
    ``WeightUpdateError`` is raised. Returns the names of the tensors that changed."""
    prepared = prepare_update(state, update, have_version=have_version, have_digest=have_digest)
    return prepared.commit(state)
