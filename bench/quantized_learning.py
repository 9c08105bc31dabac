"""Does the arithmetic demo learn as well with an int8 generator, and what does the loss's
correction buy? The staleness ablation's method (bench/staleness_ablation.py) with the
generator's precision (``generation.engine.quantize``) as the axis.

For every warm-start seed in ``--warmstart-seeds``, every loss in ``--losses`` and every
precision in ``--precisions``, runs the demo job (``examples/arithmetic/job.toml``) from that
seed's warm-start model with the job's seed set to the same seed, at a fixed
``algorithm.max_staleness`` (``--max-staleness``, default 0: synchronous, so the precision
gap is the only gap between the generator's policy and the trainer's, and a cell's numbers
do not depend on the machine's load). ``pg`` (plain policy gradient, no importance weight)
is the no-correction baseline; ``aipo`` and ``tis`` weight each token by the ratio
``pi_theta / mu`` capped at ``algorithm.delta``.

Prints, per cell, the held-out accuracy at the start and the end, the cell's end accuracy
against the same loss and warm-start at ``none`` precision, and the importance-ratio metrics
the trainer logged (means over the run's steps): the ratio's mean and max, the share of
tokens past ``delta``, and the log-prob gap on tokens sampled at the trainer's own version
(the precision gap alone). Every cell is one run with the same step count; cells run one
after another, seed-major.

    python bench/quantized_learning.py --steps 300 --json docs/data/quantized_learning.json
    python bench/quantized_learning.py --warmstart 0=.cache/arithmetic-warmstart --steps 300
    python bench/quantized_learning.py --job-seeds 10,11 --losses aipo   # job-seed spread
    python bench/quantized_learning.py --max-staleness 2 --precisions none,int4   # both gaps
    python bench/quantized_learning.py --table docs/data/quantized_learning.json  # print only

The ``|dlogp| all`` and ``KL all`` columns are the gap on every token (staleness and
precision together: ``train/offpolicy_logprob_gap``, ``train/offpolicy_kl``), which puts a
precision's gap on the same scale as a staleness's.

A warm-start folder is built (``python -m examples.arithmetic.warmstart``) where missing.
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "examples/arithmetic/job.toml"
RATIO_METRICS = {
    "ratio_mean": "train/importance_ratio_mean",
    "ratio_max": "train/importance_ratio_max",
    "truncated_frac": "train/importance_ratio_truncated_frac",
    "mismatch": "train/logprob_mismatch_same_version",
    "offpolicy_gap": "train/offpolicy_logprob_gap",
    "offpolicy_kl": "train/offpolicy_kl",
}


def ensure_warmstart(seed: int, folder: Path) -> Path:
    """``folder``, warm-started with ``seed`` if it holds no model yet."""
    if not (folder / "config.json").is_file():
        cmd = [sys.executable, "-m", "examples.arithmetic.warmstart", "--out", str(folder)]
        subprocess.run([*cmd, "--seed", str(seed)], cwd=ROOT, check=True, capture_output=True)
    return folder


def run_cell(
    model: Path, seed: int, job_seed: int, loss: str, precision: str, args, out: Path
) -> dict:
    """One RL run; its accuracies, speed and the trainer's ratio metrics (run means)."""
    shutil.rmtree(out, ignore_errors=True)
    overrides = [
        f'model.path="{model}"',
        f"seed={job_seed}",
        f'algorithm.loss="{loss}"',
        f"algorithm.max_staleness={args.max_staleness}",
        f'generation.engine.quantize="{precision}"',
        f"trainer.num_steps={args.steps}",
        "eval.every_steps=100000",
        "checkpoint.every_steps=100000",
        *args.override,
    ]
    cmd = [
        sys.executable,
        "-m",
        "loomrl.cli",
        "run",
        str(JOB),
        *overrides,
        "--output-dir",
        str(out),
    ]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"run {out} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    summary = json.loads((out / "summary.json").read_text())
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    cell = {
        "warmstart_seed": seed,
        "job_seed": job_seed,
        "loss": loss,
        "precision": precision,
        "max_staleness": args.max_staleness,
        "steps": summary["steps"],
        "start": summary["eval_start"],
        "end": summary["eval_end"],
        "samples_per_s": summary["samples_per_s"],
        "wall_min": (time.perf_counter() - t0) / 60,
    }
    for name, key in RATIO_METRICS.items():
        values = [r[key] for r in records if key in r]
        cell[name] = (max if name == "ratio_max" else statistics.mean)(values) if values else None
    return cell


def _key(cell: dict) -> tuple:
    """A cell's (warm-start seed, job seed, loss, staleness, steps): what one precision row
    compares against."""
    job_seed = cell.get("job_seed", cell["warmstart_seed"])
    return (
        cell["warmstart_seed"],
        job_seed,
        cell["loss"],
        cell.get("max_staleness", 0),
        cell["steps"],
    )


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_table(cells: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    base = {_key(c): c["end"] for c in cells if c["precision"] == "none"}
    table = Table(title="held-out accuracy by precision and loss (same steps every cell)")
    cols = ("seed", "job seed", "loss", "precision", "staleness", "start", "end", "vs none")
    for col in (*cols, "ratio max", ">delta", "|dlogp| same version", "|dlogp| all", "KL all"):
        table.add_column(col, justify="right")
    for c in cells:
        ref = base.get(_key(c))
        table.add_row(
            str(c["warmstart_seed"]),
            str(c.get("job_seed", c["warmstart_seed"])),
            c["loss"],
            c["precision"],
            str(c.get("max_staleness", 0)),
            f"{c['start']:.1%}",
            f"{c['end']:.1%}",
            "-" if ref is None else f"{100 * (c['end'] - ref):+.1f} pts",
            _fmt(c["ratio_max"], ".3f"),
            _fmt(c["truncated_frac"], ".2e"),
            _fmt(c["mismatch"], ".4f"),
            _fmt(c.get("offpolicy_gap"), ".4f"),
            _fmt(c.get("offpolicy_kl"), ".5f"),
        )
    Console(width=160).print(table)


def parse_warmstarts(args) -> dict[int, Path]:
    """Each warm-start seed's folder: ``--warmstart SEED=PATH`` where given, else under --work."""
    given = {}
    for spec in args.warmstart:
        seed, sep, path = spec.partition("=")
        if not sep or not seed.isdigit():
            raise SystemExit(f"--warmstart {spec!r}: expected SEED=PATH, e.g. 0=.cache/arith")
        given[int(seed)] = Path(path)
    seeds = [int(s) for s in args.warmstart_seeds.split(",") if s]
    return {s: given.get(s, args.work / f"warmstart-s{s}") for s in seeds}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--precisions", default="none,int8", help="generation.engine.quantize values"
    )
    parser.add_argument("--losses", default="aipo,tis,pg")
    parser.add_argument("--warmstart-seeds", default="0,1", help="warm-start (and job) seeds")
    parser.add_argument(
        "--warmstart", action="append", default=[], help="SEED=PATH: an existing warm-start"
    )
    parser.add_argument(
        "--job-seeds", default="", help="job seeds (sampling, data order); '': the warm-start seed"
    )
    parser.add_argument("--max-staleness", type=int, default=0)
    parser.add_argument("--steps", type=int, default=300, help="trainer.num_steps of every cell")
    parser.add_argument("--override", action="append", default=[], help="extra dotted job override")
    parser.add_argument("--work", type=Path, default=ROOT / "runs/bench-quantized-learning")
    parser.add_argument("--json", type=Path, help="also write the cells as JSON here")
    parser.add_argument(
        "--table",
        type=Path,
        nargs="+",
        help="print the table of cells saved by --json; run nothing",
    )
    args = parser.parse_args()
    if args.table:
        print_table([cell for path in args.table for cell in json.loads(path.read_text())])
        return
    precisions = [p for p in args.precisions.split(",") if p]
    losses = [loss for loss in args.losses.split(",") if loss]
    args.work.mkdir(parents=True, exist_ok=True)
    cells = []
    for seed, folder in parse_warmstarts(args).items():
        model = ensure_warmstart(seed, folder)
        job_seeds = [int(s) for s in args.job_seeds.split(",") if s] or [seed]
        for job_seed, loss, precision in itertools.product(job_seeds, losses, precisions):
            name = f"s{seed}" if job_seed == seed else f"s{seed}-j{job_seed}"
            out = args.work / f"{name}-{loss}-{precision}"
            cells.append(run_cell(model, seed, job_seed, loss, precision, args, out))
            c = cells[-1]
            print(
                f"seed {seed} job seed {job_seed} {loss} {precision}: {c['start']:.1%} -> "
                f"{c['end']:.1%} ({c['wall_min']:.1f} min, ratio max {_fmt(c['ratio_max'], '.3f')})",
                flush=True,
            )
            if args.json:
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps(cells, indent=2))
    print_table(cells)


if __name__ == "__main__":
    main()
