"""Writes the arithmetic task's data: ``train.jsonl`` and a held-out ``eval.jsonl``.

Eval pairs never appear in training.
Operands and answers are zero-padded to a fixed width (``{"prompt": "07+45=", "answer":
"052"}``): every digit, to add or to write, then sits at a fixed offset. A tiny transformer
learns that far faster than variable-width numbers (operands: 89% vs 10% greedy accuracy
after the same 900 supervised steps). With unpadded answers the units digit moves with the
answer's length, and whether a 350-step warm-start had begun to learn it at all depended on
the seed and on the CPU's floating-point order; RL from a model that had not stayed flat
(see docs/benchmarks.md).
Run: ``python -m examples.arithmetic.make_data``. The files are shipped in the repo.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

HERE = Path(__file__).parent


def make_rows(max_operand: int, seed: int) -> list[dict[str, str]]:
    pairs = [(a, b) for a in range(max_operand) for b in range(max_operand)]
    random.Random(seed).shuffle(pairs)
    width = len(str(max_operand - 1))
    answer_width = len(str(2 * (max_operand - 1)))
    return [
        {"prompt": f"{a:0{width}d}+{b:0{width}d}=", "answer": f"{a + b:0{answer_width}d}"}
        for a, b in pairs
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--max-operand", type=int, default=100)
    parser.add_argument("--num-eval", type=int, default=200)
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()
    rows = make_rows(args.max_operand, args.seed)
    eval_rows, train_rows = rows[: args.num_eval], rows[args.num_eval :]
    for name, subset in (("train.jsonl", train_rows), ("eval.jsonl", eval_rows)):
        with (HERE / name).open("w") as f:
            for row in subset:
                f.write(json.dumps(row) + "\n")
    print(f"wrote {len(train_rows)} train and {len(eval_rows)} eval rows to {HERE}")


if __name__ == "__main__":
    main()
