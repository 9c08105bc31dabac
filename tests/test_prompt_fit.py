"""Prompts that do not fit the model's context with max_new_tokens: refused before any
model loads (naming file and line), or cut to fit when the user asks, and said so."""

from __future__ import annotations

import json
import logging
import time

import pytest

from loomrl.data import DatasetError
from loomrl.job import Job
from loomrl.models import build_char_tokenizer
from loomrl.prompt_fit import truncate_ids


def _with_long_prompts(path, line_numbers: set[int], chars: int = 400) -> None:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for n in line_numbers:
        rows[n - 1]["prompt"] = "1+" * (chars // 2) + "1="
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_a_prompt_past_the_context_fails_naming_its_line_before_any_model_loads(
    tiny_job, tiny_data
):
    train, _ = tiny_data
    _with_long_prompts(train, {7, 30})
    cfg = tiny_job(trainer={"num_steps": 1})  # tiny model: 256 positions, max_new_tokens 3
    t0 = time.perf_counter()
    with pytest.raises(
        DatasetError,
        match=rf"{train}:7: prompt is 403 tokens; .*leaves 253; .*truncate_prompts=true",
    ):
        Job(cfg).run()
    assert time.perf_counter() - t0 < 3  # no model was built
    with pytest.raises(
        DatasetError, match="leaves no room for a prompt in the model's context of 256"
    ):
        Job(tiny_job(generation={"max_new_tokens": 256}, output_dir=cfg.output_dir + "-2")).run()


def test_truncate_prompts_cuts_them_to_fit_keeping_the_end_and_says_so(tiny_job, tiny_data, caplog):
    train, _ = tiny_data
    _with_long_prompts(train, set(range(1, 401)))  # every prompt too long
    cfg = tiny_job(trainer={"num_steps": 1}, data={"truncate_prompts": True, "eval": None})
    with caplog.at_level(logging.WARNING, logger="loomrl.prompt_fit"):
        result = Job(cfg).run()
    assert result.summary["steps"] == 1 and result.summary["trained"] == 16
    assert any(
        "400 of 400 prompts" in r.getMessage() and "cut" in r.getMessage() for r in caplog.records
    )
    tok = build_char_tokenizer()
    ids = tok("1+1+1+2=").input_ids
    assert truncate_ids(ids, 4, tok.bos_token_id) == [tok.bos_token_id, *tok("+2=").input_ids[1:]]
    assert truncate_ids(ids, 100, tok.bos_token_id) == ids


# -- issue 41, finding 8: huge prompts are refused (or cut) by bytes before tokenizing -----


def _never_called(text):
    raise AssertionError(f"tokenized a {len(text)}-char prompt")


def test_a_prompt_past_the_byte_bound_is_refused_naming_its_line_without_tokenizing():
    from loomrl.config import DataConfig
    from loomrl.prompt_fit import check_prompts

    assert DataConfig(train="t.jsonl").max_prompt_bytes == 1 << 20
    rows = [{"prompt": "1+1="}, {"prompt": "é" * 600}]  # 1200 bytes, 600 characters
    with pytest.raises(
        DatasetError, match=r"d.jsonl:9: prompt is 1200 bytes, more than data.max_prompt_bytes=1000"
    ):
        check_prompts(
            rows, ["d.jsonl:4", "d.jsonl:9"], _never_called, "prompt", 253, False, max_bytes=1000
        )
    # a model of unknown context too
    with pytest.raises(DatasetError, match=r"d.jsonl:9: prompt is 1200 bytes"):
        check_prompts(
            rows, ["d.jsonl:4", "d.jsonl:9"], _never_called, "prompt", None, False, max_bytes=1000
        )


def test_truncate_prompts_cuts_a_huge_prompt_by_bytes_before_tokenizing_keeping_its_end():
    from loomrl.prompt_fit import check_prompts

    seen = []
    rows = [{"prompt": "1+1="}, {"prompt": "é" + "x" * 1998 + "END"}]  # 2003 bytes

    def encode(text):
        seen.append(len(text.encode()))
        return list(text)

    check_prompts(rows, ["d.jsonl:1", "d.jsonl:2"], encode, "prompt", 100, True, max_bytes=1000)
    assert max(seen) <= 1000
    assert rows[1]["prompt"].endswith("xEND") and len(rows[1]["prompt"].encode()) == 1000
    rows = [{"prompt": "x" * 999 + "é"}]  # a cut inside a character keeps only whole ones
    check_prompts(rows, ["d.jsonl:1"], encode, "prompt", 100, True, max_bytes=2)
    assert rows[0]["prompt"] == "é"


def test_a_job_refuses_a_huge_prompt_quickly_by_its_line(tiny_job, tiny_data):
    train, _ = tiny_data
    rows = [json.loads(line) for line in train.read_text().splitlines()]
    rows[4]["prompt"] = "1+" * (1 << 20) + "1="  # 2 MiB
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    t0 = time.perf_counter()
    with pytest.raises(
        DatasetError,
        match=rf"{train}:5: prompt is 2097154 bytes, more than data.max_prompt_bytes=1048576",
    ):
        Job(tiny_job(trainer={"num_steps": 1})).run()
    assert time.perf_counter() - t0 < 3
    result = Job(
        tiny_job(
            trainer={"num_steps": 1},
            data={"truncate_prompts": True, "max_prompt_bytes": 4096},
            output_dir=str(train.parent / "run-cut"),
        )
    ).run()
    assert result.summary["steps"] == 1
