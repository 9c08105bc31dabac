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

Every rank reports the files it wrote (name, size and sha256, taken right after the write);
rank 0, which commits the checkpoint, checks that it sees each of them with its size before
anything is committed (``unseen_files``): a rank whose shard went to a disk rank 0 does not
see (a checkpoint folder that is not shared across nodes) leaves the checkpoint uncommitted,
the newest committed one still the latest, and the error names the rank and the file. Every
rank's files and digests are recorded in the checkpoint's ``manifest.json``;
``loomrl.training.checkpoint.load_checkpoint`` verifies every one before anything loads
and names a file that does not match.
"""

from __future__ import annotations

import logging
import shutil
import socket
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from loomrl.training.checkpoint import (
    SHARDED_FORMAT,
    SHARDS_DIR,
    CheckpointError,
    newest_verified_hint,
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


def _writer(folder: Path):
    """DCP's ``FileSystemWriter`` for ``folder`` that records, in ``.written``, the names of
    the files this rank writes (its shard files; on the coordinator also ``.metadata``)."""
    # lazy: torch.distributed's checkpoint modules load only for a sharded trainer
    from torch.distributed.checkpoint import FileSystemWriter

    class RecordingWriter(FileSystemWriter):
        def __init__(self, path: str) -> None:
            super().__init__(path)
            self.written: set[str] = set()

        def write_data(self, plan, planner):
            future = super().write_data(plan, planner)
            future.wait()  # (FileSystemWriter writes before it returns; the future is done)
            self.written.update(result.storage_data.relative_path for result in future.value())
            return future

        def finish(self, metadata, results) -> None:
            super().finish(metadata, results)
            self.written.add(Path(self._get_metadata_path()).name)

    return RecordingWriter(str(folder))


def own_files(folder: Path, names: set[str]) -> dict[str, list]:
    """What this rank reports of the files it wrote into ``folder``: name -> [size, sha256]
    (on the rank's own view of the folder, right after the write)."""
    return {
        name: [(folder / name).stat().st_size, sha256_file(folder / name)] for name in sorted(names)
    }


def save_shards(model: torch.nn.Module, optimizer: torch.optim.Optimizer, folder: Path) -> dict:
    """Every rank writes its shards of the model and optimizer state into ``folder`` (which
    exists, and must be on a filesystem every rank sees); this rank's report of what it
    wrote: ``{"host": ..., "files": {name: [size, sha256]}}``."""
    # lazy: torch.distributed's checkpoint and FSDP modules load only for a sharded trainer
    import torch.distributed.checkpoint as dcp

    writer = _writer(folder)
    dcp.save(_state(model, optimizer), storage_writer=writer, no_dist=not _distributed())
    # dcp.save returns once rank 0 has written .metadata after every rank's shards
    return {"host": socket.gethostname(), "files": own_files(folder, writer.written)}


def unseen_files(folder: Path, reports: list[dict]) -> list[str]:
    """Every file a rank reported (``reports[rank]``, as ``save_shards`` answers) that is not
    in ``folder`` as this process sees it, or not with the size its writer reported: one
    line each, naming the rank, its host and the file."""
    problems = []
    for rank, report in enumerate(reports):
        for name, (size, _) in sorted(report["files"].items()):
            path = folder / name
            if not path.is_file():
                seen = "is missing"
            elif path.stat().st_size != size:
                seen = f"has {path.stat().st_size} bytes"
            else:
                continue
            problems.append(
                f"rank {rank} (on {report['host']}) wrote {SHARDS_DIR}/{name} ({size} bytes), "
                f"which here {seen}"
            )
    return problems


def _gather_reports(report: dict) -> list[dict]:
    if not _distributed():
        return [report]
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, report)
    return parts


def _verdict(root: Path, step: int, staging: Path, reports: list[dict]) -> str | None:
    """On rank 0: why the checkpoint of ``step`` must not be committed, or None; the same
    answer on every rank."""
    problems = []
    if not _distributed() or dist.get_rank() == 0:
        problems = unseen_files(staging, reports)
    verdict: list[Any] = [None]
    if problems:
        verdict[0] = (
            f"checkpoint of step {step} was not committed: {'; '.join(problems)} (the "
            f"committing rank 0 is on {socket.gethostname()}); the checkpoint folder must be "
            f"on storage every node of the trainer group sees ({root}); "
            f"{newest_verified_hint(root, step)}"
        )
    if _distributed():
        dist.broadcast_object_list(verdict, src=0)
    return verdict[0]


def save_sharded_checkpoint(
    trainer, root: Path, step: int, extra: dict[str, Any], keep: int
) -> Path | None:
    """Checkpoint a ``ShardedTrainer`` (every rank calls it): each rank writes its shards
    into a staging folder, the same on every rank (the checkpoint root must be on a
    filesystem all ranks see); rank 0 checks that it sees every file each rank wrote, then
    moves the folder into the checkpoint folder with the rest of the state (scheduler,
    version, ``extra``), atomically, as the single trainer's checkpoints are written. The
    folder's path on rank 0, None on the others; a file rank 0 does not see raises a
    ``CheckpointError`` on rank 0 (nothing committed, on any rank's view)."""
    rank = dist.get_rank() if _distributed() else 0
    staging = root / f".tmp-step_{step:06d}-shards"
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    if _distributed():
        dist.barrier()
    try:
        report = save_shards(trainer.model, trainer.optimizer, staging)
    except BaseException:
        if rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    reports = _gather_reports(report)
    refused = _verdict(root, step, staging, reports)
    if refused is not None:
        shutil.rmtree(staging, ignore_errors=True)  # every rank: its own view of the folder
        if rank == 0:
            raise CheckpointError(refused)
        return None
    if rank != 0:
        return None
    state = {
        "format": SHARDED_FORMAT,
        "scheduler": trainer.scheduler.state_dict(),
        "version": trainer.version,
        "world_size": dist.get_world_size() if _distributed() else 1,
    }
    digests = {name: sha for part in reports for name, (_, sha) in part["files"].items()}
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
