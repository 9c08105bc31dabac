"""``loomrl warmstart JOB.toml``: the supervised step on the job's own model and data, with
prompts rendered as the RL run renders them; the loss falls, and the folder loads as
``model.path``."""

from __future__ import annotations

import json

import pytest

from conftest import ROOT

pytest.importorskip("datasets")


@pytest.fixture
def gsm8k_job(tmp_path):
    from examples.gsm8k.make_model import build

    model = build(tmp_path / "instruct")
    return [
        f"model.path={json.dumps(str(model))}",
        "data.train=" + json.dumps(str(ROOT / "examples/gsm8k/data")),
    ]


def test_warmstart_trains_on_templated_prompts_and_the_loss_falls(tmp_path, gsm8k_job):
    from loomrl.chat import PromptEncoder
    from loomrl.config import load_config
    from loomrl.models import load_tokenizer
    from loomrl.training import sft
    from loomrl.training.warmstart import warmstart_job

    cfg = load_config(ROOT / "examples/gsm8k/job.toml", gsm8k_job)
    seen = []
    real = sft.answer_batch

    def spy(tok, rows, answer_key="answer"):
        seen.extend(rows)
        return real(tok, rows, answer_key)

    sft.answer_batch = spy
    try:
        result = warmstart_job(cfg, tmp_path / "ws", steps=25, batch_size=8, lr=3e-3)
    finally:
        sft.answer_batch = real
    assert result["steps"] == 25 and result["last_loss"] < result["first_loss"]
    tok = load_tokenizer(cfg.model.path)
    encoder = PromptEncoder(tok, cfg.data, cfg.model.path)
    row = json.loads((ROOT / "examples/gsm8k/data/train.jsonl").open().readline())
    expected = encoder.encode_one(row["question"])
    assert expected.count(tok.bos_token_id) == 1
    assert any(r["prompt_ids"] == expected and r["answer"] == row["answer"] for r in seen)
    assert (tmp_path / "ws" / "config.json").is_file()


def test_warmstart_command_and_a_missing_answer_column(tmp_path, gsm8k_job, capsys):
    from loomrl.cli import main

    job = str(ROOT / "examples/gsm8k/job.toml")
    assert main(["warmstart", job, *gsm8k_job, "--out", str(tmp_path / "w"), "--steps", "2"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["steps"] == 2
    bad = main(["warmstart", job, *gsm8k_job, "--out", str(tmp_path / "x"), "--answer-key", "sol"])
    assert bad == 2 and "have no 'sol' column" in capsys.readouterr().err
