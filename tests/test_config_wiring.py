"""How the config is wired by role: the hf engine's knobs in its own table (old keys moved with
a warning naming the new place), knobs one branch ignores refused by name there, defaults
resolved without changing a built section, and the generator built from its own sections."""

from __future__ import annotations

import json
import pickle
import warnings

import pytest

from loomrl.config import (
    ConfigError,
    JobConfig,
    ShmTransportConfig,
    WeightSyncConfig,
    apply_overrides,
    build_config,
)
from loomrl.generation.engine_config import HFEngineConfig, VllmEngineConfig

BASE = {"data": {"train": "t.jsonl"}, "task": {"reward": "m:f"}}


def _engine(generation: dict, **job):
    return build_config({**BASE, **job, "generation": generation}).generation.engine


def test_the_hf_engines_knobs_live_in_its_table():
    table = {"type": "hf", "trace": False, "cuda_graphs": True, "quantize": "int8"}
    assert _engine({"engine": table}) == HFEngineConfig(
        trace=False, cuda_graphs=True, quantize="int8"
    )
    # no type: hf
    assert _engine({"engine": {"quantize": "int4"}}) == HFEngineConfig(quantize="int4")
    raw = apply_overrides({**BASE}, ["generation.engine.quantize=int8"])
    assert build_config(raw).generation.engine == HFEngineConfig(quantize="int8")
    with pytest.raises(ConfigError, match=r"generation\.engine\.vllm\.trace: unknown key"):
        _engine({"engine": {"type": "vllm", "trace": True}})


def test_old_engine_keys_move_into_the_table_with_a_warning_naming_the_new_key():
    with pytest.warns(FutureWarning, match=r"generation\.quantize -> generation\.engine\.quantize"):
        engine = _engine({"quantize": "int8", "cuda_graphs": True})
    assert engine == HFEngineConfig(quantize="int8", cuda_graphs=True)
    with pytest.warns(FutureWarning, match=r"generation\.trace -> generation\.engine\.trace"):
        assert _engine({"trace": False, "engine": "hf"}) == HFEngineConfig(trace=False)
    with pytest.warns(FutureWarning, match=r"generation\.quantize -> generation\.engine\.quantize"):
        engine = _engine({"quantize": "fp8", "engine": "vllm"})
    assert engine == VllmEngineConfig(quantize="fp8")


def test_an_old_engine_key_the_engine_does_not_take_fails_naming_the_new_key():
    with pytest.raises(
        ConfigError, match=r"generation\.trace=True is a key of the 'hf' engine .*'vllm'"
    ):
        _engine({"trace": True, "engine": "vllm"})  # it did nothing for vLLM
    with pytest.raises(ConfigError, match=r"keep only generation\.engine\.quantize"):
        _engine({"quantize": "int8", "engine": {"quantize": "fp8"}})


def test_an_old_run_folders_generation_keys_load_without_a_warning():
    old = {"trace": "auto", "cuda_graphs": "auto", "quantize": "none", "engine": {"type": "vllm"}}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the old defaults move nowhere: nothing to warn about
        cfg = build_config({**BASE, "generation": old})
    assert cfg.generation.engine == VllmEngineConfig()
    assert build_config(json.loads(cfg.to_json())) == cfg


def test_the_vllm_table_takes_fp8_and_names_why_not_the_hf_kinds():
    assert VllmEngineConfig(quantize="fp8").quantize == "fp8"
    with pytest.raises(ValueError, match="no vLLM counterpart"):
        VllmEngineConfig(quantize="int8")
    with pytest.raises(ValueError, match="no online int4"):
        VllmEngineConfig(quantize="int4")


def _sharded(trainer: dict) -> JobConfig:
    parallel = {"type": "fsdp2", "dp_shard": 2}
    return build_config(
        {**BASE, "runtime": "process", "trainer": {**trainer, "parallel": parallel}}
    )


@pytest.mark.parametrize("key", ["shared_prefix", "trace", "chunked_logprobs"])
def test_what_the_sharded_trainer_would_turn_off_is_refused_by_name(key):
    with pytest.raises(ConfigError, match=rf"fsdp2' runs without trainer\.{key} \("):
        _sharded({key: True})
    for value in ("auto", False):
        assert getattr(_sharded({key: value}).trainer, key) == value
    assert getattr(build_config({**BASE, "trainer": {key: True}}).trainer, key) is True


def test_a_sharded_runs_dump_loads_again():
    cfg = _sharded({})
    assert build_config(json.loads(cfg.to_json())) == cfg


def test_the_transport_default_is_resolved_without_changing_a_built_section():
    ws = WeightSyncConfig()
    cfg = JobConfig.model_validate({**BASE, "runtime": "process", "weight_sync": ws})
    assert cfg.weight_sync.transport == ShmTransportConfig()
    assert ws.kind == "inproc"  # the section handed in is left as it was
    assert build_config({**BASE, "runtime": "ray"}).weight_sync.kind == "shm"
    assert build_config({**BASE}).weight_sync.kind == "inproc"
    with pytest.raises(ConfigError, match="'inproc' only reaches executors in this process"):
        build_config({**BASE, "runtime": "process", "weight_sync": {"transport": "inproc"}})


def test_the_generator_is_built_from_its_own_sections():
    from loomrl.session.assembly import generator_setup

    cfg = build_config({**BASE, "runtime": "process", "seed": 3})
    setup = generator_setup(cfg)
    assert (setup.model, setup.generation, setup.weight_sync) == (
        cfg.model,
        cfg.generation,
        cfg.weight_sync,
    )
    assert (setup.seed, setup.runtime) == (3, "process")
    assert pickle.loads(pickle.dumps(setup)) == setup  # it travels to a process or an actor
