"""Model-based scoring (loomrl.scoring): a reward model and a generative judge as scorer
executors, with tiny models built here and saved to the test's folder."""

from __future__ import annotations

import asyncio
import json
import logging
import multiprocessing
import os
import signal
from functools import partial

import pytest
import torch

from loomrl.config import ConfigError, JudgeScorerConfig, ModelScorerConfig, TaskConfig
from loomrl.job import Job
from loomrl.runtime.local import LocalRuntime
from loomrl.runtime.supervision import FaultStats, Supervised
from loomrl.scoring.base import ScorerEndpoints
from loomrl.scoring.batched import token_budget_batches
from loomrl.scoring.client import Scorer
from loomrl.scoring.executor import start_scorer_executor
from loomrl.scoring.function import FunctionScorer
from loomrl.scoring.judge import JudgeScorer
from loomrl.scoring.model import RewardModelScorer
from loomrl.telemetry.metrics import read_metrics
from loomrl.types import Group, Rollout

pytestmark = pytest.mark.timeout(240)

CHAT_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
JUDGE = "tiny:llama?hidden_size=32&num_layers=1&num_heads=2&intermediate_size=64"
PAIRS = [
    ("1+1=", "2", {}),
    ("12+30=", "42", {}),
    ("7+8=", "fifteen, I think", {}),
    ("100+1=", "101", {}),
    ("3+3=", "", {}),
    ("a long prompt: 9+9=", "18 and more text here", {}),
]


def save_reward_model(
    folder, arch: str = "qwen2", chat_template: str | None = None, seed: int = 0
) -> str:
    """A tiny sequence-classification reward model (num_labels 1) and its character
    tokenizer, saved as a Hugging Face folder."""
    from transformers import AutoModelForSequenceClassification, LlamaConfig, Qwen2Config

    from loomrl.models.tiny import build_char_tokenizer

    tok = build_char_tokenizer()
    if chat_template is not None:
        tok.chat_template = chat_template
    config_cls = Qwen2Config if arch == "qwen2" else LlamaConfig
    config = config_cls(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=128,
        num_labels=1,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
        with torch.no_grad():  # a score head that reads the model, not the zeros HF may start it at
            model.score.weight.normal_(0.0, 1.0)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


@pytest.fixture
def reward_model(tmp_path) -> str:
    return save_reward_model(tmp_path / "rm")


def _direct_scores(path: str, texts: list[str]) -> list[float]:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    with torch.no_grad():
        return [model(**tok(text, return_tensors="pt")).logits[0, 0].item() for text in texts]


def _scores(scorer, items) -> list[float]:
    outcomes, _ = scorer.score(items)
    assert all(status == "ok" for status, _, _ in outcomes), outcomes
    return [value for _, value, _ in outcomes]


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_the_reward_model_scorer_gives_the_scores_of_the_model_called_directly(tmp_path, arch):
    path = save_reward_model(tmp_path / "rm", arch)
    scores = _scores(RewardModelScorer(ModelScorerConfig(path=path, device="cpu")), PAIRS)
    expected = _direct_scores(path, [p + c for p, c, _ in PAIRS])
    assert scores == pytest.approx(expected, abs=1e-5)
    assert len(set(scores)) == len(scores)  # the model reads the text (not one constant score)


def test_a_reward_model_with_a_chat_template_reads_the_conversation_through_it(tmp_path):
    path = save_reward_model(tmp_path / "rm", chat_template=CHAT_TEMPLATE)
    scores = _scores(RewardModelScorer(ModelScorerConfig(path=path, device="cpu")), PAIRS[:3])
    texts = [f"<user>{p}\n<assistant>{c}\n" for p, c, _ in PAIRS[:3]]
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok, model = (
        AutoTokenizer.from_pretrained(path),
        AutoModelForSequenceClassification.from_pretrained(path).eval(),
    )
    with torch.no_grad():
        expected = [
            model(**tok(t, add_special_tokens=False, return_tensors="pt")).logits[0, 0].item()
            for t in texts
        ]
    assert scores == pytest.approx(expected, abs=1e-5)


def test_batching_by_a_token_budget_gives_the_scores_of_one_by_one(reward_model):
    items = PAIRS * 3
    one_by_one = RewardModelScorer(
        ModelScorerConfig(path=reward_model, device="cpu", max_tokens_per_batch=1)
    )
    batched = RewardModelScorer(
        ModelScorerConfig(path=reward_model, device="cpu", max_tokens_per_batch=120)
    )
    alone, together = _scores(one_by_one, items), _scores(batched, items)
    assert together == pytest.approx(alone, abs=1e-5)
    assert one_by_one.metrics()["scorer/model_batches"] == len(items)
    # batched, and within the budget
    assert 1 < batched.metrics()["scorer/model_batches"] < len(items)


def test_token_budget_batches_keep_within_the_budget_and_cover_every_row_once():
    lengths = [5, 40, 3, 12, 12, 7, 100, 1]
    batches = token_budget_batches(lengths, 40)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for batch in batches:
        assert len(batch) == 1 or len(batch) * max(lengths[i] for i in batch) <= 40
    assert [6] in batches  # longer than the budget: alone


def test_normalize_and_clip(reward_model):
    raw = _scores(RewardModelScorer(ModelScorerConfig(path=reward_model, device="cpu")), PAIRS)
    normed = _scores(
        RewardModelScorer(ModelScorerConfig(path=reward_model, device="cpu", normalize=True)), PAIRS
    )
    mean, std = (
        sum(raw) / len(raw),
        torch.tensor(raw, dtype=torch.float64).std(unbiased=False).item(),
    )
    assert normed == pytest.approx([(r - mean) / std for r in raw], abs=1e-6)
    clipped = _scores(
        RewardModelScorer(
            ModelScorerConfig(path=reward_model, device="cpu", normalize=True, clip=0.5)
        ),
        PAIRS,
    )
    assert (
        clipped == pytest.approx([min(max(v, -0.5), 0.5) for v in normed])
        and max(map(abs, normed)) > 0.5
    )


def test_a_text_longer_than_the_reward_model_reads_is_a_counted_failure(reward_model):
    outcomes, _ = RewardModelScorer(ModelScorerConfig(path=reward_model, device="cpu")).score(
        [("x" * 500, "1", {}), ("1+1=", "2", {})]
    )
    assert outcomes[0][0] == "too_long" and "128" in outcomes[0][1] and outcomes[1][0] == "ok"


def test_a_folder_that_is_not_a_reward_model_is_refused(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        RewardModelScorer(ModelScorerConfig(path=str(tmp_path), device="cpu"))


def digits(text: str) -> float | None:
    """A judge parser: the judgement's leading number, None when it has none."""
    head = text.strip().split(" ")[0]
    return float(head) if head.replace(".", "", 1).isdigit() else None


def length(text: str) -> float:
    return float(len(text))


def _groups(items) -> list[Group]:
    """Each ``(prompt, completion, row)`` as a group of one, as evaluation scores them."""
    return [
        Group.of_rollouts(i, 0, [Rollout(i, [], [], [], [], 0, prompt=p, completion=c, row=row)])
        for i, (p, c, row) in enumerate(items)
    ]


def _score_with_executor(task: TaskConfig, items) -> tuple[Scorer, list[Rollout]]:
    """Score ``items`` as a job does: a Scorer over one scorer executor on ``local``; the
    scorer and the scored rollouts."""
    runtime = LocalRuntime()
    try:
        handle = runtime.start(
            "scorer0", partial(start_scorer_executor, task, None), ScorerEndpoints
        )
        scorer = Scorer(task)
        scorer.attach([Supervised(None, handle, deadlines=None, stats=FaultStats())], FaultStats())
        groups = _groups(items)
        asyncio.run(scorer.score_groups(groups))
        return scorer, [rollout for group in groups for rollout in group]
    finally:
        runtime.shutdown()


def test_a_judgement_the_parser_cannot_read_is_a_counted_failure_with_the_text_in_the_log(caplog):
    # This random tiny judge repeats the prompt's last character: a number for some completions.
    task = TaskConfig(
        scorer={
            "type": "judge",
            "path": JUDGE,
            "device": "cpu",
            "max_new_tokens": 6,
            "prompt_template": "Judge {prompt}{completion}",
            "parser": "test_model_scorer:digits",
        }
    )
    judge = JudgeScorer(task.scorer)
    texts = judge.judge([judge.encode(item) for item in PAIRS])
    # left-padded in a batch, it writes as alone
    assert judge.judge([judge.encode(PAIRS[2])]) == [texts[2]]
    with caplog.at_level(logging.WARNING):
        scorer, rollouts = _score_with_executor(task, PAIRS)
    parsed = [digits(text) for text in texts]
    assert None in parsed and any(p is not None for p in parsed)
    for rollout, value, text in zip(rollouts, parsed, texts):
        if value is None:  # never a silent 0
            assert (
                rollout.status == "failed"
                and rollout.reward is None
                and repr(text) in rollout.error
            )
        else:
            assert rollout.status == "ok" and rollout.reward == value
    assert dict(scorer.failures_by_reason) == {"judge_unparsed": parsed.count(None)}
    unparsed = [text for text, value in zip(texts, parsed) if value is None]
    assert (
        "judge_unparsed" in caplog.text
        and repr(unparsed[0]) in caplog.text
        and repr(unparsed[1]) in caplog.text
    )


def test_a_judge_scores_with_its_parser_and_a_missing_column_is_a_counted_failure():
    task = TaskConfig(
        scorer={
            "type": "judge",
            "path": JUDGE,
            "device": "cpu",
            "max_new_tokens": 5,
            "prompt_template": "{prompt}{completion} ({answer})",
            "parser": "test_model_scorer:length",
        }
    )
    items = [("1+1=", "2", {"answer": "2"}), ("2+2=", "4", {})]
    scorer, rollouts = _score_with_executor(task, items)
    assert rollouts[0].status == "ok" and isinstance(rollouts[0].reward, float)
    assert rollouts[1].status == "failed" and "answer" in rollouts[1].error
    assert dict(scorer.failures_by_reason) == {"judge_template": 1}


def test_config_needs_exactly_one_way_to_score_and_a_function_scorer_is_task_reward():
    with pytest.raises(
        ValueError, match="exactly one of 'reward' or 'environment'.*got 'reward' and 'scorer'"
    ):
        TaskConfig(
            reward="examples.arithmetic.reward:exact_match", scorer={"type": "model", "path": "rm"}
        )
    with pytest.raises(ValueError, match="not a Python format string"):
        JudgeScorerConfig(path=JUDGE, prompt_template="{prompt", parser="m:f")
    task = TaskConfig(scorer={"type": "function", "path": "examples.arithmetic.reward:exact_match"})
    executor = start_scorer_executor(task, None)
    try:
        assert isinstance(executor, FunctionScorer)
        from examples.arithmetic.reward import exact_match

        # (a lone reward, its None read as "not applicable": scoring.reward_list.single)
        assert executor.fn.reward is exact_match and Scorer(task).fn.reward is exact_match
    finally:
        executor.close()


def _model_job(tiny_job, reward_model: str, runtime: str, **sections):
    return tiny_job(
        runtime=runtime,
        task={"reward": None, "scorer": {"type": "model", "path": reward_model, "device": "cpu"}},
        **sections,
    )


@pytest.mark.parametrize(
    "runtime", ["local", "process", pytest.param("ray", marks=pytest.mark.ray)]
)
def test_a_job_trains_with_a_model_scorer(tiny_job, reward_model, runtime, request):
    if runtime == "ray":
        request.getfixturevalue("ray_cluster")
    cfg = _model_job(tiny_job, reward_model, runtime, trainer={"num_steps": 2})
    result = Job(cfg).run()
    s = result.summary
    assert s["steps"] == 2 and not s.get("job_failed") and s["failed"] == 0
    assert s["trained"] == 2 * cfg.algorithm.groups_per_step * cfg.algorithm.group_size
    means = [
        r["rollout/reward_mean"] for r in read_metrics(result.run_dir) if "rollout/reward_mean" in r
    ]
    # the model's scores, not 0/1 rewards
    assert means and all(abs(m * 16 - round(m * 16)) > 1e-6 for m in means)


def test_a_job_trains_with_a_judge(tiny_job):
    cfg = tiny_job(
        task={
            "reward": None,
            "scorer": {
                "type": "judge",
                "path": JUDGE,
                "device": "cpu",
                "max_new_tokens": 3,
                "prompt_template": "{prompt}{completion} ({answer})",
                "parser": "test_model_scorer:length",
            },
        },
        trainer={"num_steps": 2},
    )
    s = Job(cfg).run().summary
    assert s["steps"] == 2 and not s.get("job_failed") and s["failed"] == 0
    assert s["trained"] == 2 * cfg.algorithm.groups_per_step * cfg.algorithm.group_size


def test_a_killed_model_scorer_is_replaced_and_no_rollout_is_lost_or_scored_twice(
    tiny_job, reward_model
):
    cfg = _model_job(
        tiny_job,
        reward_model,
        "process",
        trainer={"num_steps": 4},
        checkpoint={"every_steps": 100},
        faults={"min_deadline_s": 3.0, "deadline_factor": 10.0},
    )
    killed = []

    def on_record(record):
        if record.get("step") == 2 and "train/loss" in record and not killed:
            (proc,) = [p for p in multiprocessing.active_children() if p.name == "loomrl-scorer0"]
            killed.append(proc.pid)
            os.kill(proc.pid, signal.SIGKILL)

    result = Job(cfg).run(on_record=on_record)
    assert killed
    s = result.summary
    assert s["steps"] == 4 and not s.get("job_failed")
    assert s["generated"] == s["trained"] + s["dropped_stale"] + s["failed"] + s["in_flight"]
    assert s["trained"] == 4 * cfg.algorithm.groups_per_step * cfg.algorithm.group_size
    assert s["prompts_trained_twice"] == 0 and s["failed"] == 0
    faults = s["faults"]
    assert faults["executor/scorer_failures"] == 1 and faults["executor/scorer_restarts"] == 1
    assert faults["executor/rescored_rollouts"] > 0 and faults["executor/lost_rollouts"] == 0
    assert not multiprocessing.active_children()


@pytest.mark.slow  # ~15-30 s: waits out a deadline (the same path as test_faults' hung generator)
def test_a_model_scorer_that_stops_answering_is_replaced_after_its_deadline(tiny_job, reward_model):
    cfg = _model_job(
        tiny_job,
        reward_model,
        "process",
        trainer={"num_steps": 6},
        checkpoint={"every_steps": 100},
        faults={"min_deadline_s": 3.0, "deadline_factor": 10.0},
    )
    stopped = []

    def on_record(record):
        if record.get("step") == 3 and "train/loss" in record and not stopped:
            (proc,) = [p for p in multiprocessing.active_children() if p.name == "loomrl-scorer0"]
            stopped.append(proc.pid)
            os.kill(proc.pid, signal.SIGSTOP)  # alive, but never answers

    s = Job(cfg).run(on_record=on_record).summary
    assert stopped and s["steps"] == 6 and not s.get("job_failed") and s["failed"] == 0
    assert s["generated"] == s["trained"] + s["dropped_stale"] + s["failed"] + s["in_flight"]
    assert s["faults"]["executor/hung_kills"] == 1 and s["faults"]["executor/scorer_restarts"] == 1
    assert s["faults"]["executor/lost_rollouts"] == 0 and s["prompts_trained_twice"] == 0


def test_a_scorer_table_survives_the_run_folder_config_round_trip(tiny_job, reward_model):
    from loomrl.config import build_config

    cfg = _model_job(tiny_job, reward_model, "local")
    again = build_config(json.loads(cfg.to_json()))
    assert again == cfg and isinstance(again.task.scorer, ModelScorerConfig)


@pytest.mark.gpu
def test_a_reward_model_on_cuda_in_bfloat16_scores_close_to_float32_on_the_cpu(reward_model):
    cpu = _scores(RewardModelScorer(ModelScorerConfig(path=reward_model, device="cpu")), PAIRS)
    # dtype auto: bfloat16
    scorer = RewardModelScorer(ModelScorerConfig(path=reward_model, device="cuda"))
    assert next(scorer.model.parameters()).dtype == torch.bfloat16
    assert all(not p.requires_grad for p in scorer.model.parameters())
    gpu = _scores(scorer, PAIRS)
    spread = max(cpu) - min(cpu)
    assert gpu == pytest.approx(cpu, abs=0.05 * spread)


def test_config_error_names_an_unknown_scorer_type(tiny_job, reward_model):
    with pytest.raises(ConfigError, match="task.scorer.*'reward_model'"):
        tiny_job(task={"reward": None, "scorer": {"type": "reward_model", "path": reward_model}})
