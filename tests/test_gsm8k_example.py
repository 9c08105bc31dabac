"""examples/gsm8k: the math-verify correctness reward scores known answers right in GSM8K's
``####`` form and in LaTeX, the shipped data is consistent with it, and the job file trains
through the chat template from a dataset folder with both rewards logged on their own."""

from __future__ import annotations

import json

import pytest

from conftest import ROOT

pytest.importorskip("math_verify")
pytest.importorskip("datasets")

from examples.gsm8k.rewards import correctness, format_reward, gold_answer  # noqa: E402

GOLD = "Step one.\nStep two = <<2*36=72>>72.\n#### 72"


@pytest.mark.parametrize(
    ("completion", "right"),
    [
        ("2 * 36 = 72\n#### 72", True),
        ("#### 72.0", True),
        ("The answer is \\boxed{72}", True),
        ("So she has $72$ left.", True),
        ("$\\frac{144}{2}$", True),
        ("First 70, then 72", True),  # no final-answer marker: the text's last number
        ("#### 71", False),
        ("#### 72 apples? no: #### 27", False),  # the last #### counts
        ("\\boxed{27}", False),
        ("I do not know", False),
        ("", False),
    ],
)
def test_correctness_scores_known_answers(completion, right):
    assert correctness("q", completion, GOLD) == float(right)


def test_gold_answers_drop_commas_and_a_row_without_hashes_is_an_error():
    assert gold_answer("... #### 1,234") == "1234"
    assert correctness("q", "#### 1,234", "x #### 1,234") == 1.0
    assert correctness("q", "\\boxed{1234}", "x #### 1,234") == 1.0
    with pytest.raises(ValueError, match="ends with '#### N'"):
        gold_answer("72")


def test_format_reward_wants_a_final_answer_line():
    assert format_reward("q", "work\n#### 72") == 1.0
    assert format_reward("q", "so \\boxed{72}") == 1.0
    assert format_reward("q", "72") == 0.0
    assert format_reward("q", "#### 72 and more words") == 0.0


def test_every_shipped_row_is_answered_right_by_its_own_worked_answer():
    for split in ("train", "test"):
        rows = [json.loads(s) for s in (ROOT / f"examples/gsm8k/data/{split}.jsonl").open()]
        assert len(rows) >= 40
        for row in rows:
            assert correctness(row["question"], row["answer"], row["answer"]) == 1.0, row


def test_the_job_file_trains_from_the_folder_through_the_template(tmp_path):
    from examples.gsm8k.make_model import build
    from loomrl.config import load_config
    from loomrl.job import Job

    model = build(tmp_path / "instruct")
    cfg = load_config(
        ROOT / "examples/gsm8k/job.toml",
        [
            f"model.path={json.dumps(str(model))}",
            f"data.train={json.dumps(str(ROOT / 'examples/gsm8k/data'))}",
            f"data.eval={json.dumps(str(ROOT / 'examples/gsm8k/data'))}",
            f"output_dir={json.dumps(str(tmp_path / 'runs'))}",
            "trainer.num_steps=2",
            "eval.every_steps=2",
            "data.max_eval_examples=8",
            "generation.max_new_tokens=8",
        ],
    )
    result = Job(cfg).run()
    records = [json.loads(s) for s in (result.run_dir / "metrics.jsonl").open()]
    trained = [r for r in records if "reward/correctness_mean" in r]
    assert len(trained) == 2 and all("reward/format_mean" in r for r in trained)
    samples = [json.loads(s) for s in (result.run_dir / "samples.jsonl").open()]
    questions = {
        json.loads(s)["question"] for s in (ROOT / "examples/gsm8k/data/train.jsonl").open()
    }
    assert samples and all(s["prompt"] in questions for s in samples)
