"""A TRL user's path (issue 55, items 1, 3 and 7): ``Job(...)`` takes any key in TRL's or
loomrl's spelling; a reward returning None does not apply to that sample (TRL's rule),
counted; TRL-signature rewards get completions in the prompt's form; samples.jsonl holds the
rendered prompt and each reward part's value."""

from __future__ import annotations

import asyncio
import json
import re

import pytest

from loomrl.config import ConfigError, DataConfig, RewardSpec, TaskConfig, build_config
from loomrl.job import Job
from loomrl.scoring.calls import call_reward_batch
from loomrl.scoring.client import Scorer
from loomrl.scoring.reward_list import combine, load_reward, trl_adapter
from loomrl.telemetry.metrics import read_metrics, read_samples
from loomrl.types import PartedReward

from conftest import TINY_MODEL, json_to_toml, tiny_job_raw

ROWS = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(5) for b in range(5)]


def odd_only(prompts, completions, answer, **kwargs):
    """A TRL reward that applies to odd answers only (None for the others)."""
    return [float(len(c)) if int(a) % 2 else None for c, a in zip(completions, answer)]


def length_reward(prompt, completion, **row):
    return len(completion) / 4


def never(prompt, completion, **row):
    return None


def _scores(fn, items):
    return [value for value, _ in asyncio.run(call_reward_batch(fn, items, 5.0))]


def test_the_trl_style_job_call_trains(tmp_path):
    result = Job(
        model=TINY_MODEL,
        dataset=ROWS,
        reward_funcs=[odd_only, length_reward],
        reward_weights=[1, 0.2],
        num_generations=4,
        max_completion_length=3,
        learning_rate=1e-3,
        beta=0.0,
        max_steps=2,
        per_device_train_batch_size=8,
        groups_per_step=4,
        logging={"report": False, "completions_per_step": 4},
        output_dir=str(tmp_path / "run"),
    ).run()
    cfg = json.loads((result.run_dir / "config.json").read_text())
    assert cfg["algorithm"]["group_size"] == 4 and cfg["generation"]["max_new_tokens"] == 3
    assert cfg["trainer"]["lr"] == 1e-3 and cfg["algorithm"]["kl_coef"] == 0.0
    assert [(r["name"], r["weight"]) for r in cfg["task"]["rewards"]] == [
        ("odd_only", 1.0),
        ("length_reward", 0.2),
    ]
    s = result.summary
    assert s["steps"] == 2 and s["failed"] == 0
    steps = [r for r in read_metrics(result.run_dir) if "train/loss" in r]
    # answers are odd in 12 of the 25 rows: odd_only skipped some rollouts, and they trained
    # (a record holds what was scored since the one before: a step may have nothing new)
    assert sum(r.get("reward/odd_only_none", 0) for r in steps) > 0
    assert all(r.get("reward/length_reward_none", 0) == 0 for r in steps)
    assert any("reward/length_reward_none" in r for r in steps)
    samples = read_samples(result.run_dir)
    assert samples
    for sample in samples:
        # a plain-text prompt: the model saw the tokenizer's BOS and the text
        assert sample["rendered_prompt"] == "<bos>" + sample["prompt"]
        parts = sample["rewards"]
        expected_odd = (
            float(len(sample["completion"])) if int(eval(sample["prompt"][:-1])) % 2 else None
        )
        assert parts == {"odd_only": expected_odd, "length_reward": len(sample["completion"]) / 4}
        answered = (parts["odd_only"] or 0.0) * 1.0 + parts["length_reward"] * 0.2
        assert sample["reward"] == pytest.approx(answered)


def test_job_keywords_in_either_spelling_on_any_base(tmp_path, tiny_data):
    train, evals = tiny_data
    raw = tiny_job_raw(tmp_path, train, evals)
    toml = tmp_path / "job.toml"
    toml.write_text(json_to_toml(raw))
    base = build_config(raw)
    for start in (base, str(toml), raw):
        job = Job(
            start,
            max_new_tokens=24,
            kl_coef=0.01,
            trainer={"warmup_steps": 3},
            bf16=True,
            adam_beta2=0.99,
            scale_rewards=False,
            **{"generation.temperature": 0.5},
        )
        c = job.config
        assert c.generation.max_new_tokens == 24 and c.algorithm.kl_coef == 0.01
        assert c.trainer.warmup_steps == 3 and c.trainer.lr == raw["trainer"]["lr"]
        assert c.model.dtype == "bfloat16" and c.trainer.precision == "bf16_mixed"
        assert c.trainer.betas == (0.9, 0.99) and c.algorithm.advantage_scale == "none"
        assert c.generation.temperature == 0.5 and c.model.path == TINY_MODEL
    same = Job(base, overrides=["trainer.lr=0.5"], learning_rate=0.25)
    assert same.config.trainer.lr == 0.5  # overrides come last
    listed = Job(base, rewards=["test_trl_path:never", {"path": length_reward, "weight": 2}])
    assert [(r.label, r.weight) for r in listed.config.task.rewards] == [
        ("never", 1.0),
        ("length_reward", 2.0),
    ]


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (
            {"learnin_rate": 1e-5},
            "Job(learnin_rate=...): unknown keyword (did you mean learning_rate?",
        ),
        ({"max_new_token": 4}, "did you mean max_new_tokens?"),
        (
            {"gradient_accumulation_steps": 4},
            "TRL's 'gradient_accumulation_steps' has no loomrl keyword; write algorithm.groups_per_step",
        ),
        ({"type": "x"}, "several keys are named 'type'"),
        (
            {"rewards": [length_reward], "reward_weights": [1, 2]},
            "reward_weights has 2 weights for 1 reward functions",
        ),
        ({"scale_rewards": "batch"}, "scale_rewards='batch'"),
        (
            {"model": object()},
            "model= takes a model folder, a 'tiny:' spec or a transformers PreTrainedModel",
        ),
    ],
)
def test_a_bad_keyword_is_refused_by_name(kwargs, message):
    with pytest.raises((TypeError, ValueError), match=re.escape(message)):
        Job(dataset="d.jsonl", reward="m:f", **kwargs)


def test_a_trl_name_in_a_bad_value_is_named_in_the_error():
    with pytest.raises(ConfigError, match=r"TRL's beta=algorithm.kl_coef.*\n.*kl_coef"):
        Job(model=TINY_MODEL, dataset="d.jsonl", reward="m:f", beta=-1.0)


def test_a_model_object_without_its_tokenizer_gets_a_short_error():
    from loomrl.models import build_tiny_model

    model, tokenizer = build_tiny_model(
        "llama", hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32
    )
    with pytest.raises(TypeError) as info:
        Job(model=model, dataset="d.jsonl", reward="m:f")
    text = str(info.value)
    assert "processing_class=" in text and "LlamaForCausalLM" in text
    assert len(text) < 400 and "Linear(" not in text  # no module tree


def test_none_from_a_reward_part_skips_it_and_all_none_gives_zero_counted():
    fn = combine(
        [
            RewardSpec(path="test_trl_path:never", weight=3.0),
            RewardSpec(path="test_trl_path:odd_only", weight=0.5),
            RewardSpec(path="test_trl_path:length_reward", weight=2.0),
        ]
    )
    values = _scores(fn, [("1+2=", "abcd", {"answer": "3"}), ("1+1=", "ab", {"answer": "2"})])
    assert values == [0.5 * 4.0 + 2.0 * 1.0, 2.0 * 0.5]
    assert isinstance(values[0], PartedReward)
    assert values[1].parts == {"never": None, "odd_only": None, "length_reward": 0.5}
    stats = fn.reward_stats.drain()
    assert stats["reward/never_none"] == 2.0 and stats["reward/never_count"] == 0.0
    assert stats["reward/odd_only_none"] == 1.0 and stats["reward/odd_only_sum"] == 4.0
    assert "reward/unanswered" not in stats
    nobody = combine(
        [RewardSpec(path="test_trl_path:never"), RewardSpec(path="test_trl_path:odd_only")]
    )
    assert _scores(nobody, [("1+1=", "ab", {"answer": "2"})]) == [0.0]  # TRL's nansum of nothing
    assert nobody.reward_stats.drain()["reward/unanswered"] == 1.0
    single = load_reward(TaskConfig(reward="test_trl_path:never"))
    assert _scores(single, [("p", "c", {}), ("p", "d", {})]) == [0.0, 0.0]
    assert single.reward_stats.drain() == {"reward/unanswered": 2.0}


def test_the_scorer_reports_none_counts_and_warns_once_when_no_reward_answered(caplog):
    scorer = Scorer(
        TaskConfig(
            rewards=[
                RewardSpec(path="test_trl_path:never"),
                RewardSpec(path="test_trl_path:odd_only"),
            ]
        )
    )
    items = [("1+1=", "a", {"answer": "2"}), ("1+2=", "b", {"answer": "3"})]
    with caplog.at_level("WARNING"):
        outcomes = asyncio.run(scorer._outcomes(items))
        metrics = scorer.reward_metrics()
    assert [o[0] for o in outcomes] == ["ok", "ok"] and [o[1] for o in outcomes] == [0.0, 1.0]
    assert metrics["reward/never_none"] == 2.0 and metrics["reward/odd_only_none"] == 1.0
    assert metrics["reward/unanswered"] == 1.0 and metrics["reward/odd_only_mean"] == 1.0
    assert "reward/never_mean" not in metrics  # it answered nothing: no mean
    assert "1 rollouts so far got no reward" in caplog.text


def test_trl_rewards_get_completions_in_the_prompts_form():
    seen = []

    def record(prompts, completions, **kwargs):
        seen.append((prompts[0], completions[0]))
        return [0.0]

    system = DataConfig(train="x", system_prompt="Be brief.")
    plain = DataConfig(train="x")
    messages = [{"role": "user", "content": "hi"}]
    trl_adapter(record, "r", system)("2+2=", "4")
    trl_adapter(record, "r", plain)("2+2=", "4")
    trl_adapter(record, "r", plain)(messages, "hello")
    trl_adapter(record, "r", DataConfig(train="x", chat_template=True))("2+2=", "4")
    assistant = lambda text: [{"role": "assistant", "content": text}]  # noqa: E731
    assert seen == [
        (
            [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2="}],
            assistant("4"),
        ),
        ("2+2=", "4"),
        (messages, assistant("hello")),
        ([{"role": "user", "content": "2+2="}], assistant("4")),
    ]


def test_an_error_before_the_first_step_stands_alone_with_no_progress_bar(
    tmp_path, tiny_data, capsys
):
    from loomrl.cli import main

    train, evals = tiny_data
    raw = tiny_job_raw(tmp_path, train, evals, task={"reward": "no_such_module:reward"})
    (tmp_path / "job.toml").write_text(json_to_toml(raw))
    assert main(["run", str(tmp_path / "job.toml")]) == 2
    out, err = capsys.readouterr()
    assert "cannot import module 'no_such_module'" in err
    assert "step 0/" not in out + err and "eta" not in out + err


def test_every_trl_name_in_the_map_is_a_key_or_a_translation_that_validates(tmp_path):
    from loomrl.config import key_paths
    from loomrl.config_hints import TRL_KEYS, TRL_NAMES, TRL_VALUES

    assert set(TRL_KEYS.values()) <= set(key_paths())
    values = {
        "scale_rewards": True,
        "bf16": True,
        "fp16": True,
        "use_vllm": False,
        "adam_beta1": 0.8,
        "adam_beta2": 0.98,
        "report_to": ["tensorboard"],
        "log_completions": False,
        "importance_sampling_level": "sequence",
        "mask_truncated_completions": True,
    }
    assert set(values) == set(TRL_VALUES)
    for name, value in values.items():
        Job(model=TINY_MODEL, dataset="d.jsonl", reward="m:f", **{name: value})
    # the job file's hints name every one of them
    assert set(TRL_KEYS) | set(TRL_VALUES) <= set(TRL_NAMES)
