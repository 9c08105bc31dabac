"""``loomrl warmstart JOB.toml``: the supervised step before RL, on the job's own model and
data: next-token loss on each training row's answer after its prompt, the prompt rendered
exactly as the RL run will render it (chat template, system prompt, one BOS).

RL learns from a policy that is right some of the time; a model that never is gets no
signal (every group has zero reward variance). A short supervised pass on worked answers
fixes that. The result is a ``save_pretrained`` folder to put in ``model.path``. For long
supervised training of a large model use a dedicated trainer (TRL's ``SFTTrainer``); this is
the short warm-start the examples use, as a command.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

from loomrl.data import DatasetError, load_rows
from loomrl.training.sft import supervised_warmstart

logger = logging.getLogger(__name__)


def add_warmstart_command(sub) -> None:
    parser = sub.add_parser(
        "warmstart",
        help="supervised warm-start of a job's model on its data's answers (before RL)",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument("job", help="the job's TOML file (its model, data and chat settings)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. data.train=x.jsonl")
    parser.add_argument("--out", required=True, type=Path, help="folder to save the model in")
    parser.add_argument("--answer-key", default="answer", help="column holding the target text")
    parser.add_argument("--steps", type=int, default=200, help="AdamW steps (default 200)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3, help="learning rate (default 1e-3)")
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=0)
    parser.set_defaults(fn=cmd_warmstart)


def cmd_warmstart(args: argparse.Namespace) -> int:
    # lazy: pydantic's config loads only when the command runs, not with the CLI's parser
    from loomrl.config import ConfigError, load_config

    try:
        cfg = load_config(args.job, list(args.overrides))
        result = warmstart_job(
            cfg,
            args.out,
            answer_key=args.answer_key,
            steps=args.steps,
            batch_size=args.batch_size,
            lr=args.lr,
            weight_decay=args.weight_decay,
            seed=args.seed,
        )
    except (ConfigError, DatasetError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(result))
    return 0


def _rendered_pairs(cfg, answer_key: str) -> list[dict[str, Any]]:
    """``{"prompt_ids", "answer"}`` per training row, the prompt rendered as the RL run will."""
    # lazy: the tokenizer and model stack load only when the command runs
    from loomrl.chat import PromptEncoder
    from loomrl.models import load_tokenizer

    rows = load_rows(
        cfg.data.train, cfg.data.prompt_key, cfg.data.train_split, cfg.data.dataset_config
    )
    missing = [n for n, row in enumerate(rows, 1) if answer_key not in row]
    if missing:
        raise ValueError(
            f"{cfg.data.train}: {len(missing)} rows have no {answer_key!r} column (first: row "
            f"{missing[0]}); name the target column with --answer-key"
        )
    encoder = PromptEncoder(load_tokenizer(cfg.model.path), cfg.data, cfg.model.path)
    return [
        {"prompt_ids": encoder.encode_one(row[cfg.data.prompt_key]), "answer": str(row[answer_key])}
        for row in rows
    ]


def warmstart_job(
    cfg,
    out: Path,
    *,
    answer_key: str = "answer",
    steps: int = 200,
    batch_size: int = 16,
    lr: float = 1e-3,
    weight_decay: float = 0.01,
    seed: int = 0,
) -> dict[str, Any]:
    """Warm-start ``cfg``'s model on ``cfg.data.train``'s ``answer_key`` column; save to
    ``out``; returns ``{"out", "steps", "first_loss", "last_loss", "seconds"}``."""
    pairs = _rendered_pairs(cfg, answer_key)
    losses: list[float] = []

    def record(step, model, tok, loss) -> bool:
        losses.append(loss)
        return False

    t0 = time.perf_counter()
    supervised_warmstart(
        cfg.model.path,
        pairs,
        out,
        steps=steps,
        batch_size=min(batch_size, len(pairs)),
        lr=lr,
        seed=seed,
        on_step=record,
        weight_decay=weight_decay,
    )
    return {
        "out": str(out),
        "steps": len(losses),
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "seconds": round(time.perf_counter() - t0, 1),
    }
