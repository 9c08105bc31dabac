"""Supervised warm-start of the calculator's tiny chat model on a few tool-use traces.

Each trace is one whole episode: the question, the model's tool call, the tool's answer and
the model's final answer, rendered with the chat template; the loss is on the model's two
turns only. Like the arithmetic warm-start it stops early on purpose, once greedy episodes
on probe rows (training rows held out of its batches, run by loomrl's own chat-episode
driver and tool runner) answer ``--target-accuracy`` of them right: RL takes it from there.

    python -m examples.calculator.warmstart --out .cache/calculator-warmstart

The result is a normal Hugging Face folder (the template in its tokenizer) that
``examples/calculator/job.toml`` loads as ``model.path``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import time
from pathlib import Path
from typing import Any

from examples.calculator.env import Calculator
from examples.calculator.model import build, call_text

HERE = Path(__file__).parent
logger = logging.getLogger(__name__)


def trace_messages(row: dict[str, str]) -> list[dict[str, Any]]:
    a, b = (int(x) for x in row["prompt"].split("*"))
    return [
        {"role": "user", "content": row["prompt"]},
        {"role": "assistant", "content": call_text(a, b)},
        {"role": "tool", "name": "mul", "content": str(a * b)},
        {"role": "assistant", "content": row["answer"]},
    ]


def trace_ids(tok, schemas, row: dict[str, str]) -> tuple[list[int], list[int]]:
    """A trace's ids and its loss mask: 1 on each assistant turn, its EOS included."""
    from loomrl.envs.chat_render import ChatRenderer

    render = ChatRenderer(tok, schemas).ids
    messages = trace_messages(row)
    ids = render(messages, generation_prompt=False)
    mask = [0] * len(ids)
    for k, message in enumerate(messages):
        if message["role"] == "assistant":
            start = len(render(messages[:k], generation_prompt=True))
            end = ids.index(tok.eos_token_id, start) + 1
            mask[start:end] = [1] * (end - start)
    return ids, mask


class Batcher:
    """A ``generate`` for many single-episode groups at once: requests made in the same turn
    of the event loop go to the engine as one call."""

    def __init__(self, engine) -> None:
        self.engine, self.pending, self.scheduled = engine, [], False

    async def __call__(self, requests):
        future = asyncio.get_running_loop().create_future()
        self.pending.append((requests, future))
        if not self.scheduled:
            self.scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)
        return await future

    def _flush(self) -> None:
        batch, self.pending, self.scheduled = self.pending, [], False
        results = self.engine.generate([r for requests, _ in batch for r in requests])
        for requests, future in batch:
            future.set_result(results[: len(requests)])
            results = results[len(requests) :]


def episode_accuracy(model, tok, rows: list[dict[str, str]], max_new_tokens: int = 72) -> dict:
    """Greedy episodes on ``rows`` with loomrl's chat-episode driver: exact-match accuracy,
    the valid-call fraction, and episodes per second."""
    from loomrl.envs.chat_episode import ChatLimits, run_chat_episodes
    from loomrl.envs.episode_stats import EpisodeStats
    from loomrl.envs.tool_parsers import get_parser
    from loomrl.generation.hf import HFGenerator
    from loomrl.types import SamplingParams

    was_training = model.training
    generate, stats = Batcher(HFGenerator(model, tok)), EpisodeStats()
    limits = ChatLimits(parser=get_parser("hermes"), max_turns=3, max_episode_tokens=256)
    sampling = SamplingParams(max_new_tokens=max_new_tokens, greedy=True)

    async def all_rows():
        return await asyncio.gather(
            *(
                run_chat_episodes(
                    [Calculator()],
                    row,
                    i,
                    generate=generate,
                    tokenizer=tok,
                    sampling=sampling,
                    limits=limits,
                    seed=0,
                    stats=stats,
                )
                for i, row in enumerate(rows)
            )
        )

    t0 = time.perf_counter()
    episodes = [eps[0] for eps in asyncio.run(all_rows())]
    elapsed = time.perf_counter() - t0
    model.train(was_training)
    metrics = stats.metrics()
    return {
        "accuracy": sum(e.reward or 0.0 for e in episodes) / len(episodes),
        "valid_call_frac": metrics["episode/valid_call_frac"],
        "episodes_per_s": len(episodes) / elapsed,
    }


def train(args: argparse.Namespace) -> dict:
    import torch

    from loomrl.envs.chat import tool_schemas

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    rows = [json.loads(line) for line in (HERE / "train.jsonl").read_text().splitlines()]
    traces, probe = rows[: args.num_traces], rows[-args.probe_rows :]
    model, tok = build(args.seed)
    schemas = tool_schemas(Calculator.tools)
    data = [trace_ids(tok, schemas, row) for row in traces]
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    rng, reached = random.Random(args.seed), {}
    model.train()
    for step in range(args.steps):
        batch = rng.sample(data, args.batch_size)
        width = max(len(ids) for ids, _ in batch)
        ids = torch.tensor([i + [tok.pad_token_id] * (width - len(i)) for i, _ in batch])
        mask = torch.tensor([m + [0] * (width - len(m)) for _, m in batch], dtype=torch.float32)
        attn = (ids != tok.pad_token_id).long()
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        loss = -(logp * mask[:, 1:]).sum() / mask[:, 1:].sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if (step + 1) % args.check_every == 0:
            reached = {"step": step + 1, "loss": loss.item(), **episode_accuracy(model, tok, probe)}
            logger.info("warmstart %s", reached)
            if reached["accuracy"] >= args.target_accuracy:
                break
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out)
    tok.save_pretrained(args.out)
    return reached


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path(".cache/calculator-warmstart"))
    parser.add_argument("--seed", type=int, default=0)
    # 1,024: with 256 each trace is seen ~50 times and answers are recalled, not copied
    parser.add_argument(
        "--num-traces", type=int, default=1024, help="tool-use traces to learn from"
    )
    parser.add_argument("--steps", type=int, default=2000, help="the most steps")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=2e-3)
    # 40%: copying is learned in a jump; 20% can stop in its middle (docs/agents.md)
    parser.add_argument("--target-accuracy", type=float, default=0.4)
    parser.add_argument("--probe-rows", type=int, default=64)
    parser.add_argument("--check-every", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--force", action="store_true", help="rebuild even if present")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    settings = {k: str(v) for k, v in vars(args).items() if k not in ("out", "force")}
    marker = args.out / "warmstart.json"
    if not args.force and marker.is_file():
        recorded = json.loads(marker.read_text())
        if recorded.get("settings") == settings:
            print(f"warm-start model already at {args.out} (use --force to rebuild)")
            return
    reached = train(args)
    marker.write_text(json.dumps({"settings": settings, "reached": reached}, indent=2))
    print(f"warm-start model saved to {args.out}: {reached}")


if __name__ == "__main__":
    main()
