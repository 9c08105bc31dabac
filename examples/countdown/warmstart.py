"""Supervised warm-start of the tiny model for the countdown example (separate from RL).

A randomly initialised character-level model never writes a well-formed expression, so RL
would see no signal. This trains it briefly on (prompt, one reference answer) pairs from
the training split only, and stops early on purpose: the model learns the format and is
right some of the time; RL (with the sandbox scoring answers) takes it from there.

    python -m examples.countdown.warmstart --out .cache/countdown-warmstart
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

HERE = Path(__file__).parent


def _batch(tok, rows):
    import torch

    seqs, masks = [], []
    for row in rows:
        prompt = tok(row["prompt"]).input_ids
        answer = tok(row["answer"], add_special_tokens=False).input_ids + [tok.eos_token_id]
        seqs.append(prompt + answer)
        masks.append([0] * len(prompt) + [1] * len(answer))
    width = max(map(len, seqs))
    ids = torch.tensor([s + [tok.pad_token_id] * (width - len(s)) for s in seqs])
    mask = torch.tensor([m + [0] * (width - len(m)) for m in masks], dtype=torch.float32)
    lengths = torch.tensor([len(s) for s in seqs])
    attn = (torch.arange(width)[None, :] < lengths[:, None]).long()
    return ids, mask, attn


def train(out: Path, steps: int, batch_size: int, lr: float, seed: int, model_spec: str) -> None:
    import torch

    from loomrl.data import load_rows
    from loomrl.models import load_model_and_tokenizer

    torch.manual_seed(seed)
    model, tok = load_model_and_tokenizer(model_spec, seed=seed)
    model.train()
    rows = load_rows(HERE / "train.jsonl")
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    t0 = time.time()
    for step in range(steps):
        ids, mask, attn = _batch(tok, rng.sample(rows, batch_size))
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        loss = -(logp * mask[:, 1:]).sum() / mask[:, 1:].sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 50 == 0 or step == steps - 1:
            print(
                f"warmstart step {step:4d} loss {loss.item():.3f} ({time.time() - t0:.0f}s)",
                flush=True,
            )
    model.save_pretrained(out)
    tok.save_pretrained(out)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path(".cache/countdown-warmstart"))
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default="tiny:llama")
    parser.add_argument("--force", action="store_true", help="rebuild even if present")
    args = parser.parse_args()
    settings = {k: str(v) for k, v in vars(args).items() if k not in ("out", "force")}
    marker = args.out / "warmstart.json"
    if not args.force and marker.is_file() and json.loads(marker.read_text()) == settings:
        print(f"warm-start model already at {args.out} (use --force to rebuild)")
        return
    import torch

    torch.set_num_threads(2)
    args.out.mkdir(parents=True, exist_ok=True)
    train(args.out, args.steps, args.batch_size, args.lr, args.seed, args.model)
    marker.write_text(json.dumps(settings, indent=2))
    print(f"warm-start model saved to {args.out}")


if __name__ == "__main__":
    main()
