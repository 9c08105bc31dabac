"""Reading a DCP checkpoint folder that may come from someone else, without running code.

``torch.distributed.checkpoint`` reads a folder's ``.metadata`` with plain ``pickle.load``
and the non-tensor values of a state (the optimizer's ``param_groups``: floats, tuples,
strings) with ``torch.load(weights_only=False)``: a crafted file runs whatever it names
before any weight loads, and a manifest's digests do not help (its author recomputes them;
a digest proves a file is the one the manifest names, not who wrote it).

- ``SafeFileSystemReader`` unpickles ``.metadata`` through ``MetadataUnpickler``, which
  builds only DCP's own metadata classes, torch dtypes, sizes and layouts, paths and plain
  containers; any other global is refused by name, unbuilt, with the file named. Every
  shard file the metadata points at must be a plain name inside the folder.
- ``SafeLoadPlanner`` reads the non-tensor values with ``torch.load(weights_only=True)``.
  (Tensors DCP already reads with ``weights_only=True``.)
"""

from __future__ import annotations

import pickle
from pathlib import Path, PurePosixPath
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from loomrl.training.checkpoint import CheckpointError

# module -> the names a DCP .metadata may build (what torch 2.x's FileSystemWriter writes)
_ALLOWED: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset(
        {
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        }
    ),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.serialization": frozenset({"_get_layout"}),
    "torch": frozenset({"Size"}),
    "pathlib": frozenset({"PosixPath", "PurePosixPath"}),
    "collections": frozenset({"OrderedDict"}),
}


class MetadataUnpickler(pickle.Unpickler):
    """An unpickler that builds DCP metadata and nothing else (module docstring)."""

    def __init__(self, file, name: str) -> None:
        super().__init__(file)
        self.name = name

    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CheckpointError(
            f"{self.name} names {module}.{name}, which is not part of DCP checkpoint metadata: "
            f"refused unbuilt (unpickling it could run code; was this checkpoint handed to you?)"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise CheckpointError(f"{self.name} holds a persistent id, which DCP metadata never has")


def read_dcp_metadata(path: Path) -> Metadata:
    """The ``Metadata`` in ``path``, read by ``MetadataUnpickler``; ``CheckpointError`` naming
    the file when it holds anything else, is not a pickle, or points outside its folder."""
    try:
        with open(path, "rb") as f:
            metadata = MetadataUnpickler(f, str(path)).load()
    except CheckpointError:
        raise
    except Exception as err:  # noqa: BLE001 - a cut or garbled pickle raises many kinds
        raise CheckpointError(f"{path} is not readable DCP metadata ({err!r:.200})") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{path} holds a {type(metadata).__name__}, not DCP Metadata")
    _check_storage_paths(path, metadata)
    return metadata


def _check_storage_paths(path: Path, metadata: Metadata) -> None:
    """Every shard file named in ``metadata`` is a plain file name of the folder."""
    storage = metadata.storage_data
    if not isinstance(storage, dict):
        raise CheckpointError(f"{path}: storage_data is not a mapping")
    for info in storage.values():
        relative = getattr(info, "relative_path", None)
        name = PurePosixPath(relative) if isinstance(relative, str) else None
        if name is None or len(name.parts) != 1 or name.name in ("", ".", ".."):
            raise CheckpointError(
                f"{path} points at shard file {relative!r:.120}, which is not a file of its "
                f"folder; refused"
            )


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose ``.metadata`` goes through ``read_dcp_metadata``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_dcp_metadata(Path(self._get_metadata_path(kwargs.get("rank"))))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that reads non-tensor values with ``weights_only=True``."""

    def load_bytes(self, read_item: ReadItem, value) -> None:
        fqn = read_item.dest_index.fqn
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as err:
            first = (str(err).strip().splitlines() or [type(err).__name__])[0]
            raise CheckpointError(
                f"DCP value {fqn!r} holds more than plain data, refused unloaded ({first})"
            ) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded
