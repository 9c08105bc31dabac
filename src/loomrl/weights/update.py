"""WeightUpdate: a manifest plus payload taking a receiver from version a to version b.

This first version carries full copies only; the delta codec plugs in behind the same API.
"""

from __future__ import annotations

import hashlib
import io
import json
import struct
from dataclasses import dataclass, field

import torch

MAGIC = b"LOOMWU1\0"


class WeightUpdateError(ValueError):
    """An update that cannot be applied: wrong base, failed checksum, truncated payload."""


def _tensor_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().contiguous().cpu()
    if t.numel() == 0:
        return b""
    return t.view(torch.uint8).numpy().tobytes() if t.dim() else t.reshape(1).view(torch.uint8).numpy().tobytes()


def _checksum(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def state_digest(state: dict[str, torch.Tensor]) -> str:
    """Digest of a whole state dict: names, dtypes, shapes and exact bits."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(state):
        t = state[name]
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(_tensor_bytes(t))
    return h.hexdigest()


@dataclass
class WeightUpdate:
    version: int
    base_version: int | None  # None: a full update
    codec: str
    tensors: list[dict] = field(default_factory=list)  # name, shape, dtype, checksum, offset, nbytes
    digest: str = ""
    payload: bytes = b""

    @property
    def is_full(self) -> bool:
        return self.base_version is None

    @property
    def nbytes(self) -> int:
        return len(self.payload)

    def manifest(self) -> dict:
        return {
            "version": self.version,
            "base_version": self.base_version,
            "codec": self.codec,
            "tensors": self.tensors,
            "digest": self.digest,
            "payload_nbytes": len(self.payload),
        }

    def to_bytes(self) -> bytes:
        head = json.dumps(self.manifest(), separators=(",", ":")).encode()
        return MAGIC + struct.pack("<Q", len(head)) + head + self.payload

    @classmethod
    def from_bytes(cls, data: bytes) -> WeightUpdate:
        if len(data) < len(MAGIC) + 8 or data[: len(MAGIC)] != MAGIC:
            raise WeightUpdateError("not a loomrl weight update (bad magic or too short)")
        (head_len,) = struct.unpack_from("<Q", data, len(MAGIC))
        start = len(MAGIC) + 8
        try:
            manifest = json.loads(data[start : start + head_len])
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise WeightUpdateError(f"corrupted manifest: {err}") from None
        payload = data[start + head_len :]
        if len(payload) != manifest.get("payload_nbytes"):
            raise WeightUpdateError(
                f"truncated payload: {len(payload)} bytes, manifest says {manifest.get('payload_nbytes')}"
            )
        return cls(
            version=manifest["version"],
            base_version=manifest["base_version"],
            codec=manifest["codec"],
            tensors=manifest["tensors"],
            digest=manifest["digest"],
            payload=payload,
        )


_DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.uint8, torch.int8, torch.bool)}


def encode_update(
    base: dict[str, torch.Tensor] | None,
    new: dict[str, torch.Tensor],
    *,
    version: int,
    base_version: int | None,
) -> WeightUpdate:
    """Encode ``new`` (full copy; ``base`` is accepted for API compatibility)."""
    buf = io.BytesIO()
    tensors = []
    for name in sorted(new):
        data = _tensor_bytes(new[name])
        tensors.append(
            {
                "name": name,
                "shape": list(new[name].shape),
                "dtype": str(new[name].dtype),
                "checksum": _checksum(data),
                "offset": buf.tell(),
                "nbytes": len(data),
            }
        )
        buf.write(data)
    return WeightUpdate(version, None, "full", tensors, state_digest(new), buf.getvalue())


def apply_update(state: dict[str, torch.Tensor], update: WeightUpdate) -> None:
    """Apply ``update`` to ``state`` in place; on any error ``state`` is left unchanged."""
    decoded: dict[str, torch.Tensor] = {}
    for meta in update.tensors:
        chunk = update.payload[meta["offset"] : meta["offset"] + meta["nbytes"]]
        if len(chunk) != meta["nbytes"] or _checksum(chunk) != meta["checksum"]:
            raise WeightUpdateError(f"checksum mismatch in tensor {meta['name']!r}")
        dtype = _DTYPES[meta["dtype"]]
        t = torch.frombuffer(bytearray(chunk), dtype=torch.uint8) if chunk else torch.empty(0, dtype=torch.uint8)
        decoded[meta["name"]] = t.view(dtype).reshape(meta["shape"]).clone()
    if state_digest(decoded) != update.digest:
        raise WeightUpdateError(f"digest mismatch for version {update.version}")
    for name, t in decoded.items():
        if name in state and state[name].shape == t.shape and state[name].dtype == t.dtype:
            state[name].copy_(t)
        else:
            state[name] = t
