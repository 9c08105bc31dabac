"""Per-role config sections: each lives beside its role, tagged tables hold only their own keys,
old flat weight_sync keys keep working (moved, with a warning) or fail naming the new key, and
the executors and the transport are built from their own sections."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
import warnings

import pytest

from loomrl.config import (
    ConfigError,
    FilesTransportConfig,
    TensorTransportConfig,
    build_config,
    config_reference,
    load_config,
)

BASE = {"data": {"train": "t.jsonl"}, "task": {"reward": "m:f"}}

# What a run folder's config.json held before the transport became a table: every flat key.
OLD_DUMP = {
    "codec": "full",
    "transport": "shm",
    "publish_dtype": "bfloat16",
    "full_every": 50,
    "sync_every": 1,
    "path": None,
    "zstd_level": 1,
    "prefetch": False,
    "keep_fulls": 2,
    "bucket_mb": 64,
    "tensor_mode": "auto",
    "dist_backend": "auto",
}


def _sync(weight_sync: dict, **job):
    return build_config({**BASE, **job, "weight_sync": weight_sync}).weight_sync


def test_each_section_lives_beside_its_role_and_loomrl_config_reexports_it():
    import loomrl.config as config

    homes = {
        "GenerationConfig": "loomrl.generation.config",
        "TrainerConfig": "loomrl.training.config",
        "Fsdp2ParallelConfig": "loomrl.training.config",
        "WeightSyncConfig": "loomrl.weights.config",
        "FilesTransportConfig": "loomrl.weights.config",
        "TaskConfig": "loomrl.scoring.config",
        "ModelScorerConfig": "loomrl.scoring.config",
        "SandboxConfig": "loomrl.sandbox.config",
        "SchedulerConfig": "loomrl.scheduler.config",
        "FaultsConfig": "loomrl.runtime.config",
        "RayConfig": "loomrl.runtime.config",
        "ModelConfig": "loomrl.config_common",
        "AlgorithmConfig": "loomrl.config_common",
        "JobConfig": "loomrl.config_job",
    }
    assert {name: getattr(config, name).__module__ for name in homes} == homes


def test_the_base_imports_no_section_and_the_config_loads_without_torch():
    from test_structure import import_graph

    graph = import_graph()
    assert graph["loomrl.config_base"] == set()
    for role in ("generation", "training", "weights", "scoring", "sandbox", "scheduler", "runtime"):
        allowed = {"loomrl.config_base", "loomrl.scoring.config", "loomrl.generation.engine_config"}
        assert graph[f"loomrl.{role}.config"] <= allowed
    code = "import sys, loomrl.config; assert 'torch' not in sys.modules and 'numpy' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_transport_is_a_tagged_table_with_only_its_own_keys():
    ws = _sync({"transport": {"type": "files", "path": "/shared/w", "keep_fulls": 3}})
    assert (
        ws.transport == FilesTransportConfig(path="/shared/w", keep_fulls=3) and ws.kind == "files"
    )
    assert _sync({"transport": "files"}).transport == FilesTransportConfig()  # the shorthand
    with pytest.raises(ConfigError, match=r"weight_sync\.transport\.shm\.bucket_mb: unknown key"):
        _sync({"transport": {"type": "shm", "bucket_mb": 8}})
    with pytest.raises(ConfigError, match=r"weight_sync\.transport"):
        _sync({"transport": {"type": "carrier_pigeon"}})
    ws = _sync({"transport": {"type": "tensor", "mode": "broadcast"}}, runtime="process")
    assert ws.forms_group and not _sync({"transport": "tensor"}).forms_group


def test_old_flat_keys_move_into_the_table_with_a_warning_naming_the_new_key():
    with pytest.warns(
        FutureWarning, match=r"weight_sync\.keep_fulls -> weight_sync\.transport\.keep_fulls"
    ):
        ws = _sync({"transport": "files", "path": "/w", "keep_fulls": 5})
    assert ws.transport == FilesTransportConfig(path="/w", keep_fulls=5)
    with pytest.warns(
        FutureWarning, match=r"weight_sync\.tensor_mode -> weight_sync\.transport\.mode"
    ):
        ws = _sync(
            {"transport": "tensor", "tensor_mode": "broadcast", "dist_backend": "gloo"},
            runtime="process",
        )
    assert ws.transport == TensorTransportConfig(mode="broadcast", backend="gloo")


def test_an_old_flat_key_the_transport_does_not_take_fails_naming_the_new_key():
    with pytest.raises(
        ConfigError, match=r"weight_sync\.bucket_mb=128 .*weight_sync\.transport\.bucket_mb.*'shm'"
    ):
        _sync({"transport": "shm", "bucket_mb": 128})
    with pytest.raises(ConfigError, match=r"weight_sync\.path=.*this job's transport is 'inproc'"):
        _sync({"path": "/w"})  # set a folder, forgot transport = "files": it had no effect
    with pytest.raises(ConfigError, match=r"keep only weight_sync\.transport\.keep_fulls"):
        _sync({"transport": {"type": "files", "keep_fulls": 3}, "keep_fulls": 4})


def test_an_old_run_folders_config_still_loads_and_resumes_on_the_same_transport():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the old defaults move nowhere: nothing to warn about
        cfg = build_config({**BASE, "runtime": "process", "weight_sync": OLD_DUMP})
    assert cfg.weight_sync.kind == "shm"
    again = build_config(json.loads(cfg.to_json()))
    assert again == cfg and json.loads(cfg.to_json())["weight_sync"]["transport"] == {"type": "shm"}


def test_an_override_sets_a_key_in_a_table_given_by_its_type(tmp_path):
    job = tmp_path / "job.toml"
    job.write_text(
        '[data]\ntrain = "t.jsonl"\n[task]\nreward = "m:f"\n[weight_sync]\ntransport = "torch_dist"\n'
    )
    cfg = load_config(job, ['runtime="process"', "weight_sync.transport.bucket_mb=8"])
    assert (cfg.weight_sync.kind, cfg.weight_sync.transport.bucket_mb) == ("torch_dist", 8)


def test_the_default_transport_follows_the_runtime_and_an_explicit_one_is_checked():
    assert _sync({}).kind == "inproc" and _sync({}, runtime="process").kind == "shm"
    with pytest.raises(ConfigError, match="runtime='process' needs 'shm'"):
        _sync({"transport": {"type": "inproc"}}, runtime="process")


def test_every_tagged_table_follows_one_pattern():
    """[task.scorer] and [trainer.parallel] reject another variant's keys, as the transport does."""
    with pytest.raises(ConfigError, match=r"task\.scorer\.function\.device: unknown key"):
        build_config(
            {**BASE, "task": {"scorer": {"type": "function", "path": "m:f", "device": "cpu"}}}
        )
    with pytest.raises(ConfigError, match=r"trainer\.parallel: Input tag 'tp'"):
        build_config({**BASE, "trainer": {"parallel": {"type": "tp"}}})
    lines = config_reference()
    types = [
        line.split(" = ")[1].split()[0]
        for line in lines
        if line.startswith("weight_sync.transport.type")
    ]
    assert types == ["'inproc'", "'shm'", "'files'", "'torch_dist'", "'tensor'"]
    assert "task.scorer.max_new_tokens = 32" in "\n".join(lines)


def test_transport_args_come_from_the_transport_table(tmp_path):
    from loomrl.weights.transports.setup import transport_args

    def args(transport: dict, in_process: bool = False):
        ws = _sync({"transport": transport}, runtime="local" if in_process else "process")
        return transport_args(
            ws, run_dir=tmp_path, num_generators=2, in_process=in_process, device="cpu"
        )

    assert args({"type": "files"}) == (
        "files",
        {"path": str(tmp_path / "weight_updates"), "keep_fulls": 2},
    )
    kind, shm = args({"type": "shm"})
    assert kind == "shm" and len(shm["name"]) == 16
    kind, group = args({"type": "torch_dist", "bucket_mb": 2, "backend": "gloo"})
    assert (kind, group["world_size"], group["bucket_bytes"], group["backend"]) == (
        "torch_dist",
        3,
        2 << 20,
        "gloo",
    )
    assert args({"type": "tensor"}, in_process=True) == ("tensor", {"mode": "local"})
    assert args({"type": "inproc"}, in_process=True) == ("inproc", {})


def test_the_trainer_executor_is_built_from_its_sections():
    from loomrl.session.assembly import trainer_setup

    for runtime, trace in (("local", True), ("process", False)):
        cfg = build_config({**BASE, "runtime": runtime, "generation": {"temperature": 0.7}})
        setup = trainer_setup(cfg)
        assert (setup.trainer, setup.algorithm, setup.model) == (
            cfg.trainer,
            cfg.algorithm,
            cfg.model,
        )
        assert (setup.weight_sync, setup.temperature, setup.trace) == (cfg.weight_sync, 0.7, trace)
        assert pickle.loads(pickle.dumps(setup)) == setup  # it travels to a process or an actor


def test_trainer_parallel_is_tagged_and_an_old_dump_of_it_still_loads():
    from loomrl.config import Fsdp2ParallelConfig, SingleParallelConfig

    def parallel(table, **job):
        return build_config({**BASE, **job, "trainer": {"parallel": table}}).trainer.parallel

    old = {
        "type": "single",
        "dp_shard": 1,
        "reshard_after_forward": True,
        "collective_timeout_s": 600.0,
    }
    assert parallel(old) == SingleParallelConfig() == parallel({})
    assert parallel("fsdp2", runtime="process") == Fsdp2ParallelConfig()
    with pytest.raises(
        ConfigError, match=r"trainer\.parallel\.dp_shard=2 is a key of type 'fsdp2'"
    ):
        parallel({"dp_shard": 2})  # type 'single' by default: dp_shard did nothing before
    with pytest.raises(ConfigError, match=r"trainer\.parallel\.fsdp2\.dp_shard"):
        parallel({"type": "fsdp2", "dp_shard": 0}, runtime="process")
