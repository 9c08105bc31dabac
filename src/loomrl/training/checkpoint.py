"""Atomic, verified checkpoints.

A checkpoint is a folder ``checkpoints/step_000010/`` holding ``state.pt`` (trainer state,
RNG states, controller state) and ``manifest.json`` (version, sha256 of ``state.pt``). A
sharded trainer's checkpoint also holds ``trainer/``, the ranks' DCP files
(``loomrl.training.dcp``), each with its sha256 in the manifest's ``files``. It is written
under a temporary name and renamed into place, so a crash never leaves a partial checkpoint
under a real name; every digest is verified before anything is loaded.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import random
import shutil
from pathlib import Path
from typing import Any

import torch

from loomrl.runtime.base import UnrecoverableError

logger = logging.getLogger(__name__)

STATE_FILE = "state.pt"
MANIFEST_FILE = "manifest.json"
SHARDS_DIR = "trainer"  # a sharded trainer's DCP files (loomrl.training.dcp)
SHARDED_FORMAT = "dcp"  # the trainer state's "format" where its tensors are in SHARDS_DIR


class CheckpointError(UnrecoverableError):
    """A checkpoint that is missing, incomplete or corrupted (in a job: it stops, never
    restarts into the same storage)."""


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "python": random.getstate()}


def restore_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])


def save_checkpoint(
    root: Path,
    step: int,
    state: dict[str, Any],
    keep: int,
    shards: tuple[Path, dict[str, str]] | None = None,
) -> Path:
    """Write ``state`` as ``root/step_{step:06d}`` atomically; keep the newest ``keep``.
    ``shards``: a folder already written (a sharded trainer's DCP files) and the sha256 of
    each file in it, moved into the checkpoint as ``trainer/``.

    A write that fails (a full disk) removes its partial folder, which also gives back the
    space it took, and raises a ``CheckpointError`` naming the step and the newest
    checkpoint that verifies, the one to resume from."""
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:06d}"
    tmp = root / f".tmp-step_{step:06d}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        _write_folder(tmp, step, state, shards)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        if shards is not None:
            shutil.rmtree(shards[0], ignore_errors=True)
        if isinstance(err, OSError):
            raise CheckpointError(_failed_write_message(root, final, err)) from err
        raise
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    for old in list_checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _write_folder(
    tmp: Path, step: int, state: dict[str, Any], shards: tuple[Path, dict[str, str]] | None
) -> None:
    tmp.mkdir()
    files = {}
    if shards is not None:
        folder, digests = shards
        os.replace(folder, tmp / SHARDS_DIR)
        files = {f"{SHARDS_DIR}/{name}": digest for name, digest in digests.items()}
    try:
        torch.save(state, tmp / STATE_FILE)
    except RuntimeError as err:
        # torch's zip writer reports a short write (a full disk, a quota) as a RuntimeError
        # ("[enforce fail at inline_container.cc:672] . unexpected pos ..."): a write failure.
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise OSError(f"torch.save failed: {first_line}; a full disk?") from err
    with (tmp / STATE_FILE).open("rb") as f:
        os.fsync(f.fileno())
    manifest = {
        "step": step,
        "version": state.get("trainer", {}).get("version"),
        "sha256": sha256_file(tmp / STATE_FILE),
        **({"files": files} if files else {}),
    }
    (tmp / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2))


def newest_verified_hint(root: Path, step: int) -> str:
    """Which checkpoint under ``root`` older than ``step`` to resume from, as a sentence."""
    good = newest_verified(root, below=root / f"step_{step:06d}")
    return (
        f"the newest checkpoint that verifies is {good.name}: `loomrl resume {root.parent} --from {checkpoint_step(good)}`"
        if good is not None
        else "no earlier checkpoint verifies: there is nothing to resume from yet"
    )


def _failed_write_message(root: Path, final: Path, err: OSError) -> str:
    step = checkpoint_step(final)
    return (
        f"checkpoint of step {step} could not be written under {root} ({err}); its partial "
        f"folder was removed; {newest_verified_hint(root, step)}"
    )


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoint folders, oldest first (temporary ones are ignored)."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_"))


def load_checkpoint(path: Path) -> dict[str, Any]:
    """Load and verify one checkpoint folder; raises ``CheckpointError`` on any defect.

    ``state.pt`` is unpickled with ``weights_only=True``: tensors and plain containers
    only, so a checkpoint folder from someone else cannot run code on load."""
    missing = [name for name in (MANIFEST_FILE, STATE_FILE) if not (path / name).is_file()]
    if missing:
        raise CheckpointError(f"checkpoint {path} is incomplete: {' and '.join(missing)} missing")
    manifest_path, state_path = path / MANIFEST_FILE, path / STATE_FILE
    try:
        manifest = json.loads(manifest_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"checkpoint {path}: unreadable {MANIFEST_FILE} ({err})") from None
    expected = manifest.get("sha256") if isinstance(manifest, dict) else None
    if not isinstance(expected, str):
        raise CheckpointError(
            f"checkpoint {path}: {MANIFEST_FILE} has no 'sha256' string (got {manifest!r:.80})"
        )
    actual = sha256_file(state_path)
    if actual != expected:
        raise CheckpointError(
            f"checkpoint {path} is corrupted: sha256 of {STATE_FILE} is {actual[:16]}..., "
            f"manifest says {expected[:16]}...; refusing to load it"
        )
    _verify_files(path, manifest.get("files", {}))
    try:
        state = torch.load(state_path, weights_only=True)
    except pickle.UnpicklingError as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(
            f"checkpoint {path}: {STATE_FILE} holds more than tensors and plain data, refused unloaded ({first})"
        ) from None
    trainer = state.get("trainer") if isinstance(state, dict) else None
    if isinstance(trainer, dict) and trainer.get("format") == SHARDED_FORMAT:
        if f"{SHARDS_DIR}/.metadata" not in manifest.get("files", {}):
            raise CheckpointError(
                f"checkpoint {path}: its trainer state is sharded but {MANIFEST_FILE} lists no "
                f"digests of {SHARDS_DIR}/.metadata; refusing to load shards it cannot verify"
            )
        trainer["path"] = str(path / SHARDS_DIR)  # where this folder is now
    return state


def _verify_files(path: Path, files: Any) -> None:
    """Every file the manifest lists (a sharded trainer's DCP files) is there and has its
    recorded sha256; raises ``CheckpointError`` naming the first that is not."""
    if not isinstance(files, dict):
        raise CheckpointError(f"checkpoint {path}: {MANIFEST_FILE} 'files' is not a mapping")
    for name, expected in sorted(files.items()):
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint {path} is incomplete: {name} missing")
        actual = sha256_file(file)
        if actual != expected:
            raise CheckpointError(
                f"checkpoint {path} is corrupted: sha256 of {name} is {actual[:16]}..., "
                f"manifest says {str(expected)[:16]}...; refusing to load it"
            )


def latest_checkpoint(root: Path) -> Path | None:
    found = list_checkpoints(root)
    return found[-1] if found else None


def checkpoint_step(path: Path) -> int:
    return int(path.name.removeprefix("step_"))


def find_checkpoint(root: Path, step: int) -> Path:
    """The checkpoint of ``step`` under ``root``, or an error listing the ones there are."""
    for path in list_checkpoints(root):
        if checkpoint_step(path) == step:
            return path
    have = ", ".join(str(checkpoint_step(p)) for p in list_checkpoints(root)) or "none"
    raise CheckpointError(f"no checkpoint of step {step} under {root} (steps there: {have})")


def newest_verified(root: Path, below: Path) -> Path | None:
    """The newest checkpoint older than ``below`` that loads and verifies, if any."""
    for path in reversed([p for p in list_checkpoints(root) if p.name < below.name]):
        try:
            load_checkpoint(path)
        except CheckpointError:
            continue
        return path
    return None
