"""A DCP checkpoint handed over by someone else runs no code on resume (issue 49, item 1):
``trainer/.metadata`` and the state's plain values are read without running code
(``loomrl.training.dcp_reader``), even with the manifest's digests recomputed by the
file's author; a real DCP checkpoint still loads."""

from __future__ import annotations

import json
import os
import pickle
import warnings
from pathlib import Path

import pytest
from test_fsdp import TINY, _configs, _uneven_groups

from loomrl.training.checkpoint import CheckpointError, load_checkpoint, sha256_file


class _Touch:
    """Unpickled, it would create ``marker`` (by os.system or by pathlib)."""

    def __init__(self, marker: Path, how: str) -> None:
        self.marker, self.how = marker, how

    def __reduce__(self):
        if self.how == "os.system":
            return os.system, (f"touch {self.marker}",)
        return Path.touch, (Path(self.marker),)


def _trainer(seed: int):
    from loomrl.models.tiny import build_tiny_model
    from loomrl.training.trainer import Trainer

    return Trainer(*build_tiny_model("llama", seed=seed, **TINY), *_configs("token"), 1.0)


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    """A real DCP checkpoint of the single trainer after one step."""
    from loomrl.training.dcp import save_sharded_checkpoint

    trainer = _trainer(seed=3)
    trainer.train_step(_uneven_groups())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return save_sharded_checkpoint(trainer, tmp_path / "checkpoints", 1, {}, keep=2)


def _recompute_digests(path: Path) -> None:
    """What the author of a handed checkpoint does: digests that match their files."""
    manifest = json.loads((path / "manifest.json").read_text())
    folder = path / "trainer"
    manifest["files"] = {f"trainer/{p.name}": sha256_file(p) for p in folder.iterdir()}
    (path / "manifest.json").write_text(json.dumps(manifest))


def _resume_trainer_from(path: Path) -> None:
    """What a resume does with a checkpoint: verify and load it, then the trainer's state."""
    _trainer(seed=11).load_state_dict(load_checkpoint(path)["trainer"])


def test_a_real_dcp_checkpoint_still_resumes(checkpoint):
    trainer = _trainer(seed=11)
    trainer.load_state_dict(load_checkpoint(checkpoint)["trainer"])
    assert trainer.version == 1
    assert trainer.optimizer.param_groups[0]["betas"] == (0.9, 0.999)


@pytest.mark.parametrize("how", ["os.system", "pathlib"])
def test_crafted_metadata_is_refused_by_name_before_it_runs(checkpoint, tmp_path, how):
    marker = tmp_path / f"ran-{how}"
    metadata = checkpoint / "trainer" / ".metadata"
    metadata.write_bytes(pickle.dumps(_Touch(marker, how)))
    _recompute_digests(checkpoint)
    with pytest.raises(CheckpointError, match="not part of DCP checkpoint metadata") as info:
        _resume_trainer_from(checkpoint)
    assert str(metadata) in str(info.value)
    assert not marker.exists()


def test_metadata_hiding_code_among_real_entries_is_refused(checkpoint, tmp_path):
    from loomrl.training.dcp_reader import read_dcp_metadata

    marker = tmp_path / "ran"
    metadata = checkpoint / "trainer" / ".metadata"
    real = read_dcp_metadata(metadata)
    real.planner_data = {"x": _Touch(marker, "os.system")}
    metadata.write_bytes(pickle.dumps(real))
    _recompute_digests(checkpoint)
    with pytest.raises(CheckpointError, match=r"names posix\.system|names os\.system"):
        _resume_trainer_from(checkpoint)
    assert not marker.exists()


def test_a_crafted_plain_value_in_the_shards_is_refused(checkpoint, tmp_path):
    """An optimizer value (DCP reads those with weights_only=False) that would run code."""
    import torch.distributed.checkpoint as dcp

    from loomrl.training.dcp import _state

    marker = tmp_path / "ran"
    trainer = _trainer(seed=3)
    trainer.train_step(_uneven_groups())
    state = _state(trainer.model, trainer.optimizer)
    state["optimizer"]["param_groups"][0]["lr"] = _Touch(marker, "os.system")
    folder = checkpoint / "trainer"
    for file in folder.iterdir():
        file.unlink()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(folder), no_dist=True)
    _recompute_digests(checkpoint)
    with pytest.raises(CheckpointError, match=r"'optimizer.param_groups.0.lr' holds more"):
        _resume_trainer_from(checkpoint)
    assert not marker.exists()


def test_metadata_pointing_outside_its_folder_is_refused(checkpoint):
    from loomrl.training.dcp_reader import read_dcp_metadata

    metadata = checkpoint / "trainer" / ".metadata"
    real = read_dcp_metadata(metadata)
    first = next(iter(real.storage_data))
    real.storage_data[first].relative_path = "../../state.pt"
    metadata.write_bytes(pickle.dumps(real))
    _recompute_digests(checkpoint)
    with pytest.raises(CheckpointError, match=r"points at shard file '../../state.pt'"):
        _resume_trainer_from(checkpoint)
