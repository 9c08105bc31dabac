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

from loomrl.data import load_rows

logger = logging.getLogger(__name__)


def answer_batch(tok, rows: list[dict[str, Any]], answer_key: str = "answer"):
    """Token ids ``[batch, seq]`` of prompt + answer + EOS, right-padded; the mask covers
    the answer and EOS; and the attention mask."""
    # lazy: torch loads when this runs, not with the module
    import torch

    seqs, masks = [], []
    for row in rows:  # prompt ids already rendered (loomrl warmstart: the chat template), or text
        prompt = row["prompt_ids"] if "prompt_ids" in row else tok(row["prompt"]).input_ids
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
    model_spec: str,
    rows: list[dict[str, Any]],
    out: Path | None,
    *,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
    on_step: Callable[[int, Any, Any, float], bool | None] | None = None,
    weight_decay: float = 0.01,
    warmup_steps: int = 0,
) -> float:
    """Train up to ``steps`` AdamW steps on random batches of ``rows``; save to ``out``
    (unless None); returns the last loss. The learning rate rises linearly over
    ``warmup_steps``, then stays at ``lr``. ``on_step(step, model, tokenizer, loss)`` runs
    after each step; when it returns True, training stops there."""
    # lazy: torch loads when this runs, not with the module
    import torch

    from loomrl.models import load_model_and_tokenizer

    torch.manual_seed(seed)
    model, tok = load_model_and_tokenizer(model_spec, seed=seed)
    model.train()
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup_steps) if warmup_steps else 1.0
    )
    t0, loss = time.time(), torch.tensor(float("nan"))
    for step in range(steps):
        ids, mask, attn = answer_batch(tok, rng.sample(rows, batch_size))
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        loss = -(logp * mask[:, 1:]).sum() / mask[:, 1:].sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step % 50 == 0 or step == steps - 1:
            logger.info("warmstart step %4d loss %.3f (%.0fs)", step, loss.item(), time.time() - t0)
        if on_step is not None and on_step(step, model, tok, loss.item()):
            break
    if out is not None:
        model.save_pretrained(out)
        tok.save_pretrained(out)
    return loss.item()


def greedy_accuracy(model, tok, rows: list[dict[str, Any]], answer_key: str = "answer") -> float:
    """Fraction of ``rows`` whose greedy completion is exactly the row's answer."""
    # lazy: torch loads when this runs, not with the module
    import torch

    prompts = [tok(r["prompt"]).input_ids for r in rows]
    max_new = max(len(str(r[answer_key])) for r in rows) + 1
    correct = 0
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for length in sorted({len(p) for p in prompts}):  # equal lengths: no padding needed
            batch = [(p, r) for p, r in zip(prompts, rows) if len(p) == length]
            ids = torch.tensor([p for p, _ in batch])
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new,
                do_sample=False,
                pad_token_id=tok.pad_token_id,
            )
            texts = tok.batch_decode(out[:, length:], skip_special_tokens=True)
            correct += sum(t.strip() == str(r[answer_key]) for t, (_, r) in zip(texts, batch))
    model.train(was_training)
    return correct / len(rows)


class AccuracyTarget:
    """An ``on_step`` that stops the warm-start once greedy accuracy on ``probe_rows`` (held
    out of the warm-start's batches) reaches ``target``, checked every ``every`` steps;
    ``reached`` holds the last check's step and accuracy."""

    def __init__(self, probe_rows: list[dict[str, Any]], target: float, every: int) -> None:
        self.probe_rows, self.target, self.every = probe_rows, target, every
        self.reached: dict[str, float] = {}

    def __call__(self, step: int, model, tok, loss: float) -> bool:
        if (step + 1) % self.every:
            return False
        accuracy = greedy_accuracy(model, tok, self.probe_rows)
        logger.info("warmstart step %4d probe accuracy %.1f%%", step + 1, 100 * accuracy)
        self.reached = {"step": step + 1, "accuracy": accuracy}
        return accuracy >= self.target


def _warmstart_parser(
    description: str,
    default_out: str,
    default_steps: int,
    default_target_accuracy: float,
    default_weight_decay: float,
) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path(default_out))
    _add_stop_arguments(parser, default_steps, default_target_accuracy)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument(
        "--weight-decay", type=float, default=default_weight_decay, help="AdamW weight decay"
    )
    parser.add_argument("--warmup-steps", type=int, default=0, help="linear learning-rate warm-up")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default="tiny:llama")
    parser.add_argument(
        "--threads",
        type=int,
        default=2,
        help="torch threads; another count changes the floating-point order",
    )
    parser.add_argument("--force", action="store_true", help="rebuild even if present")
    return parser


def _add_stop_arguments(
    parser: argparse.ArgumentParser, default_steps: int, default_target_accuracy: float
) -> None:
    """When the warm-start stops: after ``--steps``, or once held-out accuracy is reached."""
    parser.add_argument(
        "--steps",
        type=int,
        default=default_steps,
        help="steps; with --target-accuracy, the most steps",
    )
    parser.add_argument(
        "--target-accuracy",
        type=float,
        default=default_target_accuracy,
        help="stop once greedy accuracy on held-out training rows reaches this (0: off)",
    )
    parser.add_argument(
        "--probe-rows",
        type=int,
        default=200,
        help="training rows held out of the warm-start to measure that accuracy",
    )
    parser.add_argument(
        "--check-every",
        type=int,
        default=5,
        help="steps between accuracy checks (the transition can pass 25%% -> 55%% in 25 steps)",
    )


def warmstart_main(
    *,
    train_file: Path,
    default_out: str,
    default_steps: int,
    description: str,
    default_target_accuracy: float = 0.0,
    default_weight_decay: float = 0.01,
    argv: list[str] | None = None,
) -> None:
    """Command line of an example's warm-start; rebuilds only when missing or when the
    settings or the training data changed (recorded in ``warmstart.json`` next to the
    weights)."""
    parser = _warmstart_parser(
        description, default_out, default_steps, default_target_accuracy, default_weight_decay
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    settings = {k: str(v) for k, v in vars(args).items() if k not in ("out", "force")}
    settings["train_sha256"] = hashlib.sha256(
        train_file.read_bytes()
    ).hexdigest()  # new data: rebuild
    marker = args.out / "warmstart.json"
    if not args.force and _recorded_settings(marker) == settings:
        print(f"warm-start model already at {args.out} (use --force to rebuild)")
        return
    on_step = _run_warmstart(args, train_file)
    if on_step is not None:
        settings["reached"] = on_step.reached
        _warn_if_short(on_step.reached, args)
    marker.write_text(json.dumps(settings, indent=2))
    print(
        f"warm-start model saved to {args.out}"
        + (
            f" (step {on_step.reached['step']}, {on_step.reached['accuracy']:.1%} on held-out training rows)"
            if on_step is not None and on_step.reached
            else ""
        )
    )


def _recorded_settings(marker: Path) -> dict[str, Any] | None:
    """The settings the weights at ``marker``'s folder were built with (without the
    accuracy they reached), or None if there are none."""
    recorded = json.loads(marker.read_text()) if marker.is_file() else None
    if recorded is not None:
        recorded.pop("reached", None)
    return recorded


def _run_warmstart(args: argparse.Namespace, train_file: Path) -> AccuracyTarget | None:
    """Train and save to ``args.out``; the accuracy target (holding out its probe rows)
    when one is set."""
    # lazy: torch loads when this runs, not with the module
    import torch

    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    rows, on_step = load_rows(train_file), None
    if args.target_accuracy > 0:
        rows, probe = rows[: -args.probe_rows], rows[-args.probe_rows :]
        on_step = AccuracyTarget(probe, args.target_accuracy, args.check_every)
    supervised_warmstart(
        args.model,
        rows,
        args.out,
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        seed=args.seed,
        on_step=on_step,
        weight_decay=args.weight_decay,
        warmup_steps=args.warmup_steps,
    )
    return on_step


def _warn_if_short(reached: dict[str, float], args: argparse.Namespace) -> None:
    if reached.get("accuracy", 0.0) < args.target_accuracy:
        logger.warning(
            "warm-start reached only %.1f%% of the %.1f%% target in %d steps; RL may have "
            "little signal",
            100 * reached.get("accuracy", 0.0),
            100 * args.target_accuracy,
            args.steps,
        )
