"""A sharded (DCP) checkpoint is committed only whole (issue 54, item 6): every rank reports
the files it wrote, rank 0 checks that it sees each of them with its size before the
checkpoint is committed, and the manifest lists every rank's files. A rank whose shard went
where rank 0 cannot see it (a checkpoint folder not shared across nodes) leaves nothing
committed: the previous checkpoint stays the latest and resumes, and the error names the rank
and the file."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
from spawned import end_rank
from test_fsdp import TINY, _configs, _uneven_groups

from loomrl.training.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint

pytestmark = pytest.mark.timeout(300)

SHARED = "the checkpoint folder must be on storage every node of the trainer group sees"


def test_unseen_files_names_the_rank_and_the_file(tmp_path):
    from loomrl.training.dcp import unseen_files

    (tmp_path / "__0_0.distcp").write_bytes(b"abcd")
    (tmp_path / "__1_0.distcp").write_bytes(b"ab")  # shorter than its writer said
    reports = [
        {"host": "node-a", "files": {"__0_0.distcp": [4, "x"]}},
        {"host": "node-b", "files": {"__1_0.distcp": [3, "y"], "__1_1.distcp": [5, "z"]}},
    ]
    assert unseen_files(tmp_path, reports) == [
        "rank 1 (on node-b) wrote trainer/__1_0.distcp (3 bytes), which here has 2 bytes",
        "rank 1 (on node-b) wrote trainer/__1_1.distcp (5 bytes), which here is missing",
    ]
    assert unseen_files(tmp_path, reports[:1]) == []


def _trainer(seed: int):
    from loomrl.models.tiny import build_tiny_model
    from loomrl.training.trainer import Trainer

    return Trainer(*build_tiny_model("llama", seed=seed, **TINY), *_configs("token"), 1.0)


def _save(trainer, root: Path, step: int):
    from loomrl.training.dcp import save_sharded_checkpoint

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (DCP warns that a single process saves: it is meant)
        return save_sharded_checkpoint(trainer, root, step, {}, keep=3)


def test_a_checkpoint_a_rank_reported_unseen_files_for_is_not_committed(tmp_path, monkeypatch):
    """One process: a second rank's report (as the gather would bring it) names a file that
    is not in the folder; nothing is committed and the previous checkpoint resumes."""
    import loomrl.training.dcp as dcp_module

    root, trainer = tmp_path / "checkpoints", _trainer(seed=3)
    trainer.train_step(_uneven_groups())
    first = _save(trainer, root, 1)
    trainer.train_step(_uneven_groups())
    other = {"host": "node-b", "files": {"__1_0.distcp": [123, "f" * 64]}}
    monkeypatch.setattr(dcp_module, "_gather_reports", lambda report: [report, other])
    with pytest.raises(CheckpointError) as info:
        _save(trainer, root, 2)
    message = str(info.value)
    assert "checkpoint of step 2 was not committed" in message
    assert (
        "rank 1 (on node-b) wrote trainer/__1_0.distcp (123 bytes), which here is missing"
        in message
    )
    assert SHARED in message and "the newest checkpoint that verifies is step_000001" in message
    assert latest_checkpoint(root) == first and sorted(p.name for p in root.iterdir()) == [
        first.name
    ]
    resumed = _trainer(seed=11)
    resumed.load_state_dict(load_checkpoint(first)["trainer"])
    assert resumed.version == 1


def _hide_a_shard(rank: int, world_size: int, rendezvous: str, root: str, out: str):
    """One rank (run by torch.multiprocessing.spawn): a committed checkpoint of step 1; at
    step 2 rank 1's shard goes, after its report, to a folder rank 0 does not see (another
    node's disk); then both ranks resume from the latest checkpoint and take a step."""
    import torch
    import torch.distributed as dist
    from test_fsdp_checkpoint import _trainer as sharded_trainer

    import loomrl.training.dcp as dcp_module

    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world_size)
    root_path, groups = Path(root), _uneven_groups()
    trainer = sharded_trainer(rank, world_size, seed=3)
    trainer.train_step(groups)
    dcp_module.save_sharded_checkpoint(trainer, root_path, 1, {}, keep=3)
    trainer.train_step(groups)
    if rank == 1:
        report_files = dcp_module.own_files

        def report_then_move(folder: Path, names: set[str]) -> dict:
            reported = report_files(folder, names)
            elsewhere = root_path.parent / "node-b-disk"
            elsewhere.mkdir()
            for name in names:
                (folder / name).rename(elsewhere / name)
            return reported

        dcp_module.own_files = report_then_move
    error, answer = None, None
    try:
        answer = dcp_module.save_sharded_checkpoint(trainer, root_path, 2, {}, keep=3)
    except CheckpointError as err:
        error = str(err)
    latest = latest_checkpoint(root_path)
    resumed = sharded_trainer(rank, world_size, seed=11)
    resumed.load_state_dict(load_checkpoint(latest)["trainer"])
    version = resumed.version
    resumed.train_step(groups)
    torch.save({"error": error, "answer": answer, "version": version}, f"{out}.{rank}")
    end_rank()


@pytest.mark.slow
def test_a_two_rank_checkpoint_missing_a_shard_is_never_committed(tmp_path):
    import torch
    import torch.multiprocessing as mp

    from loomrl.runtime.group import new_rendezvous

    root, out = tmp_path / "checkpoints", str(tmp_path / "rank")
    mp.spawn(_hide_a_shard, (2, new_rendezvous("127.0.0.1"), str(root), out), nprocs=2)
    got = [torch.load(f"{out}.{rank}", weights_only=False) for rank in (0, 1)]
    # the normal path: the manifest lists every rank's files
    first = root / "step_000001"
    manifest = json.loads((first / "manifest.json").read_text())
    assert {"trainer/.metadata", "trainer/__0_0.distcp", "trainer/__1_0.distcp"} <= set(
        manifest["files"]
    )
    assert sorted(manifest["files"]) == sorted(
        f"trainer/{p.name}" for p in (first / "trainer").iterdir()
    )
    # the shard rank 0 did not see: nothing committed, the error on rank 0 names rank 1's file
    assert got[0]["answer"] is None and got[1]["answer"] is None and got[1]["error"] is None
    assert "checkpoint of step 2 was not committed: rank 1 (on " in got[0]["error"]
    assert (
        "wrote trainer/__1_0.distcp" in got[0]["error"]
        and "which here is missing" in got[0]["error"]
    )
    assert SHARED in got[0]["error"]
    assert sorted(p.name for p in root.iterdir()) == ["step_000001"]  # no staging left either
    # the previous checkpoint stays the latest and resumes on both ranks
    assert [g["version"] for g in got] == [1, 1]
