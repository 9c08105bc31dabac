"""Transport through a folder or an fsspec URL: a chain of deltas with periodic snapshots.

Each update is one file, ``v<version>-full.lwu`` or ``v<version>-from<base>.lwu`` (versions
zero-padded to 12 digits), written to a temporary name and then renamed, so a reader never
sees half a file. The sender keeps the newest ``keep_fulls`` snapshots and the deltas after
the oldest of them. Receivers list the folder: a receiver that missed versions takes the
latest snapshot and walks the deltas after it. Works with any fsspec filesystem (local
folders, ``memory://``, object stores where a rename is a copy).
"""

from __future__ import annotations

import logging
import os
import re
import uuid
from typing import Any

import fsspec

from loomrl.weights.transports.base import Receiver, Sender, TransferStats, Transport, UpdateRef
from loomrl.weights.update import WeightUpdate

logger = logging.getLogger(__name__)

_NAME = re.compile(r"^v(\d{12,})-(?:full|from(\d{12,}))\.lwu$")


def update_filename(version: int, base_version: int | None) -> str:
    """The file name of an update in the folder."""
    if version < 0 or (base_version is not None and base_version < 0):
        raise ValueError(f"files transport needs versions >= 0, got {base_version}->{version}")
    tail = "full" if base_version is None else f"from{base_version:012d}"
    return f"v{version:012d}-{tail}.lwu"


def _list_refs(fs: fsspec.AbstractFileSystem, root: str) -> list[UpdateRef]:
    try:
        fs.invalidate_cache(root)
        paths = fs.ls(root, detail=False)
    except FileNotFoundError:
        return []
    refs = []
    for path in paths:
        match = _NAME.match(path.rstrip("/").rsplit("/", 1)[-1])
        if match:
            base = None if match.group(2) is None else int(match.group(2))
            refs.append(UpdateRef(int(match.group(1)), base, path))
    return refs


class FilesSender(Sender):
    def __init__(self, t: FilesTransport) -> None:
        self.t = t
        self.stats = TransferStats()
        t.fs.makedirs(t.root, exist_ok=True)

    def _put(self, update: WeightUpdate) -> None:
        fs, root = self.t.fs, self.t.root
        final = f"{root}/{update_filename(update.version, update.base_version)}"
        tmp = f"{root}/.tmp-{uuid.uuid4().hex}"
        header, payload = update.frames()
        try:
            with fs.open(tmp, "wb") as f:
                f.write(header)
                f.write(payload)
                if self.t.fsync and hasattr(f, "fileno"):
                    f.flush()
                    os.fsync(f.fileno())
            if self.t.local:
                os.replace(tmp, final)  # atomic on POSIX
            else:
                fs.mv(tmp, final)
        except BaseException:
            if fs.exists(tmp):
                fs.rm(tmp)
            raise
        if update.is_full:
            self._prune()

    def _prune(self) -> None:
        """Keep the newest ``keep_fulls`` snapshots and the deltas after the oldest kept."""
        refs = _list_refs(self.t.fs, self.t.root)
        fulls = sorted((r.version for r in refs if r.is_full), reverse=True)
        if len(fulls) <= self.t.keep_fulls:
            return
        oldest_kept = fulls[self.t.keep_fulls - 1]
        for r in refs:
            if r.version < oldest_kept or (not r.is_full and r.version <= oldest_kept):
                try:
                    self.t.fs.rm(r.key)
                except FileNotFoundError:
                    pass


class FilesReceiver(Receiver):
    poll_interval_s = 0.01

    def __init__(self, t: FilesTransport) -> None:
        self.t = t
        self.stats = TransferStats()

    def _list(self) -> list[UpdateRef]:
        return _list_refs(self.t.fs, self.t.root)

    def _fetch(self, ref: UpdateRef) -> WeightUpdate | None:
        try:
            with self.t.fs.open(ref.key, "rb") as f:
                data = f.read()
        except FileNotFoundError:  # pruned meanwhile
            return None
        return WeightUpdate.from_bytes(data)


class FilesTransport(Transport):
    """``path``: a local folder or an fsspec URL (``memory://...``, ``s3://...``)."""

    name = "files"

    def __init__(
        self,
        path: str,
        *,
        keep_fulls: int = 2,
        fsync: bool = False,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        if keep_fulls < 1:
            raise ValueError(f"keep_fulls must be >= 1, got {keep_fulls}")
        self.path, self.keep_fulls, self.fsync = str(path), keep_fulls, fsync
        self.storage_options = storage_options or {}
        self.fs, root = fsspec.core.url_to_fs(self.path, **self.storage_options)
        self.root = root.rstrip("/") or "/"
        self.local = "file" in (
            self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,)
        )

    def sender(self) -> FilesSender:
        return FilesSender(self)

    def receiver(self, rank: int = 0) -> FilesReceiver:
        return FilesReceiver(self)

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "fs"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.fs, _ = fsspec.core.url_to_fs(self.path, **self.storage_options)
