"""``[weight_sync]`` and ``[weight_sync.transport]``: how the trainer's weights reach the generators.

The transport is a table tagged by ``type``, holding only that transport's keys::

    [weight_sync.transport]
    type = "files"
    path = "s3://bucket/run"

``transport = "files"`` is short for a table with that ``type`` and its defaults. The flat
keys of the old layout (``weight_sync.path``, ``keep_fulls``, ``bucket_mb``, ``tensor_mode``,
``dist_backend``) are moved into the table with a ``FutureWarning``; one that the job's
transport does not take (it had no effect) is an error naming the transport that takes it.
"""

from __future__ import annotations

import warnings
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from loomrl.config_base import Section

DistBackend = Literal["auto", "gloo", "nccl"]


class InprocTransportConfig(Section):
    type: Literal["inproc"] = Field(
        "inproc",
        description="Threads of this process hand updates over in memory (runtime='local' only).",
    )


class ShmTransportConfig(Section):
    type: Literal["shm"] = Field(
        "shm",
        description="A shared-memory channel on this host (the default for runtime 'process' and 'ray').",
    )


class FilesTransportConfig(Section):
    type: Literal["files"] = Field(
        "files", description="Update files in a folder or an fsspec URL that every executor sees."
    )
    path: str | None = Field(
        None, description="Folder or fsspec URL; default <run dir>/weight_updates."
    )
    keep_fulls: int = Field(
        2, gt=0, description="Full snapshots kept (with the deltas after them)."
    )


class TorchDistTransportConfig(Section):
    type: Literal["torch_dist"] = Field(
        "torch_dist",
        description="A torch.distributed broadcast group of the trainer and the generators (one process each).",
    )
    bucket_mb: int = Field(64, gt=0, description="Broadcast bucket size in MiB.")
    backend: DistBackend = Field(
        "auto", description="The group's backend: 'auto' is gloo; 'nccl' needs a GPU per executor."
    )


class TensorTransportConfig(Section):
    type: Literal["tensor"] = Field(
        "tensor", description="The tensor lane: device tensors, no codec (docs/weights.md)."
    )
    mode: Literal["auto", "broadcast"] = Field(
        "auto",
        description="'auto' shares the buffer in one process (runtime local) and by CUDA IPC across "
        "processes on one GPU (the byte lane 'shm' where the models are on CPUs); 'broadcast' broadcasts "
        "it over a torch_dist group (a GPU per process with backend='nccl', or gloo).",
    )
    bucket_mb: int = Field(64, gt=0, description="mode='broadcast': bucket size in MiB.")
    backend: DistBackend = Field(
        "auto",
        description="mode='broadcast': the group's backend: 'auto' is gloo; 'nccl' needs a GPU per executor.",
    )


TransportConfig = Annotated[
    InprocTransportConfig
    | ShmTransportConfig
    | FilesTransportConfig
    | TorchDistTransportConfig
    | TensorTransportConfig,
    Field(discriminator="type"),
]

# The old flat keys: their name in the transport table, the old default, the transports that take them.
_FLAT_KEYS: dict[str, tuple[str, Any, tuple[str, ...]]] = {
    "path": ("path", None, ("files",)),
    "keep_fulls": ("keep_fulls", 2, ("files",)),
    "bucket_mb": ("bucket_mb", 64, ("torch_dist", "tensor")),
    "dist_backend": ("backend", "auto", ("torch_dist", "tensor")),
    "tensor_mode": ("mode", "auto", ("tensor",)),
}


def _tagged_transport(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` (a ``[weight_sync]`` table) with ``transport = "kind"`` as a table and the old
    flat keys moved into it (a ``FutureWarning`` names each move)."""
    flat = {key: data.pop(key) for key in list(data) if key in _FLAT_KEYS}
    transport = data.get("transport")
    if isinstance(transport, str):
        transport = {"type": transport}
    if not flat:
        return data if transport is None else {**data, "transport": transport}
    if transport is not None and not isinstance(transport, dict):
        raise ValueError(
            f"weight_sync.{next(iter(flat))} beside a built transport: set it in weight_sync.transport"
        )
    table = dict(transport or {"type": "inproc"})
    kind, moved = table.get("type", "inproc"), []
    for key, value in flat.items():
        new, old_default, kinds = _FLAT_KEYS[key]
        if kind not in kinds:
            if value == old_default:  # an old config.json lists every key: nothing to move
                continue
            raise ValueError(
                f"weight_sync.{key}={value!r} is a key of the {' and '.join(map(repr, kinds))} transport "
                f"(now weight_sync.transport.{new}), and this job's transport is {kind!r}: remove it, "
                f"or set [weight_sync.transport] type = {kinds[0]!r}, {new} = {value!r}"
            )
        if new in table and table[new] != value:
            raise ValueError(
                f"weight_sync.{key}={value!r} and weight_sync.transport.{new}={table[new]!r}: "
                f"keep only weight_sync.transport.{new}"
            )
        table[new] = value
        moved.append(f"weight_sync.{key} -> weight_sync.transport.{new}")
    if moved:
        warnings.warn(
            "old weight_sync keys, moved into the [weight_sync.transport] table: "
            + ", ".join(moved)
            + "; write them there (the flat keys will stop working)",
            FutureWarning,
            stacklevel=2,
        )
    return {**data, "transport": table}


class WeightSyncConfig(Section):
    codec: Literal["full", "delta"] = Field("full", description="Full copies or lossless deltas.")
    transport: TransportConfig = Field(
        default_factory=InprocTransportConfig,
        description="How updates travel from trainer to generators, a table tagged by type: a byte lane "
        "('inproc', 'shm', 'files', 'torch_dist'; the codec) or the tensor lane ('tensor': device "
        "tensors, no codec; docs/weights.md). transport = 'shm' is short for the table with its defaults; "
        "unset, it is 'shm' where executors are processes, and on runtime 'ray' 'torch_dist' where the "
        "trainer and generators may sit on several nodes ('files' beside an fsdp2 trainer, whose ranks "
        "cannot also join a weight group; docs/cluster.md).",
    )
    publish_dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "bfloat16", description="dtype of published weights (trainer keeps fp32 masters)."
    )
    publish_quantized: bool = Field(
        False,
        description="With generation.engine.quantize 'int8' or 'fp8' (hf engine): the trainer publishes "
        "the weights the generators quantize as codes plus per-channel fp32 scales, computed from "
        "its fp32 masters (about half the bytes of bf16; deltas stay lossless, on the codes); "
        "false: it publishes publish_dtype and each generator quantizes from that (docs/weights.md).",
    )
    full_every: int = Field(
        50, gt=0, description="With deltas: a full snapshot every this many versions."
    )
    sync_every: int = Field(1, gt=0, description="Publish every this many optimizer steps.")
    zstd_level: int = Field(
        1, ge=1, le=22, description="zstd level of the delta codec (1 is fastest)."
    )
    prefetch: bool = Field(
        False,
        description="Generators receive and verify updates in a background thread and "
        "pause only to apply them.",
    )

    @model_validator(mode="before")
    @classmethod
    def _translate_flat_keys(cls, data: Any) -> Any:
        return _tagged_transport(dict(data)) if isinstance(data, dict) else data

    @property
    def kind(self) -> str:
        """The transport's ``type``: 'inproc', 'shm', 'files', 'torch_dist' or 'tensor'."""
        return self.transport.type

    @property
    def forms_group(self) -> bool:
        """Whether generators join a torch_dist group (a restarted process cannot rejoin it)."""
        t = self.transport
        return t.type == "torch_dist" or (t.type == "tensor" and t.mode == "broadcast")
