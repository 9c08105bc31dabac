"""Same-host transport through shared memory (files in ``/dev/shm``, memory-mapped).

Two files per channel, created by the sender:

- ``loomrl-<name>.index`` (64 KiB): a header with a sequence counter (a seqlock: odd while
  the sender edits the index), the data file's generation and capacities, and a table of
  entries ``(id, version, base_version, offset, nbytes)``;
- ``loomrl-<name>.data.<generation>``: two full-snapshot slots (the sender writes the new
  snapshot into the slot not holding the latest one) and a ring buffer for deltas.

The data file is preallocated and pre-faulted once, sized from the first update's model
size, and regrown (a new generation) only if a snapshot no longer fits. The sender removes
an entry from the index *before* overwriting its bytes, and a receiver copies an entry out
and then checks that the entry (ids are never reused) is still in the index, so it never
returns bytes that were overwritten while it read them. The update's own checksums catch
any other corruption. One sender per channel; receivers live in any process on the host.
"""

from __future__ import annotations

import logging
import mmap
import os
import stat
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

from loomrl.weights.transports.base import (
    BufferPool,
    Receiver,
    Sender,
    TransferStats,
    Transport,
    TransportError,
    UpdateRef,
)
from loomrl.weights.update import WeightUpdate

logger = logging.getLogger(__name__)

_MAGIC = b"LOOMSHM1"
_INDEX_BYTES = 1 << 16
_MAX_ENTRIES = 512
_NO_BASE = np.iinfo(np.int64).min
_HEADER = np.dtype(
    [
        ("magic", "S8"),
        ("seq", "<u8"),
        ("generation", "<u8"),
        ("full_capacity", "<u8"),
        ("ring_capacity", "<u8"),
    ]
)
_ENTRY = np.dtype(
    [
        ("id", "<u8"),
        ("version", "<i8"),
        ("base_version", "<i8"),
        ("offset", "<u8"),
        ("nbytes", "<u8"),
    ]
)
_ENTRIES_AT = 64


def _default_root() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


_OPEN_FLAGS = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC


def _create_exclusive(path: Path) -> int:
    """Create ``path`` (0600) exclusively: never adopt a file someone else put there.

    A stale file of our own (a killed sender's) is replaced; anything else, a symlink or a
    file of another user in the shared ``/dev/shm``, is refused.
    """
    for _ in range(2):
        try:
            return os.open(path, _OPEN_FLAGS | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            st = os.lstat(path)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                raise TransportError(
                    f"shm channel file {path} already exists and is not ours "
                    f"(owner uid {st.st_uid}, {stat.filemode(st.st_mode)}): refusing to use it"
                ) from None
            path.unlink(missing_ok=True)  # our own stale file
    raise TransportError(f"could not create shm channel file {path} exclusively")


def _open_existing(path: Path) -> int:
    try:
        return os.open(path, _OPEN_FLAGS)
    except OSError as err:
        raise TransportError(f"cannot open shm channel file {path}: {err}") from None


def _check_private(fd: int, path: Path) -> None:
    """The channel's files must be ours, regular, and readable by nobody else."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise TransportError(
            f"shm channel file {path} is not a private file of uid {os.geteuid()} "
            f"(owner uid {st.st_uid}, {stat.filemode(st.st_mode)})"
        )


class _Mapped:
    """A memory-mapped file with numpy views of its index or data."""

    def __init__(self, path: Path, nbytes: int | None = None) -> None:
        fd = _create_exclusive(path) if nbytes is not None else _open_existing(path)
        try:
            _check_private(fd, path)
            if nbytes is not None:
                os.ftruncate(fd, nbytes)
            size = os.fstat(fd).st_size
            self.mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.bytes = np.frombuffer(self.mm, dtype=np.uint8)

    def index_views(self) -> tuple[np.ndarray, np.ndarray]:
        header = np.ndarray((1,), _HEADER, buffer=self.mm)
        entries = np.ndarray((_MAX_ENTRIES,), _ENTRY, buffer=self.mm, offset=_ENTRIES_AT)
        return header, entries

    def close(self) -> None:
        self.bytes = None  # drop the exported views before closing the map
        try:
            self.mm.close()
        except BufferError:  # a view is still alive somewhere; the map goes with it
            logger.debug("shm map still in use; left open")


class ShmSender(Sender):
    def __init__(self, transport: ShmTransport) -> None:
        self.t = transport
        self.stats = TransferStats()
        self.index = _Mapped(transport.index_path, _INDEX_BYTES)
        self.header, self.entries = self.index.index_views()
        self.header[0] = (_MAGIC, 0, 0, 0, 0)
        self.entries[:] = np.zeros(_MAX_ENTRIES, _ENTRY)
        self.data: _Mapped | None = None
        self.next_id = 1
        self.full_slot = 1  # the slot holding the latest snapshot; the next one goes to 0
        self.ring_head = 0

    # -- index edits under the seqlock ---------------------------------------------------
    def _begin(self) -> None:
        self.header["seq"] += 1  # odd: readers retry

    def _end(self) -> None:
        self.header["seq"] += 1

    def _invalidate(self, start: int, stop: int) -> None:
        live = self.entries["id"] != 0
        ends = self.entries["offset"] + self.entries["nbytes"]
        hit = live & (self.entries["offset"] < stop) & (ends > start)
        if hit.any():
            self._begin()
            self.entries["id"][hit] = 0
            self._end()

    def _add(self, update: WeightUpdate, offset: int, nbytes: int) -> None:
        free = np.flatnonzero(self.entries["id"] == 0)
        self._begin()
        if free.size == 0:  # evict the oldest delta
            deltas = np.flatnonzero(self.entries["base_version"] != _NO_BASE)
            slot = deltas[np.argmin(self.entries["id"][deltas])]
        else:
            slot = free[0]
        base = _NO_BASE if update.base_version is None else update.base_version
        self.entries[slot] = (self.next_id, update.version, base, offset, nbytes)
        self._end()
        self.next_id += 1

    # -- data ------------------------------------------------------------------------------
    def _ensure_capacity(self, update: WeightUpdate, nbytes: int) -> None:
        need = nbytes if update.is_full else 0
        if self.data is not None and need <= int(self.header["full_capacity"][0]):
            return
        snapshot = update.model_nbytes + len(update.header())
        full_cap = max(self.t.capacity_bytes or 0, snapshot * 21 // 20 + (1 << 20), need)
        ring_cap = self.t.ring_bytes or max(64 << 20, full_cap // 4)
        generation = int(self.header["generation"][0]) + 1
        data = _Mapped(self.t.data_path(generation), 2 * full_cap + ring_cap)
        data.bytes.fill(0)  # pre-fault every page now, not during a send
        self._begin()
        self.entries["id"] = 0
        self.header["generation"], self.header["full_capacity"] = generation, full_cap
        self.header["ring_capacity"] = ring_cap
        self._end()
        if self.data is not None:
            self.data.close()
            self.t.data_path(generation - 1).unlink(missing_ok=True)
        self.data, self.full_slot, self.ring_head = data, 1, 0
        logger.info(
            "shm %s: data generation %d, 2 x %d + %d bytes",
            self.t.channel,
            generation,
            full_cap,
            ring_cap,
        )

    def _put(self, update: WeightUpdate) -> None:
        header, payload = update.frames()
        nbytes = len(header) + len(payload)
        self._ensure_capacity(update, nbytes)
        full_cap = int(self.header["full_capacity"][0])
        ring_cap = int(self.header["ring_capacity"][0])
        if update.is_full:
            slot = 1 - self.full_slot
            offset = slot * full_cap
            self._invalidate(offset, offset + full_cap)
        else:
            if nbytes > ring_cap:
                raise TransportError(
                    f"shm {self.t.channel}: a {nbytes}-byte delta does not fit the "
                    f"{ring_cap}-byte delta ring (raise ring_bytes)"
                )
            pos = self.ring_head if self.ring_head + nbytes <= ring_cap else 0
            offset = 2 * full_cap + pos
            self._invalidate(offset, offset + nbytes)
        out = self.data.bytes
        out[offset : offset + len(header)] = np.frombuffer(header, dtype=np.uint8)
        out[offset + len(header) : offset + nbytes] = np.frombuffer(payload, dtype=np.uint8)
        self._add(update, offset, nbytes)
        if update.is_full:
            self.full_slot = slot
        else:
            self.ring_head = offset - 2 * full_cap + nbytes

    def close(self) -> None:
        if self.data is not None:
            self.data.close()
            self.t.data_path(int(self.header["generation"][0])).unlink(missing_ok=True)
        self.header = self.entries = None
        self.index.close()
        self.t.index_path.unlink(missing_ok=True)


class ShmReceiver(Receiver):
    def __init__(self, transport: ShmTransport) -> None:
        self.t = transport
        self.stats = TransferStats()
        self.index: _Mapped | None = None
        self.data: _Mapped | None = None
        self.generation = 0
        self.pool = BufferPool()

    def _snapshot(self) -> tuple[np.ndarray, np.ndarray] | None:
        if self.index is None:
            if not self.t.index_path.exists():
                return None
            self.index = _Mapped(self.t.index_path)
        header, entries = self.index.index_views()
        for _ in range(1000):
            seq = int(header["seq"][0])
            if seq % 2 == 0:
                h, e = header.copy(), entries.copy()
                if int(header["seq"][0]) == seq:
                    return h, e
            time.sleep(0)
        return None

    def _list(self) -> list[UpdateRef]:
        snap = self._snapshot()
        if snap is None:
            return []
        header, entries = snap
        generation = int(header["generation"][0])
        if generation != self.generation:
            if self.data is not None:
                self.data.close()
                self.data = None
            try:
                self.data = _Mapped(self.t.data_path(generation))
            except FileNotFoundError:  # regrown again meanwhile
                return []
            self.generation = generation
        return [
            UpdateRef(
                int(e["version"]),
                None if e["base_version"] == _NO_BASE else int(e["base_version"]),
                (int(e["id"]), int(e["offset"]), int(e["nbytes"])),
            )
            for e in entries[entries["id"] != 0]
        ]

    def _fetch(self, ref: UpdateRef) -> WeightUpdate | None:
        entry_id, offset, nbytes = ref.key
        if self.data is None or offset + nbytes > self.data.bytes.size:
            return None
        buf = self.pool.get(nbytes)
        np.frombuffer(buf, dtype=np.uint8)[:] = self.data.bytes[offset : offset + nbytes]
        snap = self._snapshot()  # still there after the copy: nothing overwrote it
        if snap is None or int(snap[0]["generation"][0]) != self.generation:
            return None
        if entry_id not in snap[1]["id"]:
            return None
        return WeightUpdate.from_bytes(buf)

    def close(self) -> None:
        for m in (self.data, self.index):
            if m is not None:
                m.close()
        self.data = self.index = None


class ShmTransport(Transport):
    """``name`` identifies the channel on the host (a receiver in another process builds
    ``ShmTransport(name=...)`` with the same name); ``capacity_bytes`` / ``ring_bytes`` size
    a snapshot slot and the delta ring (default: from the first update)."""

    name = "shm"

    def __init__(
        self,
        name: str | None = None,
        *,
        root: str | None = None,
        capacity_bytes: int | None = None,
        ring_bytes: int | None = None,
    ) -> None:
        self.channel = name or uuid.uuid4().hex[:12]
        self.root = Path(root or _default_root())
        self.capacity_bytes = capacity_bytes
        self.ring_bytes = ring_bytes
        self._owned: list = []

    @property
    def index_path(self) -> Path:
        return self.root / f"loomrl-{self.channel}.index"

    def data_path(self, generation: int) -> Path:
        return self.root / f"loomrl-{self.channel}.data.{generation}"

    def sender(self) -> ShmSender:
        s = ShmSender(self)
        self._owned.append(s)
        return s

    def receiver(self, rank: int = 0) -> ShmReceiver:
        r = ShmReceiver(self)
        self._owned.append(r)
        return r

    def close(self) -> None:
        for side in reversed(self._owned):
            side.close()
        self._owned.clear()

    def unlink(self) -> None:
        """Remove the channel's files, whichever process made them (a sender that was
        killed could not): for whoever owns the channel's lifetime, once every end is gone."""
        self.index_path.unlink(missing_ok=True)
        for path in self.root.glob(f"loomrl-{self.channel}.data.*"):
            path.unlink(missing_ok=True)

    def __getstate__(self) -> dict:  # picklable for a spawned receiver process
        return {**self.__dict__, "_owned": []}
