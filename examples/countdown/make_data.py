"""Write the countdown example's train/eval splits (deterministic; eval prompts held out).

python -m examples.countdown.make_data
"""

from __future__ import annotations

import json
from pathlib import Path

from loomrl.envs.tasks.countdown import make_rows

HERE = Path(__file__).parent


def main() -> None:
    rows = make_rows(1100, seed=0)
    eval_rows, train_rows = rows[:100], rows[100:]
    for name, rows in (("train", train_rows), ("eval", eval_rows)):
        with open(HERE / f"{name}.jsonl", "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
