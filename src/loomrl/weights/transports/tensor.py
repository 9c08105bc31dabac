"""The tensor lane: weights move as device tensors, without the byte codec.

A ``Publisher`` whose sender ``carries_tensors`` packs the trainer's weights, cast to the
published dtype, into one flat buffer and digests it on the device
(``loomrl.weights.tensors``); the receiver verifies the digest on its own copy before the
subscriber writes anything into the generator's mirror. Three modes, one interface:

- ``local`` (executors are threads of one process): the buffer is handed over as an
  object; the generator copies it into its mirror device to device. The sender packs each
  version into a fresh buffer, so a receiver never reads one being rewritten.
- ``ipc`` (other processes on the same CUDA device): the sender packs into a ring of
  ``num_slots`` device buffers, shared once through CUDA IPC handles
  (``torch.multiprocessing.reductions.reduce_tensor``), and names the newest version, its
  slot and its layout in a private mailbox file in ``/dev/shm``. A receiver copies the slot
  into its own buffer and verifies that copy, so a slot rewritten while it was being read
  is refused by the digest and retried, never applied.
- ``broadcast`` (one process per device, or gloo on CPUs): a ``torch_dist`` group; the
  sender broadcasts the manifest and then the buffer itself in ``bucket_bytes`` slices
  (NCCL moves device memory with no host round trip). A receiving thread files each update.

Every mode keeps only the latest snapshot, so a generator that missed versions takes the
newest one. ``choose_lane`` picks the mode for a job, and falls back to the byte lane
(``shm``) with a log line where the tensor lane cannot work (CPU tensors in other processes).
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import uuid
from pathlib import Path
from typing import Any

import torch
from torch.multiprocessing.reductions import reduce_tensor

from loomrl.device import resolve_device
from loomrl.weights.manifest import WeightUpdateError
from loomrl.weights.tensors import TensorUpdate, pack_update
from loomrl.weights.transports.base import (
    Receiver,
    Sender,
    TransferStats,
    Transport,
    TransportError,
    UpdateRef,
)
from loomrl.weights.transports.shm import _check_private, _default_root
from loomrl.weights.transports.store import StoreReceiver, UpdateStore
from loomrl.weights.transports.torch_dist import (
    TorchDistReceiver,
    TorchDistSender,
    TorchDistTransport,
)

logger = logging.getLogger(__name__)

MODES = ("local", "ipc", "broadcast")


class TensorSender(Sender):
    """A sender the publisher hands device tensors: ``pack`` builds the update where this
    lane wants its buffer, ``send`` makes it available."""

    carries_tensors = True

    def pack(
        self, state: dict[str, torch.Tensor], dtype: torch.dtype, version: int
    ) -> TensorUpdate:
        return pack_update(state, dtype, version)


# -- local: one process ------------------------------------------------------------------


class LocalTensorSender(TensorSender):
    def __init__(self, store: UpdateStore) -> None:
        self.store, self.stats = store, TransferStats()

    def _put(self, update: TensorUpdate) -> None:
        self.store.put(update)


class LocalTensorReceiver(StoreReceiver):
    def __init__(self, store: UpdateStore) -> None:
        self.store, self.stats = store, TransferStats()


# -- ipc: other processes, same device ---------------------------------------------------


class _Mailbox:
    """A private file naming the newest update and the slots' IPC handles, replaced
    atomically by the sender. It starts with a 24-byte stamp (the sender's token and a
    write count), so a receiver unpickles it only when the stamp changed (a file's inode
    and coarse mtime can repeat between two quick writes)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.token = uuid.uuid4().bytes  # this end's; a sender stamps its writes with it
        self.count = 0
        self._stamp: bytes | None = None
        self._content: dict | None = None

    def write(self, content: dict) -> None:
        self.count += 1
        tmp = self.path.with_name(f"{self.path.name}.{uuid.uuid4().hex[:8]}.tmp")
        fd = os.open(
            tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
        )
        try:
            os.write(fd, self.token + self.count.to_bytes(8, "little") + pickle.dumps(content))
        finally:
            os.close(fd)
        os.replace(tmp, self.path)

    def read(self) -> dict | None:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        try:
            if os.pread(fd, 24, 0) == self._stamp:
                return self._content
            _check_private(fd, self.path)  # unpickled below: only a file of our own uid
            with os.fdopen(os.dup(fd), "rb") as f:
                data = f.read()
            self._stamp, self._content = data[:24], pickle.loads(data[24:])
            return self._content
        finally:
            os.close(fd)

    def unlink(self) -> None:
        self.path.unlink(missing_ok=True)


class IpcTensorSender(TensorSender):
    def __init__(self, t: TensorTransport) -> None:
        self.t, self.stats = t, TransferStats()
        self.mailbox = _Mailbox(t.mailbox_path)
        self.slots: list[torch.Tensor] = []
        self.handles: list[Any] = []
        self.generation = ""
        self.next_slot = 0

    def _ring(self, nbytes: int, device: torch.device) -> None:
        """(Re)allocate the ring when the model's size or device changed, and share it."""
        if self.slots and self.slots[0].numel() == nbytes and self.slots[0].device == device:
            return

        self.slots = [
            torch.zeros(nbytes, dtype=torch.uint8, device=device) for _ in range(self.t.num_slots)
        ]
        self.handles = [reduce_tensor(s) for s in self.slots]  # (rebuild function, args)
        self.generation = uuid.uuid4().hex  # receivers reopen the handles when it changes

    def pack(
        self, state: dict[str, torch.Tensor], dtype: torch.dtype, version: int
    ) -> TensorUpdate:
        device = next(iter(state.values())).device
        if device.type != "cuda":
            raise TransportError(
                f"tensor lane 'ipc' shares CUDA memory, but the weights are on {device}; "
                "use weight_sync.transport='shm' (the byte lane) for CPU executors"
            )
        nbytes = sum(t.numel() for t in state.values()) * torch.empty(0, dtype=dtype).element_size()
        self._ring(nbytes, device)
        slot, self.next_slot = self.next_slot, (self.next_slot + 1) % len(self.slots)
        return pack_update(state, dtype, version, out=self.slots[slot])

    def _put(self, update: TensorUpdate) -> None:
        slot = next(i for i, s in enumerate(self.slots) if s.data_ptr() == update.flat.data_ptr())
        torch.cuda.synchronize(update.flat.device)  # the slot is written before it is named
        self.mailbox.write(
            {
                "generation": self.generation,
                "handles": self.handles,
                "slot": slot,
                "manifest": update.manifest(),
            }
        )

    def close(self) -> None:
        self.mailbox.unlink()


class IpcTensorReceiver(Receiver):
    def __init__(self, t: TensorTransport) -> None:
        self.t, self.stats = t, TransferStats()
        self.mailbox = _Mailbox(t.mailbox_path)
        self.opened: tuple[str, list[torch.Tensor]] | None = None  # (generation, slots)

    def _list(self) -> list[UpdateRef]:
        box = self.mailbox.read()
        if box is None:
            return []
        return [UpdateRef(int(box["manifest"]["version"]), None, box)]

    def _slots(self, box: dict) -> list[torch.Tensor]:
        if self.opened is None or self.opened[0] != box["generation"]:
            self.opened = (box["generation"], [rebuild(*args) for rebuild, args in box["handles"]])
        return self.opened[1]

    def _fetch(self, ref: UpdateRef) -> TensorUpdate | None:
        box = ref.key
        try:
            src = self._slots(box)[box["slot"]]
        except RuntimeError as err:  # the handle does not open here (another device, no IPC)
            raise TransportError(
                f"tensor lane 'ipc': cannot open the trainer's CUDA memory ({err}); run the executors on one "
                "device or use weight_sync.transport='shm' or transport.mode='broadcast'"
            ) from err
        flat = src.clone()  # our own copy: the sender rewrites this slot later
        return TensorUpdate.from_manifest(box["manifest"], flat)


# -- broadcast: a torch_dist group -------------------------------------------------------


class BroadcastTensorSender(TorchDistSender, TensorSender):
    """Rank 0 of the group: announces, then broadcasts the manifest and the buffer."""

    def pack(
        self, state: dict[str, torch.Tensor], dtype: torch.dtype, version: int
    ) -> TensorUpdate:
        return pack_update(state, dtype, version, device=self.group.device)

    def _put(self, update: TensorUpdate) -> None:
        head = torch.frombuffer(bytearray(update.header()), dtype=torch.uint8)
        with self.lock:
            # signed, naming the version and digest the receivers check
            self._announce("update", update)
            self.group.broadcast(torch.tensor([head.numel(), update.nbytes], dtype=torch.int64))
            self.group.broadcast(head)
            for start in range(0, update.nbytes, self.t.bucket_bytes):
                self.group.broadcast(update.flat[start : start + self.t.bucket_bytes])


class BroadcastTensorReceiver(TorchDistReceiver):
    """Ranks 1..: a thread takes part in every broadcast into a fresh buffer on the group's
    device and files the update; the subscriber verifies it."""

    def _receive_one(self) -> TensorUpdate:
        meta = torch.empty(2, dtype=torch.int64)
        self.group.broadcast(meta)
        head_len, nbytes = (int(x) for x in meta)
        head = torch.empty(head_len, dtype=torch.uint8)
        self.group.broadcast(head)
        flat = torch.empty(nbytes, dtype=torch.uint8, device=self.group.device)
        for start in range(0, nbytes, self.t.bucket_bytes):
            self.group.broadcast(flat[start : start + self.t.bucket_bytes])
        if flat.is_cuda:  # NCCL's wait orders this thread's stream only: finish before filing it
            torch.cuda.current_stream(flat.device).synchronize()
        try:
            manifest = json.loads(bytes(head.numpy()))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise WeightUpdateError(f"corrupted tensor-lane manifest: {err}") from None
        return TensorUpdate.from_manifest(manifest, flat)


class _BroadcastLane(TorchDistTransport):
    name = "tensor"
    sender_class = BroadcastTensorSender
    receiver_class = BroadcastTensorReceiver


# -- the transport ---------------------------------------------------------------------


class TensorTransport(Transport):
    """``mode``: ``local``, ``ipc`` (``name`` identifies the channel on the host; a receiver
    in another process builds ``TensorTransport(mode="ipc", name=...)``) or ``broadcast``
    (the other keyword arguments are ``TorchDistTransport``'s: ``rank``, ``world_size``,
    ``init_method`` or ``store`` or ``group``, ``backend``, ``bucket_bytes``, ``timeout_s``)."""

    name = "tensor"

    def __init__(
        self,
        mode: str = "local",
        *,
        name: str | None = None,
        num_slots: int = 3,
        root: str | None = None,
        **dist_kwargs: Any,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"tensor lane mode must be one of {', '.join(MODES)}, got {mode!r}")
        if dist_kwargs and mode != "broadcast":
            raise ValueError(f"tensor lane mode {mode!r} takes no {', '.join(sorted(dist_kwargs))}")
        if num_slots < 2:
            raise ValueError(f"tensor lane 'ipc' needs num_slots >= 2, got {num_slots}")
        self.mode, self.num_slots = mode, num_slots
        self.channel = name or uuid.uuid4().hex[:12]
        self.root = Path(root or _default_root())
        self._store = UpdateStore()
        self._lane = _BroadcastLane(**dist_kwargs) if mode == "broadcast" else None
        self._sides: list = []

    @property
    def mailbox_path(self) -> Path:
        return self.root / f"loomrl-{self.channel}.tensor-lane"

    def sender(self) -> Sender:
        if self._lane is not None:
            return self._lane.sender()
        side = LocalTensorSender(self._store) if self.mode == "local" else IpcTensorSender(self)
        self._sides.append(side)
        return side

    def receiver(self, rank: int = 0) -> Receiver:
        if self._lane is not None:
            return self._lane.receiver(rank)
        side = LocalTensorReceiver(self._store) if self.mode == "local" else IpcTensorReceiver(self)
        self._sides.append(side)
        return side

    def close(self) -> None:
        if self._lane is not None:
            self._lane.close()
        for side in reversed(self._sides):
            side.close()
        self._sides.clear()

    def unlink(self) -> None:
        """Remove the ipc mailbox, whichever process made it (for whoever owns the channel)."""
        self.mailbox_path.unlink(missing_ok=True)

    def __getstate__(self) -> dict:
        if self.mode == "local":
            raise TypeError("a 'local' tensor lane reaches only threads of its own process")
        return {**self.__dict__, "_sides": [], "_store": None}


def choose_lane(mode: str, *, in_process: bool, device: str) -> tuple[str, dict[str, Any]]:
    """The transport kind and arguments for ``weight_sync.transport='tensor'`` on a runtime
    (``in_process``: executors are threads of this process) with models on ``device``
    (``model.device``): ``local`` for threads, ``ipc`` for processes on one CUDA device,
    ``broadcast`` when asked for; the byte lane (``shm``) where the tensor lane cannot work."""
    if mode == "broadcast":
        if in_process:
            raise ValueError(
                "weight_sync.transport.mode='broadcast' needs one process per executor; the local "
                "runtime runs threads: use mode='auto'"
            )
        return "tensor", {"mode": "broadcast"}
    if in_process:
        return "tensor", {"mode": "local"}

    resolved = resolve_device(device)
    if resolved.type == "cuda" and os.name == "posix":
        return "tensor", {"mode": "ipc", "name": uuid.uuid4().hex[:16]}
    logger.warning(
        "weight_sync.transport='tensor': executors in other processes share tensors by CUDA IPC, which needs "
        "the models on a CUDA device (model.device=%r resolves to %s here); using the byte lane 'shm' instead",
        device,
        resolved,
    )
    return "shm", {"name": uuid.uuid4().hex[:16]}
