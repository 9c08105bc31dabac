"""The manifest of a weight update, its checksums and its byte framing.

A serialized update is::

    MAGIC (8 bytes) | manifest length (u64 LE) | crc32 of the manifest (u32 LE) | manifest | payload

The manifest is JSON: versions, full or delta, codec, the digest of the model the update
produces (and of the base a delta needs), and one entry per tensor with its name, shape,
dtype, checksum, encoding mode and the slice of the payload that holds it. Every byte of
the framing is covered by a check: the manifest by its crc32, each compressed chunk by its
own crc32, each raw chunk by the tensor checksum, and the chunks must tile the payload.

Checksums are crc32 (``zlib.crc32``, ~7 GB/s on one core here, against ~1.4 GB/s for
blake2b): they guard against corruption and wrong bases, not against an adversary. The
whole-model digest is a blake2b-128 over every tensor's name, dtype, shape and crc32.
"""

from __future__ import annotations

import hashlib
import json
import logging
import struct
import zlib
from dataclasses import dataclass, fields

import numpy as np
import torch

logger = logging.getLogger(__name__)

MAGIC = b"LOOMWU2\0"
FORMAT_VERSION = 2
_PREFIX = struct.Struct("<8sQI")  # magic, manifest length, manifest crc32

# Encoding modes of one tensor inside an update.
MODE_RAW = "raw"  # the tensor's bytes, as they are
MODE_SAME = "same"  # unchanged from the base: no bytes
MODE_SPARSE = "sparse"  # zstd(index gaps, byte planes | changed XOR values, byte planes)
MODE_BITMAP = "bitmap"  # zstd(bitmap of changed elements | changed XOR values, byte planes)
MODE_DENSE = "dense"  # zstd(XOR of the whole tensor, byte planes)
MODES = (MODE_RAW, MODE_SAME, MODE_SPARSE, MODE_BITMAP, MODE_DENSE)


class WeightUpdateError(ValueError):
    """An update that cannot be applied: wrong base, failed checksum, truncated payload."""


def bits_view(t: torch.Tensor) -> np.ndarray:
    """The tensor's bit patterns as a flat unsigned-integer numpy array (shares memory when
    the tensor is a contiguous CPU tensor)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    size = t.element_size()
    signed = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(size)
    if signed is None:
        return t.view(torch.uint8).numpy()
    unsigned = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[size]
    return t.view(signed).numpy().view(unsigned)


def checksum(bits: np.ndarray | bytes | memoryview, running: int = 0) -> int:
    """crc32 of a contiguous buffer (continuing from ``running``)."""
    return zlib.crc32(bits, running)


def parse_dtype(name: str) -> torch.dtype:
    """``"torch.bfloat16"`` -> ``torch.bfloat16``; a clear error for anything else."""
    attr = name.removeprefix("torch.")
    dtype = getattr(torch, attr, None)
    if not isinstance(dtype, torch.dtype):
        raise WeightUpdateError(f"unknown dtype {name!r} in manifest")
    return dtype


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of an update; ``checksum`` is the crc32 of the resulting tensor's bytes."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    checksum: int
    mode: str
    offset: int = 0
    nbytes: int = 0
    changed: int = 0  # elements whose bits differ from the base (all of them for raw)
    chunk_checksum: int = 0  # crc32 of the payload slice (compressed modes)
    gap_bytes: int = 0  # width of one index gap (sparse mode)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def to_json(self) -> dict:
        # asdict's keys and order, without its deep copies
        out = {name: getattr(self, name) for name in _ENTRY_FIELDS}
        out["shape"] = list(self.shape)
        return out

    @classmethod
    def from_json(cls, raw: dict) -> TensorEntry:
        try:
            entry = cls(
                name=str(raw["name"]),
                shape=tuple(int(d) for d in raw["shape"]),
                dtype=str(raw["dtype"]),
                checksum=int(raw["checksum"]),
                mode=str(raw["mode"]),
                offset=int(raw["offset"]),
                nbytes=int(raw["nbytes"]),
                changed=int(raw["changed"]),
                chunk_checksum=int(raw["chunk_checksum"]),
                gap_bytes=int(raw["gap_bytes"]),
            )
        except (KeyError, TypeError, ValueError) as err:
            raise WeightUpdateError(f"malformed tensor entry in manifest: {err!r}") from None
        if entry.mode not in MODES or any(d < 0 for d in entry.shape) or entry.nbytes < 0:
            raise WeightUpdateError(f"invalid tensor entry {entry.name!r} in manifest")
        parse_dtype(entry.dtype)
        return entry


_ENTRY_FIELDS = tuple(f.name for f in fields(TensorEntry))


def digest_of(entries: list[TensorEntry] | list[tuple[str, str, tuple[int, ...], int]]) -> str:
    """Whole-model digest from each tensor's (name, dtype, shape, crc32), in name order."""
    rows = [
        (e.name, e.dtype, tuple(e.shape), e.checksum) if isinstance(e, TensorEntry) else e
        for e in entries
    ]
    h = hashlib.blake2b(digest_size=16)
    for name, dtype, shape, crc in sorted(rows):
        h.update(f"{name}|{dtype}|{list(shape)}|{crc:08x}\n".encode())
    return h.hexdigest()


def state_digest(state: dict[str, torch.Tensor]) -> str:
    """Digest of a whole state dict: names, dtypes, shapes and exact bits."""
    return digest_of(
        [(k, str(t.dtype), tuple(t.shape), checksum(bits_view(t))) for k, t in state.items()]
    )


def pack_frame(manifest: dict) -> bytes:
    """The bytes that precede the payload: prefix plus JSON manifest."""
    head = json.dumps(manifest, separators=(",", ":")).encode()
    return _PREFIX.pack(MAGIC, len(head), zlib.crc32(head)) + head


def unpack_frame(
    data: bytes | bytearray | memoryview, payload: bytes | bytearray | memoryview | None = None
) -> tuple[dict, memoryview]:
    """Split serialized bytes into the verified manifest and the payload (no copy). With
    ``payload`` given, ``data`` holds only the header (as from ``WeightUpdate.frames``)."""
    view = memoryview(data).cast("B")
    if len(view) < _PREFIX.size:
        raise WeightUpdateError(f"truncated weight update: {len(view)} bytes")
    magic, head_len, head_crc = _PREFIX.unpack_from(view, 0)
    if magic != MAGIC:
        raise WeightUpdateError("not a loomrl weight update (bad magic)")
    start = _PREFIX.size
    if start + head_len > len(view):
        raise WeightUpdateError(
            f"truncated weight update: manifest needs {head_len} bytes, {len(view) - start} left"
        )
    head = view[start : start + head_len]
    if zlib.crc32(head) != head_crc:
        raise WeightUpdateError("corrupted manifest (crc32 mismatch)")
    try:
        manifest = json.loads(bytes(head))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise WeightUpdateError(f"corrupted manifest: {err}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_VERSION:
        raise WeightUpdateError(f"unsupported weight update format {manifest!r:.80}")
    if payload is None:
        payload = view[start + head_len :]
    else:
        if len(view) != start + head_len:
            raise WeightUpdateError("header frame has trailing bytes")
        payload = memoryview(payload).cast("B")
    if len(payload) != manifest.get("payload_nbytes"):
        raise WeightUpdateError(
            f"truncated payload: {len(payload)} bytes, manifest says {manifest.get('payload_nbytes')}"
        )
    return manifest, payload


def check_tiling(entries: list[TensorEntry], payload_nbytes: int) -> None:
    """The chunks must tile the payload exactly, so that no byte goes unchecked."""
    pos = 0
    for e in entries:
        if e.offset != pos:
            raise WeightUpdateError(f"tensor {e.name!r}: chunk at {e.offset}, expected {pos}")
        pos += e.nbytes
    if pos != payload_nbytes:
        raise WeightUpdateError(f"chunks cover {pos} bytes of a {payload_nbytes}-byte payload")
