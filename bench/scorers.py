"""Model-scorer benchmark: scores per second of a reward-model scorer executor.

    PYTHONPATH=src:. .venv/bin/python bench/scorers.py [--items 512] [--rounds 3] [--hidden 128]

A tiny reward model (``Qwen2ForSequenceClassification``, built here and saved to a temporary
folder) scores arithmetic (prompt, completion) pairs in scorer executors on the ``process``
runtime, through the controller's ``Scorer`` (calls of ``--call-items`` items, all in flight
at once, each sent to the least busy executor), as a job scores. Rows: 1 and 2 executors, and
a token budget (``max_tokens_per_batch``) that fits 1, 8 or 64 rows per forward. Prints a
table of scores/s with the ratio against the first row. Quick by default (< 2 min on 2 cores).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def save_reward_model(folder: Path, hidden: int, layers: int) -> str:
    import torch
    from transformers import AutoModelForSequenceClassification, Qwen2Config
    from transformers.utils import logging as hf_logging

    from loomrl.models.tiny import build_char_tokenizer

    hf_logging.disable_progress_bar()
    tok = build_char_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
        num_labels=1,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


def items(n: int) -> list[tuple[str, str, dict]]:
    rows = [
        json.loads(line)
        for line in (ROOT / "examples/arithmetic/train.jsonl").read_text().splitlines()
    ]
    return [
        (r["prompt"], f" {r['answer']}. Add the ones, carry the ten, then add the tens.", {})
        for r in (rows * (n // len(rows) + 1))[:n]
    ]


async def scores_per_s(
    task, num_executors: int, pairs: list, call_items: int, rounds: int
) -> float:
    from loomrl.runtime.process import ProcessRuntime
    from loomrl.runtime.supervision import FaultStats, Supervised
    from loomrl.scoring.base import ScorerEndpoints
    from loomrl.scoring.client import Scorer
    from loomrl.scoring.executor import start_scorer_executor
    from loomrl.types import Group, Rollout

    runtime = ProcessRuntime(torch_threads=1)
    try:
        handles = [
            runtime.start(f"scorer{i}", partial(start_scorer_executor, task, None), ScorerEndpoints)
            for i in range(num_executors)
        ]
        await runtime.wait_ready()
        scorer = Scorer(task)
        scorer.attach(
            [Supervised(None, h, deadlines=None, stats=FaultStats()) for h in handles], FaultStats()
        )
        # Each pair a group of one (its prompt is its own), as evaluation scores them.
        groups = [
            Group.of_rollouts(
                i, 0, [Rollout(i, [], [], [], [], 0, prompt=p, completion=c, row=row)]
            )
            for i, (p, c, row) in enumerate(pairs)
        ]
        calls = [groups[i : i + call_items] for i in range(0, len(groups), call_items)]

        async def one_round() -> None:
            await asyncio.gather(*(scorer.score_groups(call) for call in calls))
            assert all(g.all_ok for g in groups), [
                e for g in groups for e in g.errors or () if e is not None
            ][:1]

        await one_round()  # warm-up: the first forwards of each shape
        t0 = time.perf_counter()
        for _ in range(rounds):
            await one_round()
        return rounds * len(groups) / (time.perf_counter() - t0)
    finally:
        runtime.shutdown()


def main(args) -> None:
    from loomrl.config import TaskConfig
    from loomrl.scoring.model import load_reward_model, reward_model_text

    pairs = items(args.items)
    with tempfile.TemporaryDirectory() as tmp:
        path = save_reward_model(Path(tmp) / "rm", args.hidden, args.layers)
        _, tok = load_reward_model(path)
        longest = max(len(tok(reward_model_text(tok, p, c)[0]).input_ids) for p, c, _ in pairs)
        rows = []
        for num_executors, batch in [(1, 1), (1, 8), (1, 64), (2, 1), (2, 8), (2, 64)]:
            task = TaskConfig(
                scorer={
                    "type": "model",
                    "path": path,
                    "device": "cpu",
                    "max_tokens_per_batch": batch * longest,
                }
            )
            rate = asyncio.run(
                scores_per_s(task, num_executors, pairs, args.call_items, args.rounds)
            )
            rows.append((num_executors, batch, batch * longest, rate))
            print(
                f"  {num_executors} executor(s), {batch:>2} rows a forward: {rate:8.0f} scores/s",
                flush=True,
            )
    print(
        f"\nreward model: Qwen2 hidden {args.hidden}, {args.layers} layers; {args.items} pairs of <= {longest} "
        f"tokens a round, calls of {args.call_items}, {args.rounds} rounds\n"
    )
    print("| scorer executors | rows a forward | max_tokens_per_batch | scores/s | vs first row |")
    print("|---:|---:|---:|---:|---:|")
    for num_executors, batch, budget, rate in rows:
        print(f"| {num_executors} | {batch} | {budget} | {rate:.0f} | {rate / rows[0][3]:.2f}x |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=512, help="pairs scored per round")
    parser.add_argument(
        "--rounds", type=int, default=3, help="timed rounds (after one warm-up round)"
    )
    parser.add_argument("--call-items", type=int, default=64, help="pairs per Scorer.score call")
    parser.add_argument("--hidden", type=int, default=128, help="reward model hidden size")
    parser.add_argument("--layers", type=int, default=4, help="reward model layers")
    main(parser.parse_args())
