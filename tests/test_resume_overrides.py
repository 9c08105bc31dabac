"""``loomrl resume RUN KEY=VALUE``: the keys a run's checkpoints depend on (model, sharding,
name, folder, seed) cannot change, however the override is spelt; the check is on the
parsed key path and on the resulting values, not on the override's text."""

from __future__ import annotations

import pytest

from loomrl.config import build_config
from loomrl.job import load_run_config

from conftest import tiny_job_raw


@pytest.fixture
def run_dir(tmp_path):
    train = tmp_path / "train.jsonl"
    train.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    run = tmp_path / "run"
    run.mkdir()
    cfg = build_config(tiny_job_raw(tmp_path, train, output_dir=str(run)))
    (run / "config.json").write_text(cfg.to_json())
    return run


@pytest.mark.parametrize(
    "override",
    [
        ".seed=7",
        ".name=x",
        "seed.=7",
        " seed=7",
        "..model.path='tiny:qwen2'",
        "model={path='tiny:qwen2'}",
        "trainer={num_steps=4, lr=1e-3, micro_batch_size=8, parallel='fsdp2'}",
        "output_dir='/tmp/elsewhere'",
    ],
)
def test_a_fixed_key_cannot_change_however_spelt(run_dir, override):
    with pytest.raises(ValueError, match=r"cannot change on resume"):
        load_run_config(run_dir, [override])


def test_setting_a_fixed_key_to_its_own_value_and_neutral_keys_still_work(run_dir):
    cfg = load_run_config(run_dir, ["seed=0", "trainer.num_steps=9", "name='tiny'"])
    assert cfg.trainer.num_steps == 9 and cfg.seed == 0
    cfg = load_run_config(run_dir, ["trainer={num_steps=6, lr=1e-3, micro_batch_size=8}"])
    assert cfg.trainer.num_steps == 6
