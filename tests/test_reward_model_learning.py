"""Learning checks for model-based scoring (issue 39): the arithmetic demo scored by a tiny
scorer trained here to reproduce exact match, against the same run scored by the exact-match
function from the same warm-start (held-out accuracy by exact match for both, 300 steps).
Every scorer trains on the training split only, every label by exact match.

The judge (``[task.scorer] type = "judge"``, ``examples/arithmetic/judge.py``) is the
demo's warm-start trained with the demo's supervised loop to read ``'047|12+34='`` and write
the sum and a verdict (``'046N'``), on right answers, near misses and the warm-start's own
samples. It reaches exact match's band (measured: 26.5% -> 81.5% by the judge, 82.5% by
exact match); the test asserts the band.

The reward model (``type = "model"``) is a ``LlamaForSequenceClassification`` started from
the demo's warm-start backbone with a fresh one-logit head, trained with a logistic loss on
training prompts with their right answer (label 1) and with wrong ones (label 0): the right
answer with one digit changed, and answers the backbone samples itself labelled by exact
match; plus the backbone's next-token loss on right answers. It teaches, short of the band
(59.5%): RL finds the ~7% of answers it misjudges. Both are saved as Hugging Face folders
and score the RL job in place of ``task.reward``. See docs/scoring.md.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WARMSTART = ROOT / ".cache/arithmetic-warmstart"
DIGIT_WEIGHTS = (0.2, 0.3, 0.5)  # hundreds, tens, units: which digit a wrong answer changes
ANSWER_DIGITS = 3  # the demo's answers are zero-padded to three digits


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def wrong_answer(answer: str, rng: random.Random) -> str:
    """``answer`` with one digit changed (never the answer itself)."""
    position = rng.choices(range(len(answer)), weights=DIGIT_WEIGHTS[-len(answer) :])[0]
    digit = rng.choice([d for d in "0123456789" if d != answer[position]])
    return answer[:position] + digit + answer[position + 1 :]


def labelled_batch(rows: list[dict], size: int, rng: random.Random) -> list[tuple[str, float]]:
    """``size`` (text, label) pairs, half right answers and half wrong ones."""
    batch = []
    for k in range(size):
        row = rng.choice(rows)
        right = k % 2 == 0
        answer = row["answer"] if right else wrong_answer(row["answer"], rng)
        batch.append((row["prompt"] + answer, 1.0 if right else 0.0))
    return batch


def sampled_batch(model, tok, rows: list[dict], size: int, rng: random.Random) -> list:
    """``size`` (text, label) pairs whose answers the backbone samples itself (temperature
    1, through the tied embedding), labelled by exact match: the kinds of mistakes a policy
    started from the same warm-start makes, which one changed digit does not cover (a
    reward model trained on those alone scored '73+07=101' as right, and RL learned it)."""
    import torch

    picked = [rng.choice(rows) for _ in range(size)]
    ids = tok([r["prompt"] for r in picked], return_tensors="pt").input_ids  # one length: 6
    with torch.no_grad():
        for _ in range(ANSWER_DIGITS):
            hidden = model.model(input_ids=ids).last_hidden_state[:, -1]
            logits = torch.nn.functional.linear(hidden, model.model.embed_tokens.weight)
            ids = torch.cat([ids, torch.multinomial(logits.softmax(-1), 1)], dim=1)
    answers = tok.batch_decode(ids[:, -ANSWER_DIGITS:], skip_special_tokens=True)
    return [
        (r["prompt"] + a, 1.0 if a.strip() == r["answer"] else 0.0) for r, a in zip(picked, answers)
    ]


def classification_and_answer_loss(model, tok, texts, labels):
    """The logistic loss of the score against the labels, plus the backbone's next-token
    loss on the right answers' digits (through the tied embedding, as the warm-start's
    language-model head). The one bit a pair gives is too little for the backbone to learn
    the units digit's sum (the score stayed at 26% of wrong answers caught for 400 steps);
    the answer loss teaches it as the warm-start does, and the score head reads it."""
    import torch
    import torch.nn.functional as F

    enc = tok(list(texts), return_tensors="pt", padding=True)
    hidden = model.model(**enc).last_hidden_state  # [batch, seq, hidden]
    last = enc.attention_mask.sum(1) - 1  # right-padded: the last real token
    score = model.score(hidden[torch.arange(len(texts)), last])[:, 0]
    loss = F.binary_cross_entropy_with_logits(score, torch.tensor(labels))
    right = torch.tensor(labels) > 0.5
    lm_logits = F.linear(hidden[right, :-1], model.model.embed_tokens.weight)
    targets = enc.input_ids[right, 1:].clone()
    position = torch.arange(targets.shape[1])  # target j is token j + 1
    first = (last[right] - ANSWER_DIGITS)[:, None]  # the answer's digits only, not the prompt's
    targets[(position < first) | (position > first + ANSWER_DIGITS - 1)] = -100
    return loss + F.cross_entropy(lm_logits.flatten(0, 1), targets.flatten(), ignore_index=-100)


def train_exact_match_reward_model(
    out: Path,
    warmstart: Path = WARMSTART,
    max_steps: int = 3000,
    seed: int = 0,
    batch: int = 64,
    target: float = 0.95,
    check_every: int = 100,
) -> dict:
    """A reward model trained to score right answers high and wrong ones low, saved to
    ``out``; trained until it agrees with exact match on ``target`` of held-out right and of
    held-out wrong answers (checked every ``check_every`` steps), or ``max_steps``. Returns
    the steps it took and its last agreement."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(seed)
    rng = random.Random(seed)
    rows = read_rows(ROOT / "examples/arithmetic/train.jsonl")
    tok = AutoTokenizer.from_pretrained(warmstart)
    model = AutoModelForSequenceClassification.from_pretrained(
        warmstart, num_labels=1, pad_token_id=tok.pad_token_id, dtype=torch.float32
    )
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.1)
    agree: dict = {}
    for step in range(1, max_steps + 1):
        pairs = labelled_batch(rows, batch // 2, rng) + sampled_batch(
            model, tok, rows, batch // 2, rng
        )
        texts, labels = zip(*pairs)
        loss = classification_and_answer_loss(model, tok, texts, labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % check_every == 0 or step == max_steps:
            model.eval()
            model.save_pretrained(out)
            tok.save_pretrained(out)
            agree = agreement(out)
            model.train()
            if min(agree.values()) >= target:
                break
    return {"steps": step, **agree}


def agreement(model_dir: Path, threshold: float = 0.0, per_kind: int = 200, seed: int = 1) -> dict:
    """How often the reward model's score is above ``threshold`` exactly when the answer is
    right, on held-out eval prompts with right and with wrong answers."""
    from loomrl.config import ModelScorerConfig
    from loomrl.scoring.model import RewardModelScorer

    rng = random.Random(seed)
    rows = read_rows(ROOT / "examples/arithmetic/eval.jsonl")
    scorer = RewardModelScorer(ModelScorerConfig(path=str(model_dir), device="cpu"))
    right = [(r["prompt"], r["answer"], {}) for r in rng.choices(rows, k=per_kind)]
    wrong = [(p, wrong_answer(a, rng), {}) for p, a, _ in right]
    scores = {
        kind: [v for _, v, _ in scorer.score(items)[0]]
        for kind, items in (("right", right), ("wrong", wrong))
    }
    return {
        "right_scored_right": sum(v > threshold for v in scores["right"]) / per_kind,
        "wrong_scored_wrong": sum(v <= threshold for v in scores["wrong"]) / per_kind,
    }


EXACT_MATCH = {"reward": "examples.arithmetic.reward:exact_match", "reward_timeout_s": 5.0}


def demo_run(out: Path, task: dict, steps: int, model: Path = WARMSTART, seed: int = 0) -> dict:
    """The demo job from ``model`` with ``task``'s scoring, ``steps`` synchronous steps, its
    held-out evaluation only at the start and the end; its summary."""
    from loomrl.config import load_config
    from loomrl.job import Job

    cfg = load_config(
        ROOT / "examples/arithmetic/job.toml",
        [
            f"model.path={str(model)!r}",
            f"seed={seed}",
            "algorithm.max_staleness=0",
            f"trainer.num_steps={steps}",
            "eval.every_steps=100000",
            "checkpoint.every_steps=100000",
            f"output_dir={str(out)!r}",
        ],
    )
    cfg = cfg.model_copy(update={"task": cfg.task.model_validate(task)})
    return Job(cfg).run().summary


def exact_match_accuracy(model: Path, out: Path) -> float:
    """``model``'s held-out accuracy by exact match, as the demo job evaluates it (a job's
    evaluation scores with the job's scorer: a reward-model run's reads the model's scores)."""
    return demo_run(out, EXACT_MATCH, 1, model=model)["eval_start"]


NEAR_MISS_STEPS = (-110, -100, -90, -10, -9, -1, 1, 9, 10, 90, 100, 110)  # carries gone wrong


def near_miss(answer: str, rng: random.Random) -> str:
    """A wrong answer of a kind a policy that half knows addition writes: one or two digits
    changed, a carry dropped or added (off by 1, 9, 10, 90, 100 or 110), two digits
    swapped, a digit too few or too many (never the answer itself)."""
    kind = rng.randrange(5)
    if kind == 0:
        return wrong_answer(answer, rng)
    if kind == 1:
        return wrong_answer(wrong_answer(answer, rng), rng)  # may restore it: checked below
    if kind == 2:
        value = int(answer) + rng.choice(NEAR_MISS_STEPS)
        return f"{value:0{len(answer)}d}" if 0 <= value < 10 ** len(answer) else answer[::-1]
    if kind == 3:
        return rng.choice([answer[:-1], answer[1:], answer + rng.choice("0123456789")])
    return answer[1] + answer[0] + answer[2:]


def near_misses(answer: str, rng: random.Random, k: int) -> list[str]:
    """``k`` near misses of ``answer`` (any that came out right are drawn again)."""
    out: list[str] = []
    while len(out) < k:
        out += [w for w in [near_miss(answer, rng)] if w != answer]
    return out


def policy_samples(model_dir: Path, rows: list[dict], temperature: float, seed: int) -> list:
    """(prompt, completion) pairs that the causal LM at ``model_dir`` samples for ``rows``
    as the demo's generator does (up to 4 tokens, stopping at EOS, special tokens dropped)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(model_dir)
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = tok([r["prompt"] for r in rows], return_tensors="pt").input_ids  # one length: 6
    with torch.no_grad():
        out = policy.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=True,
            temperature=temperature,
            top_k=0,
            max_new_tokens=4,
            pad_token_id=tok.pad_token_id,
        )
    texts = tok.batch_decode(out[:, ids.shape[1] :], skip_special_tokens=True)
    return [(r["prompt"], t) for r, t in zip(rows, texts)]


JUDGE_TEMPERATURES = (0.7, 1.0, 1.5)  # the warm-start's own samples, cooler and hotter


def judge_training_rows(rows: list[dict], seed: int, per_temperature: int = 4096) -> list:
    """The judge's examples, from training rows only, every label by exact match: each row
    twice with its right answer and twice with a near miss, and the warm-start's samples
    at ``JUDGE_TEMPERATURES`` (mostly wrong: 26% of its greedy answers are right)."""
    from examples.arithmetic.judge import judge_example

    rng = random.Random(seed)
    answers = {r["prompt"]: r["answer"] for r in rows}
    examples = []
    for row in rows:
        completions = [row["answer"]] * 2 + near_misses(row["answer"], rng, 2)
        examples += [judge_example(row["prompt"], c, row["answer"]) for c in completions]
    for k, temperature in enumerate(JUDGE_TEMPERATURES):
        picked = rng.sample(rows, per_temperature)
        for prompt, completion in policy_samples(WARMSTART, picked, temperature, seed + k):
            examples.append(judge_example(prompt, completion, answers[prompt]))
    return examples


def train_judge(out: Path, steps: tuple[int, int] = (2000, 1000), seed: int = 0) -> dict:
    """A judge trained from the warm-start on ``judge_training_rows`` (supervised, the
    demo warm-start's loop: ``steps[0]`` steps at lr 2e-3, then ``steps[1]`` at 5e-4 to
    settle), saved to ``out``; returns its agreement with exact match (``judge_agreement``)."""
    from loomrl.training.sft import supervised_warmstart

    rows = judge_training_rows(read_rows(ROOT / "examples/arithmetic/train.jsonl"), seed)
    for model, n, lr in ((WARMSTART, steps[0], 2e-3), (out, steps[1], 5e-4)):
        supervised_warmstart(
            str(model), rows, out, steps=n, batch_size=64, lr=lr, seed=seed, weight_decay=0.1
        )
    return judge_agreement(out)


def judge_scorer(path: Path) -> dict:
    """The ``[task.scorer]`` table of the arithmetic judge at ``path``."""
    from examples.arithmetic.judge import TEMPLATE

    return {
        "type": "judge",
        "path": str(path),
        "prompt_template": TEMPLATE,
        "parser": "examples.arithmetic.judge:verdict",
        "max_new_tokens": 5,
        "device": "cpu",
    }


def judge_agreement(judge: Path, seed: int = 1) -> dict:
    """How often the judge agrees with exact match on held-out eval prompts: their right
    answers, near misses of them, and the warm-start's samples (unparsed counts as wrong)."""
    from loomrl.scoring.config import JudgeScorerConfig
    from loomrl.scoring.judge import JudgeScorer

    rng = random.Random(seed)
    rows = read_rows(ROOT / "examples/arithmetic/eval.jsonl")
    answers = {r["prompt"]: r["answer"] for r in rows}
    scorer = JudgeScorer(JudgeScorerConfig.model_validate(judge_scorer(judge)))
    sampled = policy_samples(WARMSTART, rows * 4, 1.0, seed)
    kinds = {
        "right": [(r["prompt"], r["answer"]) for r in rows],
        "near_miss": [
            (r["prompt"], near_miss_of)
            for r in rows
            for near_miss_of in near_misses(r["answer"], rng, 2)
        ],
        "sampled_right": [(p, c) for p, c in sampled if c.strip() == answers[p]],
        "sampled_wrong": [(p, c) for p, c in sampled if c.strip() != answers[p]],
    }
    agree = {}
    for kind, pairs in kinds.items():
        values = [v for _, v, _ in scorer.score([(p, c, {}) for p, c in pairs])[0]]
        want = 1.0 if kind.endswith("right") else 0.0
        agree[kind] = sum(v == want for v in values) / max(len(pairs), 1)
    return agree


@pytest.fixture(scope="module")
def exact_match_reference(tmp_path_factory) -> tuple[float, float]:
    """The demo run scored by exact match, 300 steps: held-out accuracy at start and end."""
    if not (WARMSTART / "config.json").is_file():
        pytest.skip("needs the demo warm-start: python -m examples.arithmetic.warmstart")
    out = tmp_path_factory.mktemp("exact")
    start = demo_run(out / "run", EXACT_MATCH, RL_STEPS)["eval_start"]
    return start, exact_match_accuracy(out / "run" / "final", out / "eval")


RL_STEPS = 300


@pytest.mark.slow
@pytest.mark.heavy  # ~8-12 min on 2 cores: trains a judge (3000 steps), one RL run (+ the reference)
@pytest.mark.timeout(3600)
def test_a_trained_judge_teaches_the_demo_as_well_as_exact_match(tmp_path, exact_match_reference):
    """The issue's bar: the demo scored by a judge trained here reaches exact match's
    held-out accuracy band (within 5 points) from the same warm-start and seed."""
    judge = tmp_path / "judge"
    agree = train_judge(judge)
    assert min(agree.values()) >= 0.97, agree
    run = demo_run(tmp_path / "judge-run", {"scorer": judge_scorer(judge)}, RL_STEPS)
    assert run["steps"] == RL_STEPS and run["failed"] <= 0.01 * run["generated"], run
    start, end_exact = exact_match_reference
    end_judge = exact_match_accuracy(tmp_path / "judge-run" / "final", tmp_path / "eval-judge")
    assert end_exact > start + 0.3  # the reference is a real gain
    assert end_judge >= end_exact - 0.05, (start, end_exact, end_judge, agree)


@pytest.mark.slow
@pytest.mark.heavy  # ~6-15 min on 2 cores: trains a reward model (3000 steps), one RL run (+ the reference)
@pytest.mark.timeout(3600)
def test_a_trained_reward_model_teaches_the_demo(tmp_path, exact_match_reference):
    """Measured once (2 shared cores): the reward model caught 97% of right and 93% of wrong
    answers; 300 steps from 26.5% reached 82.5% held out with exact match and 59.5% with the
    reward model. So RL learns from the model, but short of exact match's band: the policy
    finds the answers the model misjudges (the judge above, which works the sum out before
    its verdict, reaches the band). What this asserts is what held."""
    rm = tmp_path / "rm"
    trained = train_exact_match_reward_model(rm)
    assert trained["right_scored_right"] >= 0.9 and trained["wrong_scored_wrong"] >= 0.9, trained
    scored = {"scorer": {"type": "model", "path": str(rm), "device": "cpu"}}
    by_model = demo_run(tmp_path / "rm-run", scored, RL_STEPS)
    assert by_model["steps"] == RL_STEPS and by_model["failed"] == 0
    start, end_exact = exact_match_reference
    end_model = exact_match_accuracy(tmp_path / "rm-run" / "final", tmp_path / "eval-rm")
    assert end_exact > start + 0.3  # the reference is a real gain
    assert end_model > start + 0.2, (start, end_exact, end_model)  # and the model teaches too
