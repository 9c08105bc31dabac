"""Chat episodes with tools vs text episodes: what the token-exact driver costs, in one run.

Both drive the same groups of calculator episodes (a tool call, the tool's answer, the final
answer: two turns) against a scripted generator that answers at once, so the table shows the
drivers' own cost: the chat driver renders the conversation through the chat template twice
a turn, parses tool calls and runs the tool; the text driver (the baseline) encodes a text
observation. Episodes/s are medians over ``--repeats``, interleaved.

    python bench/chat_episodes.py --groups 20 --group-size 8 --repeats 3
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from examples.calculator.env import Calculator  # noqa: E402
from examples.calculator.model import CHAT_TEMPLATE, call_text  # noqa: E402
from loomrl.envs.base import Environment, StepResult  # noqa: E402
from loomrl.envs.chat_episode import ChatLimits, run_chat_episodes  # noqa: E402
from loomrl.envs.episode import run_group_episodes  # noqa: E402
from loomrl.envs.tool_parsers import get_parser  # noqa: E402
from loomrl.models import build_char_tokenizer  # noqa: E402
from loomrl.types import GenerationResult, SamplingParams  # noqa: E402

ROW = {"prompt": "123*456", "answer": "56088"}


class TextCalculator(Environment):
    """The same two turns as text: the 'tool's answer' is a text observation."""

    def reset(self, row):
        self.turn = 0
        return f"Q:{row['prompt']}\nA:"

    def step(self, completion):
        self.turn += 1
        if self.turn == 1:
            return StepResult(observation="\nR:56088\nA:", reward=0.0, done=False)
        return StepResult(observation="", reward=float(completion.strip() == "56088"), done=True)


def scripted(tok):
    turns = [
        tok(call_text(123, 456), add_special_tokens=False).input_ids,
        tok("56088").input_ids[1:],
    ]

    async def generate(requests):
        turn = 0 if len(requests[0].prompt_ids) < 40 else 1
        ids = turns[turn] + [tok.eos_token_id]
        return [GenerationResult([ids], [[-0.1] * len(ids)], ["stop"], None, 0) for _ in requests]

    return generate


def run(kind: str, groups: int, group_size: int, tok) -> float:
    generate, sampling = scripted(tok), SamplingParams(max_new_tokens=80)
    limits = ChatLimits(parser=get_parser("hermes"), max_turns=3, max_episode_tokens=256)

    async def all_groups():
        for g in range(groups):
            if kind == "chat":
                rollouts = await run_chat_episodes(
                    [Calculator() for _ in range(group_size)],
                    ROW,
                    g,
                    generate=generate,
                    tokenizer=tok,
                    sampling=sampling,
                    limits=limits,
                    seed=g,
                )
            else:
                rollouts = await run_group_episodes(
                    [TextCalculator() for _ in range(group_size)],
                    ROW,
                    g,
                    generate=generate,
                    encode=lambda t: tok(t).input_ids,
                    decode=lambda ids: tok.decode(ids, skip_special_tokens=True),
                    sampling=sampling,
                    max_turns=3,
                    seed=g,
                )
            assert all(r.reward == 1.0 for r in rollouts), rollouts[0]

    t0 = time.perf_counter()
    asyncio.run(all_groups())
    return groups * group_size / (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=20)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    tok = build_char_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    rates: dict[str, list[float]] = {"text": [], "chat": []}
    for _ in range(args.repeats):
        for kind in rates:
            rates[kind].append(run(kind, args.groups, args.group_size, tok))
    base = statistics.median(rates["text"])
    print(f"{'driver':<28}{'episodes/s':>12}{'vs text':>10}")
    for kind, label in (
        ("text", "text episodes (baseline)"),
        ("chat", "chat episodes with a tool"),
    ):
        median = statistics.median(rates[kind])
        print(f"{label:<28}{median:>12.1f}{median / base:>10.2f}")


if __name__ == "__main__":
    main()
