"""The supervised warm-start stops where its accuracy target says, and records where."""

from __future__ import annotations

import json

import torch

from loomrl.training.sft import (
    AccuracyTarget,
    greedy_accuracy,
    supervised_warmstart,
    warmstart_main,
)

from conftest import ROOT, TINY_MODEL

ROWS = [
    json.loads(line)
    for line in (ROOT / "examples/arithmetic/train.jsonl").read_text().splitlines()[:64]
]


def test_the_warmstart_stops_at_the_first_check_that_reaches_the_target():
    reached_now = AccuracyTarget(ROWS[:8], target=0.0, every=3)
    supervised_warmstart(
        TINY_MODEL, ROWS, None, steps=10, batch_size=4, lr=1e-3, seed=0, on_step=reached_now
    )
    assert reached_now.reached["step"] == 3  # 0% >= 0%: stopped at the first check
    never = AccuracyTarget(ROWS[:8], target=1.01, every=3)
    supervised_warmstart(
        TINY_MODEL, ROWS, None, steps=10, batch_size=4, lr=1e-3, seed=0, on_step=never
    )
    assert never.reached["step"] == 9  # the last check before the step budget ran out


class AlwaysWrites52(torch.nn.Module):
    """A stand-in model whose greedy completion of any prompt is '52' then EOS."""

    def __init__(self, tok) -> None:
        super().__init__()
        self.tail = tok("52", add_special_tokens=False).input_ids + [tok.eos_token_id]

    def generate(self, input_ids, max_new_tokens, **kwargs):
        tail = torch.tensor(self.tail[:max_new_tokens]).expand(input_ids.shape[0], -1)
        return torch.cat([input_ids, tail], dim=1)


def test_greedy_accuracy_counts_exact_answers():
    from loomrl.models.tiny import build_char_tokenizer

    tok = build_char_tokenizer()
    model = AlwaysWrites52(tok).train()
    rows = [
        {"prompt": "07+45=", "answer": "52"},
        {"prompt": "7+45=", "answer": "52"},
        {"prompt": "08+45=", "answer": "53"},
        {"prompt": "10+42=", "answer": "052"},
    ]
    assert greedy_accuracy(model, tok, rows) == 0.5  # prompts of two lengths; '052' != '52'
    assert model.training  # left as it was found


def test_the_marker_records_where_the_target_was_reached(tmp_path):
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    out = tmp_path / "ws"
    warmstart_main(
        train_file=train,
        default_out=str(out),
        default_steps=6,
        description="",
        argv=[
            "--model",
            TINY_MODEL,
            "--batch-size",
            "4",
            "--target-accuracy",
            "1.0",
            "--probe-rows",
            "8",
            "--check-every",
            "2",
            "--threads",
            "1",
        ],
    )
    marker = json.loads((out / "warmstart.json").read_text())
    assert marker["reached"]["step"] == 6 and marker["target_accuracy"] == "1.0"
    assert len(marker["train_sha256"]) == 64
    assert (out / "config.json").is_file()
