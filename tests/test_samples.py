"""Seeing what the model writes (issue 38, item 4): a few (prompt, completion, reward)
samples per step in samples.jsonl, as text."""

from __future__ import annotations

import json

from loomrl.job import Job
from loomrl.telemetry.metrics import read_samples


def test_samples_jsonl_holds_the_steps_prompts_and_completions_as_text(tiny_job, tiny_data):
    train, _ = tiny_data
    prompts = {json.loads(line)["prompt"] for line in train.read_text().splitlines()}
    cfg = tiny_job(trainer={"num_steps": 3}, logging={"completions_per_step": 2})
    result = Job(cfg).run()
    samples = read_samples(result.run_dir)
    assert [s["step"] for s in samples] == [1, 1, 2, 2, 3, 3]
    for s in samples:
        assert s["prompt"] in prompts and s["prompt"].endswith("=")  # the dataset's text, not ids
        assert isinstance(s["completion"], str) and s["reward"] in (0.0, 1.0)
    assert any(s["completion"] for s in samples)


def test_completions_per_step_zero_writes_no_samples(tiny_job):
    result = Job(tiny_job(trainer={"num_steps": 1}, logging={"completions_per_step": 0})).run()
    assert not (result.run_dir / "samples.jsonl").exists()


def test_samples_go_to_tensorboard_text_too(tmp_path):
    import pytest

    pytest.importorskip("tensorboardX")
    from loomrl.telemetry.metrics import MetricsLogger

    metrics = MetricsLogger(tmp_path)
    messages = [{"role": "user", "content": "2+2="}]
    metrics.log_samples(
        [{"prompt_index": 0, "prompt": messages, "completion": "four-ish", "reward": 0.25}], 7
    )
    metrics.close()
    assert read_samples(tmp_path) == [
        {"step": 7, "prompt_index": 0, "prompt": messages, "completion": "four-ish", "reward": 0.25}
    ]
    (events,) = (tmp_path / "tb").iterdir()
    assert b"four-ish" in events.read_bytes() and b"samples" in events.read_bytes()
