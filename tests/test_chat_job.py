"""Chat environments with tools driven end to end by the controller with a tiny chat model:
the trainer gets the sampled tokens with the template's observations masked out, the record
has ``episode/*`` and samples.jsonl whole conversations; a generator killed mid-episode
loses and duplicates nothing."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
from pathlib import Path

import pytest

from loomrl.envs.chat import AssistantMessage, ChatEnvironment, ChatStepResult
from loomrl.job import Job
from loomrl.telemetry.metrics import read_metrics
from loomrl.training.executor import TrainerExecutor

from conftest import ROOT

pytestmark = pytest.mark.timeout(300)


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b


class TwoTurns(ChatEnvironment):
    """Every first turn is answered by a tool message (a call to ``add``, or the error the
    model's own call made), the second ends the episode; reward: the answer's length / 3."""

    tools = [add]

    def reset(self, row):
        return [{"role": "user", "content": row["prompt"]}]

    async def step(self, message: AssistantMessage) -> ChatStepResult:
        if len(self.messages) == 2:
            answers = await self.runner.run(message)
            return ChatStepResult(answers or [{"role": "user", "content": "again"}], 0.0, False)
        return ChatStepResult([], len(message.content.strip()) / 3, True)


@pytest.fixture
def chat_model(tmp_path: Path) -> Path:
    """The calculator's template on a tiny model whose every letter and digit ends a turn
    (a random model then finishes turns, and episodes get their second turn)."""
    from examples.calculator.model import CHAT_TEMPLATE
    from loomrl.models import build_tiny_model

    model, tok = build_tiny_model(
        "llama",
        hidden_size=32,
        num_layers=2,
        num_heads=2,
        intermediate_size=64,
        max_position_embeddings=256,
    )
    tok.chat_template = CHAT_TEMPLATE
    ends = [tok.convert_tokens_to_ids(c) for c in "abcdefghijklmnopqrstuvwxyz0123456789"]
    model.generation_config.eos_token_id = [tok.eos_token_id, *ends]
    folder = tmp_path / "chat"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def _chat_job(tiny_job, chat_model, **sections):
    data = ROOT / "examples/calculator"
    return tiny_job(
        model={"path": str(chat_model)},
        data={
            "train": str(data / "train.jsonl"),
            "eval": str(data / "eval.jsonl"),
            "max_eval_examples": 4,
        },
        task={"reward": None, "environment": "test_chat_job:TwoTurns", "max_turns": 3},
        generation={"max_new_tokens": 8, "prompts_per_request": 2},
        **sections,
    )


def test_a_chat_job_trains_on_sampled_tokens_and_records_episodes(
    tiny_job, chat_model, monkeypatch
):
    trained: list = []
    real_step = TrainerExecutor.train_step

    def recording_step(self, groups, publish=False):
        trained.extend(r for g in groups for r in g)
        return real_step(self, groups, publish)

    monkeypatch.setattr(TrainerExecutor, "train_step", recording_step)
    result = Job(_chat_job(tiny_job, chat_model, trainer={"num_steps": 2})).run()
    assert len(trained) == 2 * 4 * 4 and result.summary["failed"] == 0
    two_turns = [r for r in trained if r.num_turns == 2]
    assert two_turns
    for r in two_turns:
        masked = [t for t, m in zip(r.completion_ids, r.loss_mask) if not m]
        assert masked and all(
            lp == 0.0 for lp, m in zip(r.behaviour_logprobs, r.loss_mask) if not m
        )
        assert "[tool" in r.completion or "[user] again" in r.completion
    steps = [r for r in read_metrics(result.run_dir) if "train/loss" in r]
    assert sum(r["episode/count"] for r in steps) >= 2 * 4 * 4
    # episode/*_mean are per window: a step whose episodes all finished before the previous
    # record has none (async); the counters by end reason are running totals, in every record
    assert any("episode/turns_mean" in r for r in steps)
    ends = sum(v for k, v in steps[-1].items() if k.startswith("episode/end_"))
    assert "episode/end_answered" in steps[-1] and ends >= 2 * 4 * 4
    samples = [
        json.loads(line) for line in (result.run_dir / "samples.jsonl").read_text().splitlines()
    ]
    assert samples and all(s["completion"].startswith("[assistant]") for s in samples)
    assert samples[0]["prompt"].startswith("[user] ")


@pytest.mark.slow
def test_a_generator_killed_mid_episode_loses_and_duplicates_nothing(
    tiny_job, chat_model, tmp_path
):
    done: list[int] = []

    def on_record(record):
        if record.get("step") == 2 and "train/loss" in record and not done:
            (proc,) = [
                p for p in multiprocessing.active_children() if p.name == "loomrl-generator0"
            ]
            done.append(proc.pid)
            os.kill(proc.pid, signal.SIGKILL)

    cfg = _chat_job(
        tiny_job,
        chat_model,
        runtime="process",
        trainer={"num_steps": 5},
        faults={"min_deadline_s": 3.0, "deadline_factor": 10.0},
        weight_sync={"codec": "delta", "full_every": 1000},
    )
    result = Job(cfg).run(on_record=on_record)
    assert done
    s = result.summary
    assert s["steps"] == 5 and s["trained"] == 5 * 4 * 4
    assert s["generated"] == s["trained"] + s["dropped_stale"] + s["failed"] + s["in_flight"]
    assert s["prompts_trained_twice"] == 0
    assert s["faults"]["executor/generator_restarts"] == 1
    assert not multiprocessing.active_children()


@pytest.mark.slow
def test_per_turn_samples_train_each_turn_alone_and_a_rewriting_template_is_named(
    tiny_job, chat_model, monkeypatch
):
    from examples.calculator.model import CHAT_TEMPLATE
    from loomrl.envs.chat_render import TemplateDriftError
    from loomrl.models import load_tokenizer

    trained: list = []
    real_step = TrainerExecutor.train_step

    def recording_step(self, groups, publish=False):
        trained.extend(r for g in groups for r in g)
        return real_step(self, groups, publish)

    monkeypatch.setattr(TrainerExecutor, "train_step", recording_step)
    sections = {"trainer": {"num_steps": 2}, "eval": {"every_steps": 1}}
    cfg = _chat_job(tiny_job, chat_model, **sections)
    cfg.task.chat.per_turn_samples = True
    result = Job(cfg).run()
    assert result.summary["failed"] == 0 and result.eval_history
    assert trained and all(r.loss_mask == [1] * len(r.completion_ids) for r in trained)
    assert len(trained) > 2 * 4 * 4  # some episodes gave two samples
    s = result.summary
    assert s["generated"] == s["trained"] + s["dropped_stale"] + s["failed"] + s["in_flight"]
    # The same job on a template that drops earlier tool calls stops, named.
    tok = load_tokenizer(str(chat_model))
    tok.chat_template = CHAT_TEMPLATE.replace(
        "{% for c in m.tool_calls or [] %}",
        "{% for c in (m.tool_calls if loop.last else []) or [] %}",
    ).replace("A:{{ m.content }}", "A:{% if loop.last %}{{ m.content }}{% endif %}")
    tok.save_pretrained(chat_model)
    with pytest.raises(TemplateDriftError, match="rewrites earlier turns"):
        Job(_chat_job(tiny_job, chat_model, trainer={"num_steps": 2})).run(overwrite=True)
