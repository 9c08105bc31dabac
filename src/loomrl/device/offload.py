"""Move a module's state (parameters, gradients, buffers) and an optimizer's state off the
device and back, bit for bit.

- CPU tensors live in shared memory from their first offload on: each is copied once into
  a ``MAP_SHARED`` mapping of a file (in ``/dev/shm`` when it exists, so tmpfs; unlinked at
  once, so nothing is left behind if the process dies) and re-homed there, one storage per
  tensor. An offload then copies nothing: it drops the mapping's pages from the process
  (``madvise(MADV_DONTNEED)``), so its resident memory really falls while the data stays in
  the file; a restore maps them back (``MADV_POPULATE_READ``). Only a tensor that is not
  in such a mapping yet (the first offload, gradients or a weight snapshot made since) is
  copied, and the heap it leaves is handed back to the OS (``malloc_trim``). A tensor
  changed in place since the last restore needs nothing either: its memory is the file.
- CUDA tensors go to pinned host memory, and the CUDA caching allocator releases the
  device memory (``torch.cuda.empty_cache``).

The objects stay the same (``param.data`` is swapped, not the ``Parameter``), so an
optimizer, hooks and references into the module keep working after ``restore``. A mapping
and its tmpfs memory go away with the last tensor that lives in it.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import tempfile
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

ALIGN = 64  # bytes: every tensor's offset in a shared mapping
TRIM_MIN_BYTES = 1 << 20  # heap bytes copied out by one offload before malloc_trim is worth it
# Linux >= 5.14. READ, not WRITE: a read fault maps a tmpfs page writable already and maps
# its neighbours too (fault-around): fewer faults than one write fault per page
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)
# storage data pointer -> the shared mapping that holds it; an entry leaves with its mapping
_HOMES: dict[int, weakref.ref] = {}
_populate = {"supported": True}  # cleared where the kernel has no MADV_POPULATE_READ
_PLACEHOLDERS: dict[
    tuple[torch.dtype, torch.device], torch.Tensor
] = {}  # what an offloaded tensor holds


@dataclass
class _Entry:
    kind: str  # param | grad | buffer | optim
    owner: Any  # the Parameter / buffer tensor, or (optimizer state dict, key)
    tensor: torch.Tensor | None = None  # CPU: the tensor itself, in its shared mapping
    device: torch.device | None = None
    host: torch.Tensor | None = None  # pinned copy (CUDA tensors)


@dataclass
class OffloadedState:
    """What ``offload`` took away; ``restore`` puts it back."""

    entries: list[_Entry]
    mappings: list[mmap.mmap]  # the shared mappings whose pages were dropped
    bytes_moved: int  # bytes taken off the device (out of resident memory on CPU)
    bytes_copied: int  # of those, bytes copied (not already in a shared mapping)
    seconds: float
    extra: dict[str, Any] = field(default_factory=dict)


Modules = torch.nn.Module | list[torch.nn.Module]


def _as_list(modules: Modules) -> list[torch.nn.Module]:
    return modules if isinstance(modules, list) else [modules]


def _tensors(modules: Modules, optimizer: torch.optim.Optimizer | None, tensor_dicts: list[dict]):
    seen: set[int] = set()
    for module in _as_list(modules):
        for p in module.parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            yield "param", p, p.data
            if p.grad is not None:
                yield "grad", p, p.grad
        for b in module.buffers():
            if id(b) not in seen:
                seen.add(id(b))
                yield "buffer", b, b.data
    for tensors in tensor_dicts:  # e.g. a generator's mirror of the published weights
        for key, value in tensors.items():
            if isinstance(value, torch.Tensor) and id(value) not in seen:
                seen.add(id(value))
                yield "optim", (tensors, key), value
    if optimizer is not None:
        for state in optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    yield "optim", (state, key), value


def default_offload_dir() -> str:
    return (
        "/dev/shm"
        if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK)
        else tempfile.gettempdir()
    )


def release_freed_memory() -> None:
    """Ask glibc to return freed heap pages to the OS (no-op where there is no glibc)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def shared_mapping(t: torch.Tensor) -> mmap.mmap | None:
    """The shared mapping ``t``'s storage lives in, if it is one of offload's."""
    ref = _HOMES.get(t.untyped_storage().data_ptr())
    return None if ref is None else ref()


def _rehome(tensors: list[torch.Tensor], directory: str) -> tuple[mmap.mmap, list[torch.Tensor]]:
    """Copies of ``tensors`` (CPU) in one new shared mapping, one storage each (so nothing
    looks shared to safetensors)."""
    offsets, size = [], 0
    for t in tensors:
        offsets.append(size)
        size += -(-t.nbytes // ALIGN) * ALIGN
    fd, name = tempfile.mkstemp(prefix="loomrl-offload-", suffix=".bin", dir=directory)
    try:
        os.unlink(name)  # the mapping keeps the file's data; the name is not needed
        os.ftruncate(fd, size)
        area = mmap.mmap(fd, size)  # MAP_SHARED, read-write
    finally:
        os.close(fd)
    homes = []
    for t, offset in zip(tensors, offsets):
        # the storage keeps ``area`` alive; ``area`` unmaps when the last of them is freed
        home = torch.frombuffer(area, dtype=torch.uint8, count=t.nbytes, offset=offset)
        home = home.view(t.dtype).view(t.shape).copy_(t)
        homes.append(home)
    ptrs = [h.untyped_storage().data_ptr() for h in homes]
    ref = weakref.ref(area, lambda _ref: [_HOMES.pop(p, None) for p in ptrs])
    _HOMES.update(dict.fromkeys(ptrs, ref))
    return area, homes


def offload(
    module: Modules,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    tensor_dicts: list[dict] | None = None,
    directory: str | None = None,
) -> OffloadedState:
    """Take every tensor of ``module`` (one or a list), ``optimizer`` and ``tensor_dicts``
    off its device; returns what ``restore`` needs. Nothing may use them until then."""
    t0 = time.perf_counter()
    entries, mappings, moved, copied = _take(
        module, optimizer, tensor_dicts or [], directory or default_offload_dir()
    )
    if any(e.host is not None for e in entries):
        torch.cuda.synchronize()
    for e in entries:
        _detach(e)
    for area in mappings:
        area.madvise(mmap.MADV_DONTNEED)  # out of this process; the data stays in the file
    if any(e.device.type == "cuda" for e in entries):
        torch.cuda.empty_cache()
    if copied >= TRIM_MIN_BYTES:  # the heap those tensors left (a first offload, new gradients)
        release_freed_memory()
    return OffloadedState(entries, mappings, moved, copied, time.perf_counter() - t0)


def _take(
    modules: Modules,
    optimizer: torch.optim.Optimizer | None,
    tensor_dicts: list[dict],
    directory: str,
) -> tuple[list[_Entry], list[mmap.mmap], int, int]:
    """The entries, each with its tensor in a shared mapping (CPU) or a pinned copy (CUDA),
    the mappings they are in, the bytes moved and the bytes copied. The originals of copied
    tensors are referenced only by their owners when it returns."""
    entries: list[_Entry] = []
    mappings: dict[int, mmap.mmap] = {}
    new: dict[str, list[tuple[_Entry, torch.Tensor]]] = {}  # kind -> CPU tensors to copy
    moved = copied = 0
    for kind, owner, t in _tensors(modules, optimizer, tensor_dicts):
        entry = _Entry(kind, owner, device=t.device)
        moved += t.nbytes
        if not t.is_cpu:
            entry.host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            entry.host.copy_(t, non_blocking=True)
        elif (area := shared_mapping(t)) is not None or t.nbytes == 0:
            entry.tensor = t  # already in shared memory (or empty): nothing to copy
            if area is not None:
                mappings[id(area)] = area
        else:
            new.setdefault(kind, []).append((entry, t))
        entries.append(entry)
    # one mapping per kind: gradients (and snapshots) come and go, weights and moments stay
    for pending in new.values():
        area, homes = _rehome([t for _, t in pending], directory)
        mappings[id(area)] = area
        for (entry, t), home in zip(pending, homes):
            entry.tensor = home
            copied += t.nbytes
    return entries, list(mappings.values()), moved, copied


def _placeholder(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    key = (dtype, device)
    if key not in _PLACEHOLDERS:
        _PLACEHOLDERS[key] = torch.empty(0, dtype=dtype, device=device)
    return _PLACEHOLDERS[key]


def is_placeholder(t: torch.Tensor) -> bool:
    """Whether ``t`` is what an offloaded tensor's owner holds while it is away."""
    return _PLACEHOLDERS.get((t.dtype, t.device)) is t


def _detach(e: _Entry) -> None:
    if e.kind == "param" or e.kind == "buffer":
        e.owner.data = _placeholder(e.owner.dtype, e.device)  # its own device, even if lent
    elif e.kind == "grad":
        e.owner.grad = None
    else:
        state, key = e.owner
        state[key] = _placeholder(state[key].dtype, e.device)


def _attach(e: _Entry, t: torch.Tensor) -> None:
    if e.kind == "param" or e.kind == "buffer":
        e.owner.data = t
    elif e.kind == "grad":
        e.owner.grad = t
    else:
        state, key = e.owner
        state[key] = t


def _populate_pages(area: mmap.mmap) -> None:
    """Map the pages back now, in one call, rather than one fault at a time in the phase."""
    if _populate["supported"]:
        try:
            area.madvise(MADV_POPULATE_READ)
        except OSError:  # an older kernel: the phase faults them in, a few pages at a time
            _populate["supported"] = False


def restore(state: OffloadedState) -> float:
    """Put back what ``offload`` took; returns the seconds it took."""
    t0 = time.perf_counter()
    for area in state.mappings:
        _populate_pages(area)
    for e in state.entries:
        _attach(e, e.host.to(e.device, non_blocking=True) if e.host is not None else e.tensor)
    if any(e.host is not None for e in state.entries):
        torch.cuda.synchronize()
    state.entries, state.mappings = [], []
    return time.perf_counter() - t0


@contextmanager
def lend(state: OffloadedState, modules: Modules) -> Iterator[int]:
    """For a read of ``modules``' parameters and buffers (some of what ``state`` holds), give
    them their offloaded data back, on the host, while everything else stays away, and take
    it again on exit; yields the bytes lent. Nothing comes to the device:

    - CPU: the tensors themselves, in their shared mappings. Reading them maps only the
      pages read back into the process (a restore maps every page of every mapping); on
      exit the mappings' pages are dropped again (all of ``state`` is away: nothing in them
      is in use).
    - CUDA: the pinned host copies (a parameter's ``.data`` is on the host meanwhile); a
      reader that needs some of them on the device copies those (a publish to the tensor
      lane copies the published tensors, not the module's every buffer or frozen weight).

    Read only: a lent tensor is the offloaded copy itself, and ``restore`` brings it back."""
    owners = {id(t) for m in _as_list(modules) for t in (*m.parameters(), *m.buffers())}
    entries = [e for e in state.entries if e.kind in ("param", "buffer") and id(e.owner) in owners]
    for e in entries:
        _attach(e, e.tensor if e.host is None else e.host)
    try:
        yield sum(e.owner.nbytes for e in entries)
    finally:
        for e in entries:
            _detach(e)
        areas = {
            id(a): a for e in entries if e.tensor is not None and (a := shared_mapping(e.tensor))
        }
        for area in areas.values():
            area.madvise(mmap.MADV_DONTNEED)


class Swappable:
    """A module (and optimizer) that a scheduler client can offload and restore; the
    trainer's or the generator's state."""

    def __init__(
        self,
        module: Modules,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        tensor_dicts: list[dict] | None = None,
        directory: str | None = None,
    ) -> None:
        self.module, self.optimizer, self.directory = module, optimizer, directory
        self.tensor_dicts = tensor_dicts or []
        self._state: OffloadedState | None = None

    @property
    def offloaded(self) -> bool:
        return self._state is not None

    def offload(self) -> float:
        if self._state is None:
            self._state = offload(
                self.module,
                self.optimizer,
                tensor_dicts=self.tensor_dicts,
                directory=self.directory,
            )
            return self._state.seconds
        return 0.0

    def restore(self) -> float:
        if self._state is None:
            return 0.0
        state, self._state = self._state, None
        return restore(state)

    @contextmanager
    def lend(self, modules: Modules) -> Iterator[int]:
        """``lend`` (above) while offloaded: only ``modules``' parameters and buffers come
        back, on the host, and only for the ``with`` block; yields the bytes lent (0 when
        not offloaded: the module is on its device already)."""
        if self._state is None:
            yield 0
            return
        with lend(self._state, modules) as lent_bytes:
            yield lent_bytes
