"""Typed config: unknown keys, wrong types, overrides, TOML files, the CLI's speed path."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from loomrl.config import ConfigError, build_config, load_config, parse_override

BASE = {"data": {"train": "t.jsonl"}, "task": {"reward": "m:f"}}


def test_defaults_and_dotted_overrides(tmp_path):
    job = tmp_path / "job.toml"
    job.write_text('[data]\ntrain = "t.jsonl"\n[task]\nreward = "m:f"\n[trainer]\nlr = 1e-4\n')
    cfg = load_config(
        job, ["trainer.lr=3e-4", "algorithm.max_staleness=0", 'algorithm.loss="grpo"']
    )
    assert (
        cfg.trainer.lr == 3e-4 and cfg.algorithm.max_staleness == 0 and cfg.algorithm.loss == "grpo"
    )
    assert cfg.generation.temperature == 1.0
    assert parse_override("name=my-run") == (["name"], "my-run")  # bare strings need no quotes


def test_unknown_key_is_an_error_naming_it():
    with pytest.raises(ConfigError, match=r"trainer\.learning_rate: unknown key"):
        build_config({**BASE, "trainer": {"learning_rate": 1e-4}})


def test_wrong_type_and_constraint_errors_name_the_value():
    with pytest.raises(ConfigError, match=r"trainer\.lr.*got 'fast'"):
        build_config({**BASE, "trainer": {"lr": "fast"}})
    with pytest.raises(ConfigError, match=r"algorithm\.group_size.*greater than or equal to 2"):
        build_config({**BASE, "algorithm": {"group_size": 1}})
    with pytest.raises(ConfigError, match="exactly one of 'reward' or 'environment'"):
        build_config({"data": {"train": "t.jsonl"}, "task": {}})


def test_trace_settings_resolve_auto_by_runtime_and_reject_other_words():
    for runtime, auto in (("local", True), ("process", False), ("ray", False)):
        cfg = build_config({**BASE, "runtime": runtime, "trainer": {"trace": False}})
        engine = cfg.generation.engine
        assert engine.trace == "auto" and cfg.uses_traces(engine.trace) is auto
        assert cfg.uses_traces(cfg.trainer.trace) is False and cfg.uses_traces(True) is True
    with pytest.raises(ConfigError, match=r"generation\.engine\.hf\.trace"):
        build_config({**BASE, "generation": {"engine": {"trace": "sometimes"}}})


def test_missing_and_invalid_job_files(tmp_path):
    with pytest.raises(ConfigError, match="job file not found"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[trainer\nlr = 1")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="not of the form"):
        parse_override("trainer.lr")


def test_cli_help_is_fast_and_imports_no_torch():
    code = "import sys, loomrl.cli; loomrl.cli.build_parser(); assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
    t0 = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-m", "loomrl.cli", "--help"], capture_output=True, text=True, check=True
    )
    assert time.perf_counter() - t0 < 3.0  # generous for a loaded CI machine; ~0.1 s idle
    assert "run" in out.stdout and "resume" in out.stdout


def test_cli_reports_bad_config_key_without_traceback(tmp_path):
    job = tmp_path / "job.toml"
    job.write_text('[data]\ntrain = "t.jsonl"\n[task]\nreward = "m:f"\n[trainer]\nlrr = 1\n')
    out = subprocess.run(
        [sys.executable, "-m", "loomrl.cli", "run", str(job)], capture_output=True, text=True
    )
    assert out.returncode == 2
    assert "trainer.lrr: unknown key" in out.stderr and "Traceback" not in out.stderr


def test_docs_list_every_config_key_as_loomrl_config_prints_it():
    out = subprocess.run(
        [sys.executable, "-m", "loomrl.cli", "config"], capture_output=True, text=True, check=True
    )
    docs = (Path(__file__).resolve().parents[1] / "docs/config.md").read_text()
    assert out.stdout.strip() and out.stdout.strip() in docs, (
        "docs/config.md is stale: paste `loomrl config`"
    )


@pytest.mark.parametrize(
    ("raw", "hint"),
    [
        (
            {"trainer": {"learning_rate": 1e-6}},
            "trainer.learning_rate: unknown key (TRL's 'learning_rate' is trainer.lr",
        ),
        ({"num_generations": 8}, "TRL's 'num_generations' is algorithm.group_size"),
        ({"algorithm": {"beta": 0.04}}, "TRL's 'beta' is algorithm.kl_coef"),
        ({"trainer": {"lrr": 1e-4}}, "trainer.lrr: unknown key (did you mean trainer.lr?"),
        ({"generation": {"max_new_token": 4}}, "did you mean generation.max_new_tokens?"),
        ({"trainer": {"clip_eps": 0.2}}, "did you mean algorithm.clip_eps?"),  # wrong section
        ({"trainer": {"zzzz": 1}}, "trainer.zzzz: unknown key (check the spelling;"),
    ],
)
def test_unknown_keys_say_what_was_meant(raw, hint):
    from loomrl.config import ConfigError, build_config

    base = {
        "model": {"path": "tiny:llama"},
        "data": {"train": "x.jsonl"},
        "task": {"reward": "a:b"},
    }
    for section, values in raw.items():
        if isinstance(values, dict):
            base.setdefault(section, {}).update(values)
        else:
            base[section] = values
    with pytest.raises(ConfigError) as err:
        build_config(base)
    assert hint in str(err.value)
