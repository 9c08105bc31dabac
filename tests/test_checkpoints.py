"""Checkpoints and weights: a NaN never reaches the weights, checkpoint files cannot run
code, bad manifests and missing files are named, and a bad newest checkpoint names the
newest one that verifies (``resume --from STEP``)."""

from __future__ import annotations

import errno
import json
import math
from pathlib import Path

import pytest
import torch

from loomrl.config import AlgorithmConfig, TrainerConfig
from loomrl.job import Job, resume_job
from loomrl.models import load_model_and_tokenizer
from loomrl.training.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from loomrl.training.trainer import Trainer
from loomrl.types import Group, Rollout

from conftest import TINY_MODEL


def _group(rewards: list[float]) -> Group:
    rollouts = [Rollout(0, [1, 2, 3], [4, 5], [-1.0, -1.0], [1, 1], 0, reward=r) for r in rewards]
    return Group.of_rollouts(0, 0, rollouts)


def test_non_finite_loss_is_refused_before_the_optimizer_steps():
    model, tok = load_model_and_tokenizer(TINY_MODEL)
    trainer = Trainer(model, tok, AlgorithmConfig(), TrainerConfig(precision="fp32"), 1.0)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    with pytest.raises(FloatingPointError, match="step was not applied"):
        trainer.train_step([_group([1.0, math.nan, 0.0, 1.0])])
    after = trainer.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # no NaN in the weights
    assert not trainer.optimizer.state  # nor in AdamW's moments
    assert trainer.version == 0
    trainer.train_step([_group([1.0, 0.0, 0.0, 1.0])])  # and the trainer still works
    assert trainer.version == 1 and all(torch.isfinite(p).all() for p in trainer.model.parameters())


class _RunsCode:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('ran')",))


def test_a_checkpoint_that_would_run_code_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "marker"
    path = save_checkpoint(
        tmp_path / "ckpt", 1, {"trainer": {"version": 1}, "x": _RunsCode(str(marker))}, keep=2
    )
    with pytest.raises(CheckpointError, match="more than tensors and plain data, refused"):
        load_checkpoint(path)
    assert not marker.exists()


def test_null_manifest_and_missing_files_are_named(tmp_path):
    path = save_checkpoint(
        tmp_path / "ckpt", 3, {"trainer": {"version": 3}, "t": torch.ones(2)}, keep=2
    )
    assert load_checkpoint(path)["trainer"]["version"] == 3  # plain data loads with weights_only
    (path / "manifest.json").write_text("null")
    with pytest.raises(CheckpointError, match="manifest.json has no 'sha256'"):
        load_checkpoint(path)
    (path / "state.pt").unlink()
    with pytest.raises(CheckpointError, match="incomplete: state.pt missing"):
        load_checkpoint(path)


def test_corrupted_newest_checkpoint_names_the_newest_that_verifies_and_resume_from_it(tiny_job):
    result = Job(tiny_job(trainer={"num_steps": 4}, checkpoint={"every_steps": 2, "keep": 5})).run()
    root = result.run_dir / "checkpoints"
    state = root / "step_000004" / "state.pt"
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0xFF
    state.write_bytes(bytes(data))
    with pytest.raises(
        CheckpointError,
        match=r"step_000004 is corrupted.*newest checkpoint that verifies is "
        rf"step_000002: `loomrl resume {result.run_dir} --from 2`",
    ):
        resume_job(result.run_dir)
    with pytest.raises(CheckpointError, match=r"no checkpoint of step 3 .*steps there: 2, 4"):
        resume_job(result.run_dir, from_step=3)
    resumed = resume_job(result.run_dir, from_step=2)
    assert resumed.summary["steps"] == 4
    trained = load_checkpoint(root / "step_000004")["controller"]["stream"]["trained"]
    assert len(trained) == 4 * 4 and len(set(trained)) == len(trained)


def _disk_full_at_step(monkeypatch, step: int) -> None:
    """``torch.save`` of the checkpoint of ``step`` writes part of the file, then the disk is full."""
    real_save = torch.save

    def save(obj, f, *args, **kwargs):
        if f"step_{step:06d}" in str(f):
            with open(f, "wb") as out:
                out.write(b"\0" * 4096)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)


@pytest.mark.parametrize(
    "metrics_fail_too", [False, True], ids=["checkpoint", "checkpoint+metrics"]
)
def test_disk_full_while_checkpointing_leaves_no_partial_folder_frees_shm_and_names_the_good_step(
    tiny_job, monkeypatch, metrics_fail_too
):
    import loomrl.weights.transports.setup as transport_setup
    from loomrl.telemetry.metrics import MetricsLogger

    made = []
    real_make = transport_setup.make_transport
    monkeypatch.setattr(
        transport_setup,
        "make_transport",
        lambda *a, **k: made.append(real_make(*a, **k)) or made[-1],
    )
    _disk_full_at_step(monkeypatch, 4)
    if metrics_fail_too:  # the disk stays full: closing the metrics log fails as well
        monkeypatch.setattr(
            MetricsLogger,
            "close",
            lambda self: (_ for _ in ()).throw(OSError(errno.ENOSPC, "full")),
        )
    cfg = tiny_job(
        trainer={"num_steps": 4},
        checkpoint={"every_steps": 2, "keep": 5},
        weight_sync={"transport": "shm"},
    )
    run_dir = Path(cfg.output_dir)
    with pytest.raises(
        CheckpointError,
        match=r"checkpoint of step 4 could not be written .*No space left on device"
        rf".*newest checkpoint that verifies is step_000002: `loomrl resume {run_dir} --from 2`",
    ):
        Job(cfg).run()
    root = run_dir / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step_000002"]  # no partial folder, no .tmp-*
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["job_failed"] is True and "step 4" in summary["error"]
    assert made and all(not t.index_path.exists() for t in made if hasattr(t, "index_path"))
    assert not list(Path(made[0].root).glob(f"loomrl-{made[0].channel}.*"))
    monkeypatch.undo()
    assert resume_job(run_dir, from_step=2).summary["steps"] == 4


def test_a_run_stopped_while_saving_its_final_model_is_not_taken_as_finished(tiny_job):
    result = Job(tiny_job(trainer={"num_steps": 2}, checkpoint={"every_steps": 2})).run()
    summary_path = result.run_dir / "summary.json"
    stopped = {**json.loads(summary_path.read_text()), "interrupted": True, "stopped_by": "SIGTERM"}
    # as a second SIGTERM during save_pretrained leaves it
    summary_path.write_text(json.dumps(stopped))
    resumed = resume_job(result.run_dir)
    assert not resumed.summary.get("already_finished") and resumed.summary["steps"] == 2
    assert (
        not resumed.summary["interrupted"] and (result.run_dir / "final" / "config.json").is_file()
    )


def test_torch_saves_short_write_reads_as_a_checkpoint_not_written(tmp_path, monkeypatch):
    # A full disk under torch's zip writer is a RuntimeError, not an OSError.
    from loomrl.training import checkpoint as ckpt

    root = tmp_path / "run" / "checkpoints"
    ckpt.save_checkpoint(root, 2, {"trainer": {"version": 2}}, keep=5)

    def full_disk(obj, path):
        Path(path).write_bytes(b"PK partial")
        raise RuntimeError(
            "[enforce fail at inline_container.cc:672] . unexpected pos 4480 vs 4374\n"
            "frame #0: c10::ThrowEnforceNotMet"
        )

    monkeypatch.setattr(ckpt.torch, "save", full_disk)
    with pytest.raises(
        CheckpointError,
        match=r"checkpoint of step 4 could not be written .*torch.save.*unexpected pos 4480 vs 4374"
        r".*a full disk\?.*newest checkpoint that verifies is step_000002: `loomrl resume .* --from 2`",
    ) as err:
        ckpt.save_checkpoint(root, 4, {"trainer": {"version": 4}}, keep=5)
    assert "frame #0" not in str(err.value)
    assert sorted(p.name for p in root.iterdir()) == ["step_000002"]
