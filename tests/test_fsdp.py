"""The sharded trainer (``trainer.parallel.type = "fsdp2"``, ``loomrl.training.fsdp``): N
ranks on gloo make the single trainer's updates (its checkpoints, and a lost rank that
restarts the job from one: tests/test_fsdp_checkpoint.py)."""

from __future__ import annotations

import json
import math
import multiprocessing

import pytest
from spawned import end_rank
from step_checks import assert_same_step

from loomrl.config import ConfigError
from loomrl.job import Job, resume_job
from loomrl.telemetry.metrics import read_metrics
from loomrl.training.checkpoint import load_checkpoint
from loomrl.training.fsdp import shard_rollouts
from loomrl.types import Rollout

pytestmark = pytest.mark.timeout(240)

SYNC = {"algorithm": {"max_staleness": 0}, "task": {"reward": "test_job:length_reward"}}


def _rollout(prompt_len: int, completion_len: int) -> Rollout:
    return Rollout(
        prompt_index=0,
        prompt_ids=[1] * prompt_len,
        completion_ids=[2] * completion_len,
        behaviour_logprobs=[0.0] * completion_len,
        loss_mask=[1.0] * completion_len,
        version=0,
    )


def test_rollouts_are_shared_by_tokens_not_rows_and_deterministically():
    rollouts = [_rollout(2, n) for n in (1, 1, 40, 1, 1, 1, 1, 1)]
    shares = shard_rollouts(rollouts, 2)
    assert shares == [[2], [0, 1, 3, 4, 5, 6, 7]]  # 42 and 21 tokens, not 4 rows each (45 and 18)
    rollouts = [_rollout(2, n) for n in (10, 3, 7, 5, 8, 2)]
    shares = shard_rollouts(rollouts, 3)
    assert sorted(sum(shares, [])) == list(range(6))
    loads = [sum(4 + len(rollouts[i].completion_ids) - 2 for i in s) for s in shares]
    assert max(loads) - min(loads) <= 2
    assert shares == shard_rollouts(rollouts, 3) and all(s == sorted(s) for s in shares)
    assert shard_rollouts(rollouts[:1], 3) == [[0], [], []]


TINY = {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "intermediate_size": 64}


def _uneven_groups() -> list:
    """One long rollout among short ones: balanced by tokens, the ranks get different row
    counts, so with one row per micro-batch one rank runs idle micro-batches."""
    from loomrl.types import Group

    lengths = [12, 1, 2, 1, 3, 1, 2, 1]
    rollouts = [
        Rollout(i, [1, 5 + i % 3, 6], [7 + i % 4] * n, [-1.5] * n, [1] * n, 0, reward=float(i % 2))
        for i, n in enumerate(lengths)
    ]
    return [Group.of_rollouts(g, 0, rollouts[g * 4 : (g + 1) * 4]) for g in range(2)]


def _configs(aggregation: str, packing: bool = False):
    from loomrl.config import AlgorithmConfig, TrainerConfig

    algorithm = AlgorithmConfig(aggregation=aggregation)
    if packing:  # packs of up to 12 tokens: several rollouts each, the long one alone
        trainer = TrainerConfig(lr=1e-3, micro_batch_size=4, packing=True, packing_max_tokens=12)
        return algorithm, trainer
    return algorithm, TrainerConfig(lr=1e-3, micro_batch_size=1, shared_prefix=False)


def _sharded_step(
    rank: int, world_size: int, rendezvous: str, aggregation: str, out: str, packing=False
):
    """One rank of a sharded step (run by torch.multiprocessing.spawn)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from loomrl.models.tiny import build_tiny_model
    from loomrl.training.fsdp import ShardedTrainer, shard_model

    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world_size)
    model, tok = build_tiny_model("llama", seed=3, **TINY)
    shard_model(model, init_device_mesh("cpu", (world_size,)), "fp32", reshard=True)
    algorithm, trainer_cfg = _configs(aggregation, packing)
    trainer = ShardedTrainer(
        model, tok, algorithm, trainer_cfg, 1.0, rank=rank, world_size=world_size
    )
    metrics = trainer.train_step(_uneven_groups())
    state = trainer.state_dict()  # full, on rank 0
    held = {  # what this rank holds: its shards of the weights and AdamW's moments
        "params": sum(p.to_local().numel() for p in model.parameters()),
        "moments": sum(
            v.to_local().numel()
            for st in trainer.optimizer.state.values()
            for k, v in st.items()
            if k in ("exp_avg", "exp_avg_sq")
        ),
    }
    if rank == 0:
        torch.save({"metrics": metrics, "state": state, "held": held}, out)
    end_rank()


@pytest.mark.parametrize("aggregation", ["token", "sequence"])
def test_a_sharded_step_with_idle_micro_batches_is_the_single_step_and_resumes_on_one(
    aggregation, tmp_path
):
    import torch
    import torch.multiprocessing as mp

    from loomrl.models.tiny import build_tiny_model
    from loomrl.runtime.group import new_rendezvous
    from loomrl.training.trainer import Trainer, micro_batch_slices

    groups = _uneven_groups()
    rollouts = [r for g in groups for r in g]
    shares = shard_rollouts(rollouts, 2)
    counts = [len(micro_batch_slices([rollouts[i] for i in s], 1, None)) for s in shares]
    assert counts[0] != counts[1]  # one rank runs idle micro-batches
    out = str(tmp_path / "rank0.pt")
    mp.spawn(_sharded_step, (2, new_rendezvous("127.0.0.1"), aggregation, out), nprocs=2)
    got = torch.load(out, weights_only=False)
    model, tok = build_tiny_model("llama", seed=3, **TINY)
    single = Trainer(model, tok, *_configs(aggregation), 1.0)
    want = single.train_step(groups)
    assert_same_step(
        got["metrics"], want, ("train/loss", "train/grad_norm", "train/update_rms", "train/entropy")
    )
    assert got["metrics"]["train/num_tokens"] == want["train/num_tokens"]
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(got["state"]["model"][name], tensor, rtol=1e-5, atol=1e-6)
    total = sum(p.numel() for p in model.parameters())
    assert got["held"]["params"] == pytest.approx(total / 2, rel=0.1)  # 1/N of the state
    assert got["held"]["moments"] == 2 * got["held"]["params"]
    # the 2-rank state (its optimizer state keyed by name) resumes on a single trainer
    resumed = Trainer(
        build_tiny_model("llama", seed=0, **TINY)[0], tok, *_configs(aggregation), 1.0
    )
    resumed.load_state_dict(got["state"])
    assert resumed.version == 1
    step2, want2 = resumed.train_step(groups), single.train_step(groups)
    assert_same_step(
        step2, want2, ("train/loss", "train/grad_norm", "train/update_rms", "train/lr")
    )


def test_a_packed_sharded_step_is_the_padded_single_step(tmp_path):
    """trainer.packing under fsdp2: the same micro-batch path (packs, idle packs included)."""
    import torch
    import torch.multiprocessing as mp

    from loomrl.models.tiny import build_tiny_model
    from loomrl.runtime.group import new_rendezvous
    from loomrl.training.packing import pack_slices
    from loomrl.training.trainer import Trainer

    groups = _uneven_groups()
    rollouts = [r for g in groups for r in g]
    counts = [
        len(pack_slices([rollouts[i] for i in s], 4, 12)) for s in shard_rollouts(rollouts, 2)
    ]
    assert counts[0] != counts[1] and max(counts) > 1  # idle packs on one rank
    out = str(tmp_path / "rank0.pt")
    mp.spawn(_sharded_step, (2, new_rendezvous("127.0.0.1"), "token", out, True), nprocs=2)
    got = torch.load(out, weights_only=False)
    model, tok = build_tiny_model("llama", seed=3, **TINY)
    want = Trainer(model, tok, *_configs("token"), 1.0).train_step(groups)
    assert_same_step(got["metrics"], want, ("train/loss", "train/grad_norm", "train/entropy"))
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(got["state"]["model"][name], tensor, rtol=1e-5, atol=1e-6)


def test_fsdp2_on_the_local_runtime_is_a_config_error_naming_process(tiny_job):
    with pytest.raises((ConfigError, ValueError), match="runtime='process'"):
        tiny_job(trainer={"parallel": {"type": "fsdp2", "dp_shard": 2}})


@pytest.mark.parametrize(
    ("sections", "named"),
    [
        ({"algorithm": {"kl_coef": 0.1}}, "kl_coef=0.1"),
        ({"weight_sync": {"transport": "torch_dist"}}, "transport='torch_dist'"),
        ({"trainer": {"parallel": {"type": "fsdp2", "dp_shard": 0}}}, "dp_shard"),
        ({"scheduler": {"url": "http://127.0.0.1:1"}}, "scheduler.offload"),
    ],
)
def test_what_fsdp2_does_not_support_yet_is_a_config_error(tiny_job, sections, named):
    parallel = {"trainer": {"parallel": {"type": "fsdp2", "dp_shard": 2}}}
    with pytest.raises((ConfigError, ValueError), match=named):
        tiny_job(runtime="process", **{**parallel, **sections})


def _steps(run_dir) -> list[dict]:
    return [r for r in read_metrics(run_dir) if "train/loss" in r]


def test_two_ranks_match_one_trainer_step_for_step(tiny_job, tmp_path):
    """From a model folder: the ranks start from the meta device (``fsdp_init``), each
    reading its rows of the safetensors; the single trainer loads the folder whole."""
    from loomrl.models.tiny import build_tiny_model

    folder = tmp_path / "model"
    model, tok = build_tiny_model("llama", seed=0, **TINY)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    num_steps = 5
    common = {
        **SYNC,
        "runtime": "process",
        "weight_sync": {"codec": "delta"},
        "model": {"path": str(folder)},
    }
    trainer = {"num_steps": num_steps, "micro_batch_size": 4}
    single = Job(tiny_job(**common, trainer=trainer, output_dir=str(tmp_path / "single"))).run()
    sharded = Job(
        tiny_job(
            **common,
            trainer={**trainer, "parallel": {"type": "fsdp2", "dp_shard": 2}},
            output_dir=str(tmp_path / "fsdp"),
        )
    ).run()
    want, got = _steps(single.run_dir), _steps(sharded.run_dir)
    assert len(want) == len(got) == num_steps and want[0]["train/loss"] != 0.0
    for step, step2 in zip(want, got):
        # the same rollouts, step for step
        for key in ("rollout/reward_mean", "train/num_tokens"):
            assert step2[key] == step[key], key
        # after step 1 the on-policy loss is ~1e-6, a cancellation of O(1) terms: compared
        # on its terms' scale (step_checks)
        assert_same_step(step2, step, ("train/loss", "train/grad_norm"))
    assert sharded.summary["trained"] == single.summary["trained"]
    assert (sharded.run_dir / "final" / "config.json").exists()
    assert not multiprocessing.active_children()


@pytest.mark.gpu
def test_one_nccl_rank_on_cuda_trains_like_the_single_trainer(tiny_job, tmp_path):
    """The CUDA path (NCCL, bf16_mixed's MixedPrecisionPolicy, per-parameter gathers, full
    state dicts) on one GPU: two NCCL ranks cannot share a device, so one rank."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    common = {
        **SYNC,
        "runtime": "process",
        "model": {"device": "cuda"},
        "checkpoint": {"every_steps": 2},
    }
    trainer = {"num_steps": 4, "micro_batch_size": 4, "precision": "bf16_mixed"}
    single = Job(tiny_job(**common, trainer=trainer, output_dir=str(tmp_path / "single"))).run()
    sharded = Job(
        tiny_job(
            **common,
            trainer={**trainer, "parallel": {"type": "fsdp2", "dp_shard": 1}},
            output_dir=str(tmp_path / "fsdp"),
        )
    ).run()
    want, got = _steps(single.run_dir), _steps(sharded.run_dir)
    assert len(got) == 4
    # bf16 compute: the first step (same weights, same rollouts) agrees to bf16's precision
    assert got[0]["rollout/reward_mean"] == want[0]["rollout/reward_mean"]
    assert got[0]["train/grad_norm"] == pytest.approx(want[0]["train/grad_norm"], rel=2e-2)
    assert (sharded.run_dir / "final" / "config.json").exists()
    # its sharded (DCP) checkpoint, written from CUDA over NCCL, resumes on the single trainer
    config = json.loads((sharded.run_dir / "config.json").read_text())
    config["trainer"]["num_steps"] = 5
    config["trainer"]["parallel"] = {"type": "single"}
    (sharded.run_dir / "config.json").write_text(json.dumps(config))
    assert (
        load_checkpoint(sharded.run_dir / "checkpoints" / "step_000004")["trainer"]["format"]
        == "dcp"
    )
    resumed = _steps(resume_job(sharded.run_dir).run_dir)
    last = resumed[-1]
    assert len(resumed) == 5 and all(
        math.isfinite(last[key]) for key in ("train/loss", "train/grad_norm")
    )


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_ranks_on_ray_in_one_placement_group_match_one_trainer(ray_cluster, tiny_job, tmp_path):
    common = {**SYNC, "trainer": {"num_steps": 3, "micro_batch_size": 4}}
    single = Job(tiny_job(**common, runtime="process", output_dir=str(tmp_path / "s"))).run()
    sharded = Job(
        tiny_job(
            **SYNC,
            runtime="ray",
            trainer={**common["trainer"], "parallel": {"type": "fsdp2", "dp_shard": 2}},
            ray={"num_cpus": {"trainer": 0.5, "generator": 0.5}, "placement": "pack"},
            output_dir=str(tmp_path / "ray"),
        )
    ).run()
    want, got = _steps(single.run_dir), _steps(sharded.run_dir)
    assert len(got) == 3
    for step, step2 in zip(want, got):
        assert step2["rollout/reward_mean"] == step["rollout/reward_mean"]
        assert step2["train/grad_norm"] == pytest.approx(step["train/grad_norm"], rel=1e-5)
    assert {"trainer.rank0", "trainer.rank1"} <= set(sharded.summary["peak_rss_mb"])
