"""Move a module's state (parameters, gradients, buffers) and an optimizer's state off the
device and back, bit for bit.

- CPU tensors go to one file (in ``/dev/shm`` when it exists, so it is shared memory) and
  their storage is freed, so the process's resident memory really falls: restored tensors
  of 64 KiB or more live in anonymous mappings of their own, unmapped when freed; tensors
  the allocator holds (a first offload, gradients made since) are handed back by asking
  glibc to trim (``malloc_trim``).
- CUDA tensors go to pinned host memory, and the CUDA caching allocator releases the
  device memory (``torch.cuda.empty_cache``).

The objects stay the same (``param.data`` is swapped, not the ``Parameter``), so an
optimizer, hooks and references into the module keep working after ``restore``.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ALIGN = 64  # bytes: every tensor's offset in the offload file
MAPPED_MIN_BYTES = 64 << 10  # restored tensors this large get an anonymous mapping each
TRIM_MIN_BYTES = 1 << 20  # heap-allocated bytes offloaded before malloc_trim is worth it
_MAPPED: set[int] = set()  # data pointers of tensors restored into their own mapping

@dataclass
class _Entry:
    kind: str  # param | grad | buffer | optim
    owner: Any  # the Parameter / buffer tensor, or (optimizer state dict, key)
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    offset: int = 0  # in the file (CPU tensors)
    nbytes: int = 0
    host: torch.Tensor | None = None  # pinned copy (CUDA tensors)


@dataclass
class OffloadedState:
    """What ``offload`` took away; ``restore`` puts it back and deletes the file."""

    entries: list[_Entry]
    path: Path | None
    bytes_moved: int
    seconds: float
    extra: dict[str, Any] = field(default_factory=dict)


Modules = torch.nn.Module | list[torch.nn.Module]


def _tensors(modules: Modules, optimizer: torch.optim.Optimizer | None, tensor_dicts: list[dict]):
    seen: set[int] = set()
    for module in modules if isinstance(modules, list) else [modules]:
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


def _placeholder(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=t.dtype, device=t.device)


def _as_bytes(t: torch.Tensor):
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()


def default_offload_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def release_freed_memory() -> None:
    """Ask glibc to return freed heap pages to the OS (no-op where there is no glibc)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def offload(module: Modules, optimizer: torch.optim.Optimizer | None = None, *, tensor_dicts: list[dict] | None = None,
            directory: str | None = None) -> OffloadedState:  # fmt: skip
    """Take every tensor of ``module`` (one or a list), ``optimizer`` and ``tensor_dicts``
    off its device; returns what ``restore`` needs. Nothing may use them until then."""
    t0 = time.perf_counter()
    entries: list[_Entry] = []
    path: Path | None = None
    f = None
    moved = 0
    try:
        for kind, owner, t in _tensors(module, optimizer, tensor_dicts or []):
            entry = _Entry(kind, owner, tuple(t.shape), t.dtype, t.device)
            entry.nbytes = t.numel() * t.element_size()
            if t.device.type == "cpu":
                if f is None:
                    fd, name = tempfile.mkstemp(prefix="loomrl-offload-", suffix=".bin", dir=directory or default_offload_dir())
                    path, f = Path(name), os.fdopen(fd, "wb")
                entry.offset = f.tell()
                f.write(_as_bytes(t).data)
                f.write(b"\0" * (-entry.nbytes % ALIGN))  # keep every tensor aligned in the file
            else:
                entry.host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                entry.host.copy_(t, non_blocking=True)
            moved += entry.nbytes
            entries.append(entry)
    finally:
        if f is not None:
            f.close()
    if any(e.host is not None for e in entries):
        torch.cuda.synchronize()
    heap_bytes = 0
    for e in entries:
        if e.device.type == "cpu":
            ptr = _owner_tensor(e).data_ptr()
            heap_bytes += 0 if ptr in _MAPPED else e.nbytes
            _MAPPED.discard(ptr)
        _detach(e)
    if any(e.device.type == "cuda" for e in entries):
        torch.cuda.empty_cache()
    if heap_bytes >= TRIM_MIN_BYTES:  # tensors the allocator holds (a first offload, new gradients)
        release_freed_memory()
    return OffloadedState(entries, path, moved, time.perf_counter() - t0)


def _owner_tensor(e: _Entry) -> torch.Tensor:
    if e.kind in ("param", "buffer"):
        return e.owner.data
    if e.kind == "grad":
        return e.owner.grad
    state, key = e.owner
    return state[key]


def _detach(e: _Entry) -> None:
    if e.kind == "param" or e.kind == "buffer":
        e.owner.data = _placeholder(e.owner.data)
    elif e.kind == "grad":
        e.owner.grad = None
    else:
        state, key = e.owner
        state[key] = _placeholder(state[key])


def _attach(e: _Entry, t: torch.Tensor) -> None:
    if e.kind == "param" or e.kind == "buffer":
        e.owner.data = t
    elif e.kind == "grad":
        e.owner.grad = t
    else:
        state, key = e.owner
        state[key] = t


def restore(state: OffloadedState) -> float:
    """Put back what ``offload`` took; returns the seconds it took. CPU tensors get their
    own storage each (so nothing looks shared to safetensors), filled by one ``preadv``."""
    t0 = time.perf_counter()
    try:
        restored: list[torch.Tensor] = []
        views = []
        for e in state.entries:
            if e.host is not None:
                restored.append(e.host.to(e.device, non_blocking=True))
                continue
            t = _allocate(e.shape, e.dtype, e.nbytes)
            restored.append(t)
            views.append(_as_bytes(t).data)
            views.append(memoryview(bytearray(-e.nbytes % ALIGN)))  # the padding in the file
        if state.path is not None:
            _read_all(state.path, views)
        for e, t in zip(state.entries, restored):
            _attach(e, t if e.host is not None or e.device.type == "cpu" else t.to(e.device))
        if any(e.host is not None for e in state.entries):
            torch.cuda.synchronize()
    finally:
        if state.path is not None:
            state.path.unlink(missing_ok=True)
    state.entries = []
    return time.perf_counter() - t0


def _allocate(shape: tuple[int, ...], dtype: torch.dtype, nbytes: int) -> torch.Tensor:
    """A restored tensor: the large ones each in an anonymous mapping of their own, so the
    next offload returns their pages at once (no ``malloc_trim``, which would also make
    the allocator hand out fresh, faulting pages for the next phase's activations)."""
    if nbytes < MAPPED_MIN_BYTES:
        return torch.empty(shape, dtype=dtype)
    area = mmap.mmap(-1, nbytes)
    t = torch.frombuffer(area, dtype=torch.uint8).view(dtype).view(shape)  # keeps ``area`` alive
    _MAPPED.add(t.data_ptr())
    return t


def _read_all(path: Path, views: list) -> None:
    expected = sum(v.nbytes for v in views)
    fd = os.open(path, os.O_RDONLY)
    try:
        got, start = 0, 0
        while start < len(views):  # preadv takes at most IOV_MAX buffers per call
            batch = views[start : start + 1024]
            got += os.preadv(fd, batch, got)
            start += len(batch)
    finally:
        os.close(fd)
    if got != expected:
        raise OSError(f"offload file {path} is short: read {got} of {expected} bytes")


class Swappable:
    """A module (and optimizer) that a scheduler client can offload and restore; the
    trainer's or the generator's state."""

    def __init__(self, module: Modules, optimizer: torch.optim.Optimizer | None = None, *,
                 tensor_dicts: list[dict] | None = None, directory: str | None = None) -> None:  # fmt: skip
        self.module, self.optimizer, self.directory = module, optimizer, directory
        self.tensor_dicts = tensor_dicts or []
        self._state: OffloadedState | None = None

    @property
    def offloaded(self) -> bool:
        return self._state is not None

    def offload(self) -> float:
        if self._state is None:
            self._state = offload(self.module, self.optimizer, tensor_dicts=self.tensor_dicts, directory=self.directory)
            return self._state.seconds
        return 0.0

    def restore(self) -> float:
        if self._state is None:
            return 0.0
        state, self._state = self._state, None
        return restore(state)
