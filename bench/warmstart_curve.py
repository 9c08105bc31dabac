"""Held-out accuracy along the arithmetic warm-start, with zero-padded and unpadded answers.

The supervised warm-start of the demo stops early on purpose, so where it stops decides
what RL starts from. This trains the warm-start exactly as ``examples/arithmetic/warmstart.py``
does (same loop, data, batch size and learning rate) for each seed, instruction set
(``native``, or ``avx2`` for the kernels and floating-point order of a CPU without
AVX-512) and answer format (``padded``: the shipped data, ``"052"``; ``unpadded``: the same
rows with leading zeros stripped, ``"52"``, as the data was before), and prints the greedy
held-out accuracy and the units-digit accuracy every ``--every`` steps.

    python bench/warmstart_curve.py --steps 600 --every 50
    python bench/warmstart_curve.py --seeds 0 --isas avx2 --formats unpadded --steps 1500
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from learning import ISA_ENV  # bench/learning.py, beside this file

ROOT = Path(__file__).resolve().parents[1]


def _rows(name: str, fmt: str) -> list[dict]:
    rows = [
        json.loads(line) for line in (ROOT / "examples/arithmetic" / name).read_text().splitlines()
    ]
    return [dict(r, answer=str(int(r["answer"]))) for r in rows] if fmt == "unpadded" else rows


def curve(
    seed: int, fmt: str, steps: int, every: int, threads: int, holdout: int, recipe: dict
) -> list[dict]:
    """Runs in the child: the warm-start with an accuracy probe every ``every`` steps."""
    import torch

    from loomrl.training.sft import supervised_warmstart

    torch.set_num_threads(threads)
    evals = _rows("eval.jsonl", fmt)
    points = []

    def probe(step, model, tok, loss):
        if (step + 1) % every:
            return
        ids = torch.tensor([tok(r["prompt"]).input_ids for r in evals])
        model.eval()
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=4,
                do_sample=False,
                pad_token_id=tok.pad_token_id,
            )
        model.train()
        texts = [tok.decode(o[ids.shape[1] :], skip_special_tokens=True).strip() for o in out]
        points.append(
            {
                "step": step + 1,
                "loss": loss,
                "accuracy": sum(t == r["answer"] for t, r in zip(texts, evals)) / len(evals),
                "units": sum(t[-1:] == r["answer"][-1:] for t, r in zip(texts, evals)) / len(evals),
            }
        )

    rows = _rows("train.jsonl", fmt)
    # as the demo's warm-start, which holds out its probe rows
    rows = rows[:-holdout] if holdout else rows
    supervised_warmstart("tiny:llama", rows, None, steps=steps, seed=seed, on_step=probe, **recipe)
    return points


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--isas", default="native,avx2")
    parser.add_argument("--formats", default="padded,unpadded")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--warmup-steps", type=int, default=0)
    parser.add_argument(
        "--holdout",
        type=int,
        default=200,
        help="last training rows left out, as the demo's warm-start does for its probe",
    )
    parser.add_argument("--json", type=Path)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:  # seed,format: one curve, printed as JSON
        seed, fmt = args.child.split(",")
        recipe = {
            "lr": args.lr,
            "batch_size": args.batch_size,
            "weight_decay": args.weight_decay,
            "warmup_steps": args.warmup_steps,
        }
        print(
            json.dumps(
                curve(int(seed), fmt, args.steps, args.every, args.threads, args.holdout, recipe)
            )
        )
        return
    results = []
    for fmt in args.formats.split(","):
        for isa in args.isas.split(","):
            for seed in (int(s) for s in args.seeds.split(",")):
                cmd = [
                    sys.executable,
                    __file__,
                    "--child",
                    f"{seed},{fmt}",
                    "--steps",
                    str(args.steps),
                    "--every",
                    str(args.every),
                    "--threads",
                    str(args.threads),
                    "--lr",
                    str(args.lr),
                    "--batch-size",
                    str(args.batch_size),
                    "--weight-decay",
                    str(args.weight_decay),
                    "--warmup-steps",
                    str(args.warmup_steps),
                    "--holdout",
                    str(args.holdout),
                ]
                out = subprocess.run(
                    cmd,
                    cwd=ROOT,
                    env={**os.environ, **ISA_ENV[isa]},
                    check=True,
                    capture_output=True,
                    text=True,
                ).stdout
                results.append(
                    {
                        "format": fmt,
                        "isa": isa,
                        "seed": seed,
                        "points": json.loads(out.splitlines()[-1]),
                    }
                )
                print(
                    f"{fmt} {isa} seed {seed}: "
                    + " ".join(f"{p['step']}:{p['accuracy']:.0%}" for p in results[-1]["points"]),
                    flush=True,
                )
                if args.json:
                    args.json.write_text(json.dumps(results, indent=2))
    print_table(results)


def print_table(results: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    steps = [p["step"] for p in results[0]["points"]]
    table = Table(title="greedy held-out accuracy (units-digit accuracy) along the warm-start")
    for col in ("answers", "ISA", "seed", *map(str, steps)):
        table.add_column(col, justify="right")
    for r in results:
        table.add_row(
            r["format"],
            r["isa"],
            str(r["seed"]),
            *(f"{p['accuracy']:.0%} ({p['units']:.0%})" for p in r["points"]),
        )
    Console(width=200).print(table)


if __name__ == "__main__":
    main()
