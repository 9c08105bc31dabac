"""Sharded checkpoints of the trainer's model and AdamW state with
``torch.distributed.checkpoint`` (DCP).

Every rank of a sharded trainer writes its own shards (``dcp.save`` of the sharded state
``get_state_dict`` returns: DTensors keyed by parameter name) into one folder, the
checkpoint's ``trainer/``: a ``__<rank>_<n>.distcp`` file per rank and rank 0's
``.metadata`` (which shard of which tensor is where). Nothing is gathered on one rank.

Loading (``load_shards``) asks DCP for the state this trainer holds, and DCP reads each
rank's pieces from whichever files hold them: a checkpoint of N ranks loads on M ranks
(resharding) and on the single trainer (no process group: DCP reads it whole).

A checkpoint folder may be handed over by someone else: its ``.metadata`` and plain values
are read without running code (``loomrl.training.dcp_reader``).

Each file's sha256 is taken right after the write by the ranks (each hashes a share of the
files, ``file_digests``) and recorded in the checkpoint's ``manifest.json``;
``loomrl.training.checkpoint.load_checkpoint`` verifies every one before anything loads
and names a file that does not match.
"""

from __future__ import annotations

import logging
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from loomrl.training.checkpoint import (
    SHARDED_FORMAT,
    SHARDS_DIR,
    CheckpointError,
    save_checkpoint,
    sha256_file,
)
from loomrl.training.optim_state import apply_optimizer_config

logger = logging.getLogger(__name__)

__all__ = [
    "SHARDED_FORMAT",
    "SHARDS_DIR",
    "load_shards",
    "load_trainer_state",
    "save_sharded_checkpoint",
    "save_shards",
]


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The model's and the optimizer's state as DCP reads and writes it: this rank's shards
    (DTensors) under FSDP, the whole tensors on a single trainer; keyed by parameter name."""
    # lazy: torch.distributed's checkpoint and FSDP modules load only for a sharded trainer
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optimizer_state}


def file_digests(folder: Path) -> dict[str, str]:
    """The sha256 of every file in ``folder`` (by name), on every rank: rank r hashes the
    r-th, (r+N)-th ... file, and the ranks exchange what they found."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if _distributed() else (0, 1)
    names = sorted(p.name for p in folder.iterdir() if p.is_file())
    mine = {name: sha256_file(folder / name) for name in names[rank::world]}
    if world == 1:
        return mine
    parts: list[Any] = [None] * world
    dist.all_gather_object(parts, mine)
    return {name: digest for part in parts for name, digest in sorted(part.items())}


def save_shards(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, folder: Path
) -> dict[str, str]:
    """Every rank writes its shards of the model and optimizer state into ``folder`` (which
    exists, on a filesystem every rank sees); the sha256 of each file written, by name."""
    # lazy: torch.distributed's checkpoint and FSDP modules load only for a sharded trainer
    import torch.distributed.checkpoint as dcp

    dcp.save(_state(model, optimizer), checkpoint_id=str(folder), no_dist=not _distributed())
    # dcp.save returns once rank 0 has written .metadata after every rank's shards
    return file_digests(folder)


def save_sharded_checkpoint(
    trainer, root: Path, step: int, extra: dict[str, Any], keep: int
) -> Path | None:
    """Checkpoint a ``ShardedTrainer`` (every rank calls it): each rank writes its shards
    into a staging folder, the same on every rank (the checkpoint root must be on a
    filesystem all ranks see); rank 0 then moves it into the checkpoint folder with the
    rest of the state (scheduler, version, ``extra``), atomically, as the single trainer's
    checkpoints are written. The folder's path on rank 0, None on the others."""
    rank = dist.get_rank() if _distributed() else 0
    staging = root / f".tmp-step_{step:06d}-shards"
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    if _distributed():
        dist.barrier()
    try:
        digests = save_shards(trainer.model, trainer.optimizer, staging)
    except BaseException:
        if rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    if rank != 0:
        return None
    state = {
        "format": SHARDED_FORMAT,
        "scheduler": trainer.scheduler.state_dict(),
        "version": trainer.version,
        "world_size": dist.get_world_size() if _distributed() else 1,
    }
    return save_checkpoint(root, step, {"trainer": state, **extra}, keep, shards=(staging, digests))


def load_shards(model: torch.nn.Module, optimizer: torch.optim.Optimizer, folder: Path) -> None:
    """Load this trainer's shards of the model and optimizer state from a DCP ``folder``
    written on any number of ranks (verified by the checkpoint's manifest beforehand)."""
    # lazy: torch.distributed's checkpoint and FSDP modules load only for a sharded trainer
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import set_state_dict

    from loomrl.training.dcp_reader import SafeFileSystemReader, SafeLoadPlanner, read_dcp_metadata

    if not (folder / ".metadata").is_file():
        raise FileNotFoundError(f"sharded trainer state {folder} has no .metadata")
    # the folder may come from someone else: its metadata and plain values are read without
    # running code (loomrl.training.dcp_reader), its tensors with weights_only as DCP does;
    # the metadata is checked first so that a refusal names the file, not DCP's fallbacks
    read_dcp_metadata(folder / ".metadata")
    state = _state(model, optimizer)
    reader, planner = SafeFileSystemReader(folder), SafeLoadPlanner()
    try:
        with warnings.catch_warnings():  # (DCP warns that a single process loads: it is meant)
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, storage_reader=reader, planner=planner, no_dist=not _distributed())
    except CheckpointException as err:
        refused = [exc for exc, _ in err.failures.values() if isinstance(exc, CheckpointError)]
        if refused:
            raise refused[0] from None
        raise
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optimizer"],
    )


def load_trainer_state(trainer, state: dict[str, Any]) -> None:
    """Continue ``trainer`` (a ``Trainer`` or ``ShardedTrainer``) from a checkpoint's trainer
    state in the DCP format: the shards from ``state["path"]`` (set by ``load_checkpoint``),
    then the scheduler and the version."""
    if "path" not in state:
        raise ValueError(
            "a sharded trainer state carries no 'path' of its shards: load it with "
            "loomrl.training.checkpoint.load_checkpoint, which sets it"
        )
    folder = Path(state["path"])
    world = dist.get_world_size() if _distributed() else 1
    saved = int(state.get("world_size", 0))
    if saved != world:
        logger.info("resharding a checkpoint of %d trainer ranks onto %d", saved, world)
    load_shards(trainer.model, trainer.optimizer, folder)
    trainer.scheduler.load_state_dict(state["scheduler"])
    apply_optimizer_config(trainer.optimizer, trainer.scheduler, trainer.cfg)
    trainer.version = int(state["version"])
