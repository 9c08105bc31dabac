"""Sharded (DCP) checkpoints of the fsdp2 trainer (``loomrl.training.dcp``): every rank
writes its shard, a resume on the same rank count is bit-identical to the run that went on,
a 2-rank checkpoint resumes on one rank and on the single trainer, and a corrupted shard is
refused by name."""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import signal

import pytest
from spawned import end_rank
from step_checks import assert_same_step
from test_fsdp import SYNC, TINY, _configs, _uneven_groups

from loomrl.job import Job, resume_job
from loomrl.telemetry.metrics import read_metrics
from loomrl.training.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    load_checkpoint,
)

pytestmark = pytest.mark.timeout(300)

STEP_KEYS = ("train/loss", "train/grad_norm", "train/update_rms", "train/lr")


def _trainer(rank: int, world_size: int, seed: int):
    from torch.distributed.device_mesh import init_device_mesh

    from loomrl.models.tiny import build_tiny_model
    from loomrl.training.fsdp import ShardedTrainer, shard_model

    model, tok = build_tiny_model("llama", seed=seed, **TINY)
    shard_model(model, init_device_mesh("cpu", (world_size,)), "fp32", reshard=True)
    return ShardedTrainer(model, tok, *_configs("token"), 1.0, rank=rank, world_size=world_size)


def _save_then_resume(rank: int, world_size: int, rendezvous: str, root: str, out: str):
    """One rank (run by torch.multiprocessing.spawn): a step, a sharded checkpoint, a
    second step; then a fresh trainer (other initial weights) resumes from the checkpoint
    and takes the second step again."""
    from pathlib import Path

    import torch
    import torch.distributed as dist

    from loomrl.training.dcp import save_sharded_checkpoint

    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world_size)
    trainer, groups = _trainer(rank, world_size, seed=3), _uneven_groups()
    trainer.train_step(groups)
    path = save_sharded_checkpoint(trainer, Path(root), 1, {"marker": 7}, keep=2)
    uninterrupted = trainer.train_step(groups)
    uninterrupted_state = trainer.state_dict()
    path_list: list = [path]
    dist.broadcast_object_list(path_list)  # rank 0's answer: the folder
    resumed = _trainer(rank, world_size, seed=11)
    resumed.load_state_dict(load_checkpoint(path_list[0])["trainer"])
    again = resumed.train_step(groups)
    again_state = resumed.state_dict()
    if rank == 0:
        torch.save(
            {
                "path": str(path),
                "uninterrupted": uninterrupted,
                "again": again,
                "states": (uninterrupted_state["model"], again_state["model"]),
            },
            out,
        )
    end_rank()


def test_a_sharded_checkpoint_resumes_bit_identically_on_two_ranks_and_on_one_trainer(tmp_path):
    import torch
    import torch.multiprocessing as mp

    from loomrl.models.tiny import build_tiny_model
    from loomrl.runtime.group import new_rendezvous
    from loomrl.training.trainer import Trainer

    root, out = tmp_path / "checkpoints", str(tmp_path / "rank0.pt")
    mp.spawn(_save_then_resume, (2, new_rendezvous("127.0.0.1"), str(root), out), nprocs=2)
    got = torch.load(out, weights_only=False)
    path = latest_checkpoint(root)
    assert got["path"] == str(path) and path.name == "step_000001"
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp")]  # staging moved in
    # every rank wrote its own shard file, and each file's digest is in the manifest
    manifest = json.loads((path / "manifest.json").read_text())
    shard_files = sorted(p.name for p in (path / "trainer").iterdir())
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= set(shard_files)
    assert sorted(manifest["files"]) == [f"trainer/{n}" for n in shard_files]
    state = load_checkpoint(path)
    assert state["marker"] == 7 and state["trainer"]["world_size"] == 2
    assert "model" not in state["trainer"]  # the tensors are in the shards only

    # on 2 ranks again: the same second step, bit for bit
    for key in STEP_KEYS:
        assert got["again"][key] == got["uninterrupted"][key], key
    for name, tensor in got["states"][0].items():
        assert torch.equal(got["states"][1][name], tensor), name

    # on the single trainer (no process group: DCP reads both shards whole)
    single = Trainer(*build_tiny_model("llama", seed=11, **TINY), *_configs("token"), 1.0)
    single.load_state_dict(state["trainer"])
    assert single.version == 1
    step = single.train_step(_uneven_groups())
    assert_same_step(step, got["uninterrupted"], STEP_KEYS)

    # a corrupted shard is refused, by name, before anything loads
    shard = path / "trainer" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"corrupted: sha256 of trainer/__1_0.distcp"):
        load_checkpoint(path)
    shard.unlink()
    with pytest.raises(CheckpointError, match=r"incomplete: trainer/__1_0.distcp missing"):
        load_checkpoint(path)
    del manifest["files"]  # a manifest that vouches for no shard
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"sharded but manifest.json lists no digests"):
        load_checkpoint(path)


def _steps(run_dir) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(run_dir) if "train/loss" in r}


def _extend(run_dir, num_steps: int, parallel: dict) -> None:
    """Let a finished run go on to ``num_steps``, on another trainer layout."""
    config = json.loads((run_dir / "config.json").read_text())
    config["trainer"]["num_steps"] = num_steps
    old = config["trainer"]["parallel"]  # a tagged table: another type takes only its own keys
    config["trainer"]["parallel"] = (
        {**old, **parallel} if old["type"] == parallel["type"] else parallel
    )
    (run_dir / "config.json").write_text(json.dumps(config))


@pytest.mark.slow
def test_a_two_rank_job_resumes_exactly_on_two_ranks_and_closely_on_one(tiny_job, tmp_path):
    common = {**SYNC, "runtime": "process", "weight_sync": {"codec": "delta"}}
    fsdp2 = {"micro_batch_size": 4, "parallel": {"type": "fsdp2", "dp_shard": 2}}
    full = Job(
        tiny_job(**common, trainer={**fsdp2, "num_steps": 3}, output_dir=str(tmp_path / "full"))
    ).run()
    part = Job(
        tiny_job(**common, trainer={**fsdp2, "num_steps": 2}, output_dir=str(tmp_path / "part"))
    ).run()
    checkpoint = latest_checkpoint(part.run_dir / "checkpoints")
    assert checkpoint.name == "step_000002" and (checkpoint / "trainer" / ".metadata").is_file()
    want = _steps(full.run_dir)[3]
    layouts = {
        "two": {"type": "fsdp2", "dp_shard": 2},
        "one": {"type": "fsdp2", "dp_shard": 1},
        "single": {"type": "single"},
    }
    for name, parallel in layouts.items():
        run_dir = tmp_path / name
        shutil.copytree(part.run_dir, run_dir)
        _extend(run_dir, 3, parallel)
        got = _steps(resume_job(run_dir).run_dir)[3]
        assert got["rollout/reward_mean"] == want["rollout/reward_mean"], name
        for key in ("train/loss", "train/grad_norm"):
            if name == "two":  # the same rank count: bit-identical, not approximately equal
                assert got[key] == want[key], (name, key)
            else:  # another reduction order: fp32 rounding (the equivalence test's bounds)
                assert_same_step(got, want, (key,))
    assert not multiprocessing.active_children()


def _rank_pid(runtime: str, name: str) -> int:
    """The pid of executor ``name`` (a child process, or a Ray actor's worker here)."""
    if runtime == "process":
        (proc,) = [p for p in multiprocessing.active_children() if p.name == f"loomrl-{name}"]
        return proc.pid
    import ray

    (actor,) = [
        a for a in ray.util.list_named_actors(all_namespaces=True) if f"-{name}-" in a["name"]
    ]
    handle = ray.get_actor(actor["name"], namespace=actor["namespace"])
    _, (_, where), _, _ = ray.get(handle.ready.remote(), timeout=60)
    return where["pid"]


@pytest.mark.slow
@pytest.mark.parametrize("runtime", ["process", pytest.param("ray", marks=pytest.mark.ray)])
def test_a_rank_killed_mid_job_restarts_from_its_sharded_checkpoint(
    request, tiny_job, tmp_path, runtime, caplog
):
    if runtime == "ray":
        request.getfixturevalue("ray_cluster")
    cfg = tiny_job(
        **SYNC,
        runtime=runtime,
        trainer={"num_steps": 6, "parallel": {"type": "fsdp2", "dp_shard": 2}},
        checkpoint={"every_steps": 2},
        output_dir=str(tmp_path / "run"),
        **({"ray": {"num_cpus": {"trainer": 0.5, "generator": 0.5}}} if runtime == "ray" else {}),
    )
    killed = []

    def kill_rank1(record):
        if record.get("step") == 3 and "train/loss" in record and not killed:
            killed.append(_rank_pid(runtime, "trainer.rank1"))
            os.kill(killed[0], signal.SIGKILL)

    with caplog.at_level("INFO"):
        result = Job(cfg).run(on_record=kill_rank1)
    assert killed
    records = read_metrics(result.run_dir)
    assert [r for r in records if r.get("event") == "resume"][0]["resume/from_step"] == 2
    assert [r["step"] for r in records if "train/loss" in r] == list(range(1, 7))
    assert result.summary["faults"]["executor/trainer_restarts"] == 1
    assert result.summary["prompts_trained_twice"] == 0
    assert "restarting the job from step_000002" in caplog.text
    for path in (result.run_dir / "checkpoints").iterdir():  # every checkpoint is sharded
        assert load_checkpoint(path)["trainer"]["format"] == "dcp"
    assert not multiprocessing.active_children()
