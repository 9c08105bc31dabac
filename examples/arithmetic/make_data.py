"""Writes the arithmetic task's data: ``train.jsonl`` and a held-out ``eval.jsonl``.

Rows are ``{"prompt": "07+45=", "answer": "52"}``; eval pairs never appear in training.
Operands are zero-padded to a fixed width: the digits to add then sit at fixed offsets,
which a tiny transformer learns far faster than variable-width operands (measured: 89%
vs 10% greedy accuracy after the same 900 supervised steps).
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
    return [{"prompt": f"{a:0{width}d}+{b:0{width}d}=", "answer": str(a + b)} for a, b in pairs]


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
