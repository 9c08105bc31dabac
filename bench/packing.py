"""Padded against packed micro-batches (``trainer.packing``): train tokens/s and peak memory
of a step on rollouts whose lengths spread from 16 to 512 tokens.

The model is built from a config with random weights (Qwen2-shaped, small: hidden 256, 4
layers, 4 heads, vocabulary 8,192 by default; nothing is downloaded). Each configuration
runs in a fresh subprocess: a warm-up step, then ``--repeats`` measured steps; the table
prints the median step time, train tokens/s (the rollouts' real tokens, not padding) and
the process's peak RSS (``ru_maxrss``: weights, AdamW state and the step), with each
packed row's ratio against the padded one of the same run.

    python bench/packing.py                        # budgets 1024, 2048, 4096
    python bench/packing.py --rows 32 --budgets 2048 --repeats 5

Attention over a pack is one [tokens, tokens] block under a block-diagonal mask on the CPU
(SDPA), so a larger budget saves the padding's compute but pays attention over the whole
pack; the budgets show where that turns.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _model(args):
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 4,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def _groups(rows: int, vocab: int, seed: int):
    from loomrl.types import Group, Rollout

    rng = random.Random(seed)
    rollouts = []
    for i in range(rows):
        n = rng.randint(16, 512)
        prompt = [rng.randrange(1, vocab) for _ in range(8)]
        completion = [rng.randrange(1, vocab) for _ in range(n - 8)]
        rollouts.append(
            Rollout(i, prompt, completion, [-3.0] * (n - 8), [1] * (n - 8), 0, reward=float(i % 3))
        )
    return [Group.of_rollouts(g, 0, rollouts[g * 4 : (g + 1) * 4]) for g in range(rows // 4)]


def child(args) -> dict:
    """One configuration's steps, measured in this (fresh) process."""
    from loomrl.config import AlgorithmConfig, TrainerConfig
    from loomrl.training.trainer import Trainer

    budget = int(args.child)
    extra = {"packing": True, "packing_max_tokens": budget} if budget else {"shared_prefix": False}
    cfg = TrainerConfig(lr=1e-5, micro_batch_size=args.rows, trace=False, **extra)
    tok = type("Tok", (), {"pad_token_id": 0})()
    trainer = Trainer(_model(args), tok, AlgorithmConfig(group_size=4), cfg, 1.0)
    groups = _groups(args.rows, args.vocab, 0)
    trainer.train_step(groups)  # warm-up: gradients and AdamW state exist now
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        trainer.train_step(groups)
        times.append(time.perf_counter() - t0)
    lengths = [len(p) + len(c) for g in groups for p, c in zip(g.prompt_ids, g.completion_ids)]
    tokens, padded = sum(lengths), len(lengths) * max(lengths)  # one padded micro-batch
    step_s = statistics.median(times)
    return {
        "budget": budget,
        "tokens": tokens,
        "padded_tokens": padded,
        "step_s": step_s,
        "tokens_per_s": tokens / step_s,
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def _run(args, budget: int) -> dict:
    env = {
        **os.environ,
        "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }
    cmd = [sys.executable, __file__, "--child", str(budget), *args.passthrough]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"budget {budget}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=16, help="rollouts a step (groups of 4)")
    parser.add_argument("--budgets", default="1024,2048,4096", help="packing_max_tokens to try")
    parser.add_argument("--repeats", type=int, default=3, help="measured steps (median)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(child(args)))
        return
    args.passthrough = [
        f"--{k}={getattr(args, k)}" for k in ("rows", "repeats", "layers", "hidden", "vocab")
    ]
    rows = [_run(args, 0)] + [_run(args, int(b)) for b in args.budgets.split(",")]
    base = rows[0]
    print(
        f"\nQwen2-shaped, {args.layers} layers, hidden {args.hidden}, vocabulary {args.vocab}, fp32; "
        f"{args.rows} rollouts of 16-512 tokens: {base['tokens']} tokens, {base['padded_tokens']} "
        f"padded; median of {args.repeats} steps; threads {os.environ.get('OMP_NUM_THREADS', 'all')}\n"
    )
    print("| micro-batches | step s | train tokens/s | vs padded | peak RSS GiB | vs padded |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        name = f"packed, budget {r['budget']}" if r["budget"] else "padded"
        print(
            f"| {name} | {r['step_s']:.2f} | {r['tokens_per_s']:.0f} | "
            f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x | {r['peak_rss'] / 2**30:.2f} | "
            f"{r['peak_rss'] / base['peak_rss']:.2f}x |"
        )


if __name__ == "__main__":
    main()
