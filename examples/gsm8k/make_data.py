"""Write the GSM8K-format sample shipped in data/: grade-school word problems written for
this project (not GSM8K's text), each with a worked answer in GSM8K's form: steps with
``<<expression=value>>`` calculator notes and a final ``#### N`` line.

    python -m examples.gsm8k.make_data   # rewrites data/train.jsonl and data/test.jsonl

``datasets.load_dataset("examples/gsm8k/data", split="train")`` reads the folder; loomrl does
the same for ``data.train = "examples/gsm8k/data"`` (docs/data.md).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

NAMES = [
    "Ana",
    "Ben",
    "Chen",
    "Dara",
    "Eli",
    "Fatima",
    "Goran",
    "Hana",
    "Ivo",
    "Jun",
    "Kofi",
    "Lena",
]
ITEMS = [
    ("apples", "bag"),
    ("pencils", "box"),
    ("stickers", "sheet"),
    ("cookies", "tray"),
    ("marbles", "jar"),
    ("cards", "pack"),
    ("eggs", "carton"),
    ("stamps", "album"),
]


def _buy_and_give(rng: random.Random) -> dict:
    name, (item, unit) = rng.choice(NAMES), rng.choice(ITEMS)
    packs, per, given = rng.randint(2, 9), rng.randint(3, 12), rng.randint(1, 10)
    total = packs * per
    given = min(given, total - 1)
    left = total - given
    question = (
        f"{name} buys {packs} {unit}s of {item}. Each {unit} holds {per} {item}. "
        f"{name} gives {given} {item} to a friend. How many {item} does {name} have left?"
    )
    answer = (
        f"{name} buys {packs} * {per} = <<{packs}*{per}={total}>>{total} {item}.\n"
        f"After giving {given} away, {name} has {total} - {given} = <<{total}-{given}={left}>>{left} {item}.\n"
        f"#### {left}"
    )
    return {"question": question, "answer": answer}


def _earn_and_spend(rng: random.Random) -> dict:
    name = rng.choice(NAMES)
    hours, rate, spent = rng.randint(2, 8), rng.randint(5, 15), rng.randint(5, 30)
    earned = hours * rate
    spent = min(spent, earned)
    left = earned - spent
    question = (
        f"{name} works {hours} hours at ${rate} an hour, then spends ${spent} on lunch. "
        f"How many dollars does {name} have now?"
    )
    answer = (
        f"{name} earns {hours} * {rate} = <<{hours}*{rate}={earned}>>{earned} dollars.\n"
        f"After lunch {name} has {earned} - {spent} = <<{earned}-{spent}={left}>>{left} dollars.\n"
        f"#### {left}"
    )
    return {"question": question, "answer": answer}


def _share(rng: random.Random) -> dict:
    name, (item, _) = rng.choice(NAMES), rng.choice(ITEMS)
    friends, each, extra = rng.randint(2, 6), rng.randint(2, 9), rng.randint(1, 9)
    total = friends * each + extra
    question = (
        f"{name} has {total} {item} and shares them equally among {friends} friends, "
        f"keeping the {extra} that are left over. How many {item} does each friend get?"
    )
    answer = (
        f"{name} shares {total} - {extra} = <<{total}-{extra}={total - extra}>>{total - extra} {item}.\n"
        f"Each friend gets {total - extra} / {friends} = <<{total - extra}/{friends}={each}>>{each} {item}.\n"
        f"#### {each}"
    )
    return {"question": question, "answer": answer}


def _weeks(rng: random.Random) -> dict:
    name = rng.choice(NAMES)
    per_day, days, weeks = rng.randint(2, 9), rng.randint(2, 6), rng.randint(2, 4)
    week = per_day * days
    total = week * weeks
    question = (
        f"{name} reads {per_day} pages a day, {days} days a week. How many pages does "
        f"{name} read in {weeks} weeks?"
    )
    answer = (
        f"In a week {name} reads {per_day} * {days} = <<{per_day}*{days}={week}>>{week} pages.\n"
        f"In {weeks} weeks that is {week} * {weeks} = <<{week}*{weeks}={total}>>{total} pages.\n"
        f"#### {total}"
    )
    return {"question": question, "answer": answer}


KINDS = [_buy_and_give, _earn_and_spend, _share, _weeks]


def make(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [rng.choice(KINDS)(rng) for _ in range(n)]


def main() -> None:
    out = Path(__file__).parent / "data"
    out.mkdir(exist_ok=True)
    for split, n, seed in (("train", 256, 0), ("test", 48, 1)):
        rows = make(n, seed)
        (out / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(f"{out / split}.jsonl: {len(rows)} rows")


if __name__ == "__main__":
    main()
