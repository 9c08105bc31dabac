"""The tensor lane's update: the published weights as one flat device buffer, no byte codec.

``pack_update`` casts a state dict into one flat ``uint8`` buffer on a device (each tensor
a slice of it, in name order, all in the published dtype) and digests it there. The buffer
travels as it is (a shared object in one process, a CUDA IPC handle to another process on
the same device, NCCL or gloo broadcasts across devices), and the receiver recomputes the
digest on its own copy before anything is written into its mirror: a mismatch raises
``WeightUpdateError``, as a failed crc32 does on the byte lane.

On a GPU the digest is exact integer arithmetic on the device: the buffer read as int16
words ``x`` and, per chunk of 2**24 words, ``sum(x)`` and ``sum(x * w)`` with odd weights
``w`` that vary with the position. Every term is below 2**31 and every chunk sum below
2**55, so the sums are exact in int64 in any reduction order, and any change confined to
one word (every single-bit flip) changes the second sum. On a CPU it is the crc32 of the
bytes (``buffer_digest``; the digest names its method and the receiver checks with that
one). Like the byte lane's crc32 it guards against corruption (torn copies, truncation, a
stale buffer), not against an adversary. Tensor updates are always full snapshots: at
device speed a delta buys nothing, so a receiver that missed versions takes the latest.
"""

from __future__ import annotations

import hashlib
import json
import logging
import zlib
from dataclasses import dataclass

import torch

from loomrl.weights.manifest import WeightUpdateError, parse_dtype

logger = logging.getLogger(__name__)

CODEC_TENSOR = "tensor"
_CHUNK_WORDS = 1 << 24
_weights_by_device: dict[torch.device, torch.Tensor] = {}


@dataclass(frozen=True)
class TensorSlot:
    """Where one tensor lies in the flat buffer (bytes)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int
    nbytes: int


def layout_of(state: dict[str, torch.Tensor], dtype: torch.dtype) -> list[TensorSlot]:
    """The slots of ``state`` cast to ``dtype``, in name order, back to back (one dtype, so
    every offset is a multiple of its item size)."""
    slots, offset, itemsize = [], 0, torch.empty(0, dtype=dtype).element_size()
    for name in sorted(state):
        shape = tuple(state[name].shape)
        nbytes = state[name].numel() * itemsize
        slots.append(TensorSlot(name, shape, str(dtype), offset, nbytes))
        offset += nbytes
    return slots


def _position_weights(device: torch.device, num_words: int) -> torch.Tensor:
    """Odd int32 weights below 2**16 for (up to) one chunk, kept per device and grown when a
    larger buffer comes (a power of two words, at most a chunk)."""
    w = _weights_by_device.get(device)
    if w is None or w.numel() < min(num_words, _CHUNK_WORDS):
        size = min(_CHUNK_WORDS, 1 << max(num_words - 1, 1).bit_length())
        i = torch.arange(size, dtype=torch.int64, device=device)
        w = _weights_by_device[device] = ((i * 40503 + 12345) % 32768 * 2 + 1).to(torch.int32)
    return w


def device_sums(flat: torch.Tensor) -> list[int]:
    """``[sum(x), sum(x * w)]`` per chunk of the buffer read as int16 words, computed on its
    device (one host sync for the result)."""
    if flat.numel() % 2:
        raise ValueError(f"a tensor-lane buffer holds whole 16-bit words, got {flat.numel()} bytes")
    words = flat.view(torch.int16)
    if words.numel() == 0:
        return []
    weights = _position_weights(flat.device, words.numel())
    sums = []
    for start in range(0, words.numel(), _CHUNK_WORDS):
        x = words[start : start + _CHUNK_WORDS]
        sums.append(x.sum(dtype=torch.int64))
        # int16 * int32 is computed in int32 (|x * w| < 2**31), summed in int64: no int64 temporary
        sums.append((x * weights[: x.numel()]).sum(dtype=torch.int64))
    return torch.stack(sums).tolist()


def buffer_digest(slots: list[TensorSlot], flat: torch.Tensor, method: str | None = None) -> str:
    """``method:hex``, a blake2b-128 of the layout and of the buffer's check values: the
    device sums (``sums``, the default on a GPU) or the crc32 of the bytes (``crc32``, the
    default on a CPU, where torch's integer reductions run at a few hundred MB/s and zlib at
    several GB/s). A receiver checks with the method the sender named."""
    method = method or ("crc32" if flat.device.type == "cpu" else "sums")
    if method == "crc32":
        values = [zlib.crc32(flat.cpu().numpy())]
    elif method == "sums":
        values = device_sums(flat)
    else:
        raise WeightUpdateError(f"unknown tensor-lane digest method {method!r}")
    h = hashlib.blake2b(digest_size=16)
    for s in slots:
        h.update(f"{s.name}|{s.dtype}|{list(s.shape)}|{s.offset}|{s.nbytes}\n".encode())
    h.update(",".join(map(str, values)).encode())
    return f"{method}:{h.hexdigest()}"


@dataclass
class TensorUpdate:
    """A full snapshot as one flat buffer; quacks like ``WeightUpdate`` where transports and
    subscribers read it (versions, digest, sizes, ``prepare``)."""

    version: int
    flat: torch.Tensor  # uint8 [nbytes], on the device it travelled to
    slots: list[TensorSlot]
    digest: str
    base_version: None = None
    codec: str = CODEC_TENSOR
    base_digest: str = ""

    is_full = True
    changed_fraction = 1.0

    @property
    def nbytes(self) -> int:
        return int(self.flat.numel())

    @property
    def model_nbytes(self) -> int:
        return int(self.flat.numel())

    def tensors(self) -> dict[str, torch.Tensor]:
        """Each tensor as a view of the flat buffer."""
        return {
            s.name: self.flat[s.offset : s.offset + s.nbytes]
            .view(parse_dtype(s.dtype))
            .view(s.shape)
            for s in self.slots
        }

    def manifest(self) -> dict:
        """Everything but the buffer, as JSON-able data (what a broadcast or a mailbox sends)."""
        return {
            "version": self.version,
            "digest": self.digest,
            "nbytes": self.nbytes,
            "slots": [[s.name, list(s.shape), s.dtype, s.offset, s.nbytes] for s in self.slots],
        }

    @classmethod
    def from_manifest(cls, manifest: dict, flat: torch.Tensor) -> TensorUpdate:
        """Inverse of ``manifest()`` with the buffer received; checks the slots tile it."""
        try:
            slots = [
                TensorSlot(str(n), tuple(int(d) for d in shape), str(dt), int(o), int(b))
                for n, shape, dt, o, b in manifest["slots"]
            ]
            version, digest, nbytes = (
                int(manifest["version"]),
                str(manifest["digest"]),
                int(manifest["nbytes"]),
            )
        except (KeyError, TypeError, ValueError) as err:
            raise WeightUpdateError(f"malformed tensor-lane manifest: {err!r}") from None
        pos = 0
        for s in slots:
            numel = 1
            for d in s.shape:
                numel *= d
            if s.offset != pos or s.nbytes != numel * parse_dtype(s.dtype).itemsize:
                raise WeightUpdateError(
                    f"tensor-lane manifest: slot {s.name!r} does not tile the buffer"
                )
            pos += s.nbytes
        if pos != nbytes or flat.numel() != nbytes:
            raise WeightUpdateError(
                f"tensor-lane buffer of {flat.numel()} bytes, manifest says {nbytes}"
            )
        return cls(version, flat, slots, digest)

    def header(self) -> bytes:
        return json.dumps(self.manifest(), separators=(",", ":")).encode()

    def prepare(
        self,
        state: dict[str, torch.Tensor],
        *,
        have_version: int | None = None,
        have_digest: str | None = None,
    ) -> PreparedTensorUpdate:
        """Verify the buffer against the digest (on its device); nothing is written yet."""
        digest = buffer_digest(self.slots, self.flat, self.digest.partition(":")[0])
        if digest != self.digest:
            raise WeightUpdateError(
                f"tensor update {self.version}: device digest {digest} does not match the sender's {self.digest}"
            )
        return PreparedTensorUpdate(self)


@dataclass
class PreparedTensorUpdate:
    """A verified tensor update, ready to be copied into the state it was checked for."""

    update: TensorUpdate

    def commit(self, state: dict[str, torch.Tensor]) -> list[str]:
        """Copy every tensor into ``state`` (device to device where they share one); returns
        the names written (all of them: a tensor update is a full snapshot)."""
        with torch.no_grad():
            for name, src in self.update.tensors().items():
                target = state.get(name)
                if target is None or target.shape != src.shape or target.dtype != src.dtype:
                    device = target.device if target is not None else src.device
                    state[name] = src.to(device, copy=True)
                else:
                    target.copy_(src, non_blocking=True)
        return [s.name for s in self.update.slots]


def pack_into(flat: torch.Tensor, slots: list[TensorSlot], state: dict[str, torch.Tensor]) -> None:
    """Cast each tensor of ``state`` into its slot of ``flat`` (on ``flat``'s device)."""
    with torch.no_grad():
        for s in slots:
            view = flat[s.offset : s.offset + s.nbytes].view(parse_dtype(s.dtype)).view(s.shape)
            view.copy_(state[s.name].detach())


def pack_update(
    state: dict[str, torch.Tensor],
    dtype: torch.dtype,
    version: int,
    out: torch.Tensor | None = None,
    device: torch.device | None = None,
) -> TensorUpdate:
    """``state`` cast to ``dtype`` into ``out`` (or a fresh buffer on ``device``, by default
    that of ``state``'s first tensor) and digested there."""
    slots = layout_of(state, dtype)
    nbytes = slots[-1].offset + slots[-1].nbytes if slots else 0
    if out is None:
        if device is None:
            device = next(iter(state.values())).device if state else torch.device("cpu")
        out = torch.empty(nbytes, dtype=torch.uint8, device=device)
    elif out.numel() != nbytes or out.dtype != torch.uint8:
        raise ValueError(f"pack_update: buffer of {out.numel()} {out.dtype} for {nbytes} bytes")
    pack_into(out, slots, state)
    return TensorUpdate(version, out, slots, buffer_digest(slots, out))
