"""Supervised warm-start: a short next-token pass on (prompt, answer) pairs.

RL needs a policy that is right some of the time; a randomly initialised tiny model never
is. The examples warm-start with this, kept separate from RL and stopped early on purpose,
from the training split only. The result is a normal ``save_pretrained`` folder.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


def answer_batch(tok, rows: list[dict[str, Any]], answer_key: str = "answer"):
    """Token ids ``[batch, seq]`` of prompt + answer + EOS, right-padded; the mask covers
    the answer and EOS; and the attention mask."""
    import torch

    seqs, masks = [], []
    for row in rows:
        prompt = tok(row["prompt"]).input_ids
        answer = tok(str(row[answer_key]), add_special_tokens=False).input_ids + [tok.eos_token_id]
        seqs.append(prompt + answer)
        masks.append([0] * len(prompt) + [1] * len(answer))
    width = max(map(len, seqs))
    ids = torch.tensor([s + [tok.pad_token_id] * (width - len(s)) for s in seqs])
    mask = torch.tensor([m + [0] * (width - len(m)) for m in masks], dtype=torch.float32)
    lengths = torch.tensor([len(s) for s in seqs])
    attn = (torch.arange(width)[None, :] < lengths[:, None]).long()
    return ids, mask, attn


def supervised_warmstart(
    model_spec: str, rows: list[dict[str, Any]], out: Path | None, *, steps: int, batch_size: int,
    lr: float, seed: int, on_step: Callable[[int, Any, Any, float], None] | None = None,
) -> float:
    """Train ``steps`` AdamW steps on random batches of ``rows``; save to ``out`` (unless
    None); returns the last loss. ``on_step(step, model, tokenizer, loss)`` runs after each
    step (a bench measures accuracy there)."""
    import torch

    from loomrl.models import load_model_and_tokenizer

    torch.manual_seed(seed)
    model, tok = load_model_and_tokenizer(model_spec, seed=seed)
    model.train()
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    t0, loss = time.time(), torch.tensor(float("nan"))
    for step in range(steps):
        ids, mask, attn = answer_batch(tok, rng.sample(rows, batch_size))
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        loss = -(logp * mask[:, 1:]).sum() / mask[:, 1:].sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 50 == 0 or step == steps - 1:
            logger.info("warmstart step %4d loss %.3f (%.0fs)", step, loss.item(), time.time() - t0)
        if on_step is not None:
            on_step(step, model, tok, loss.item())
    if out is not None:
        model.save_pretrained(out)
        tok.save_pretrained(out)
    return loss.item()


def warmstart_main(
    *, train_file: Path, default_out: str, default_steps: int, description: str,
    argv: list[str] | None = None,
) -> None:
    """Command line of an example's warm-start; rebuilds only when missing or when the
    settings or the training data changed (recorded in ``warmstart.json`` next to the
    weights)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(default_out))
    parser.add_argument("--steps", type=int, default=default_steps)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default="tiny:llama")
    parser.add_argument("--threads", type=int, default=2,
                        help="torch threads; another count changes the floating-point order")
    parser.add_argument("--force", action="store_true", help="rebuild even if present")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    settings = {k: str(v) for k, v in vars(args).items() if k not in ("out", "force")}
    settings["train_sha256"] = hashlib.sha256(train_file.read_bytes()).hexdigest()  # new data: rebuild
    marker = args.out / "warmstart.json"
    if not args.force and marker.is_file() and json.loads(marker.read_text()) == settings:
        print(f"warm-start model already at {args.out} (use --force to rebuild)")
        return
    import torch

    from loomrl.data import load_rows

    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    supervised_warmstart(args.model, load_rows(train_file), args.out, steps=args.steps,
                         batch_size=args.batch_size, lr=args.lr, seed=args.seed)
    marker.write_text(json.dumps(settings, indent=2))
    print(f"warm-start model saved to {args.out}")
