"""``KEY=null`` unsets an optional key, the same on the command line, in a resume's
overrides and in ``Job(overrides=...)``; ``KEY='null'`` is the string; a key that cannot be
none is refused by name."""

from __future__ import annotations

import pytest

from loomrl.config import ConfigError, apply_overrides, build_config, load_config, parse_override
from loomrl.job import Job, load_run_config

from conftest import ROOT, tiny_job_raw

JOB = ROOT / "examples/arithmetic/job.toml"


def test_null_unsets_and_quoted_null_is_the_string():
    assert parse_override("task.reward=null") == (["task", "reward"], None)
    assert parse_override("name='null'") == (["name"], "null")


def test_on_the_command_line_a_reward_is_swapped_for_a_scorer_and_the_eval_set_dropped():
    assert load_config(JOB).data.eval is not None
    cfg = load_config(
        JOB,
        [
            "task.reward=null",
            'task.scorer={type="function", path="examples.arithmetic.reward:exact_match"}',
            "data.eval=null",
        ],
    )
    assert cfg.task.reward is None and cfg.data.eval is None
    assert cfg.task.scorer.path == "examples.arithmetic.reward:exact_match"


def test_a_key_that_cannot_be_none_is_named():
    with pytest.raises(ConfigError, match=r"trainer\.lr: .*got null: only a key whose default"):
        load_config(JOB, ["trainer.lr=null"])


def test_in_job_overrides_and_on_resume(tmp_path):
    train = tmp_path / "train.jsonl"
    train.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    raw = tiny_job_raw(tmp_path, train, evals=train)
    job = Job(build_config(raw), overrides=["data.eval=null"])
    assert job.config.data.eval is None
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(build_config(raw).to_json())
    assert load_run_config(run).data.eval == str(train)
    assert load_run_config(run, ["data.eval=null"]).data.eval is None
    # the dict path the Python API and resume share
    assert apply_overrides({"a": {"b": 1}}, ["a.b=null"]) == {"a": {"b": None}}
