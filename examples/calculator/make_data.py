"""Writes the calculator task's data: ``train.jsonl`` and a held-out ``eval.jsonl`` of
3-digit by 3-digit products (``{"prompt": "123*456", "answer": "56088"}``); no pair of the
held-out set is in the training set. Run: ``python -m examples.calculator.make_data``. The
files are shipped in the repo."""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

HERE = Path(__file__).parent


def make_rows(count: int, seed: int) -> list[dict[str, str]]:
    rng = random.Random(seed)
    pairs: dict[tuple[int, int], None] = {}
    while len(pairs) < count:
        pairs[(rng.randrange(100, 1000), rng.randrange(100, 1000))] = None
    return [{"prompt": f"{a}*{b}", "answer": str(a * b)} for a, b in pairs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-train", type=int, default=4000)
    parser.add_argument("--num-eval", type=int, default=200)
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()
    rows = make_rows(args.num_train + args.num_eval, args.seed)
    for name, part in (("train", rows[: args.num_train]), ("eval", rows[args.num_train :])):
        (HERE / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))


if __name__ == "__main__":
    main()
