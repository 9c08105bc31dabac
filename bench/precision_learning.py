"""Does the arithmetic demo learn as well under 'auto' precision (bf16 on a CPU with native
bf16) as in fp32?

For each warm-start seed this warm-starts the tiny model (fp32, as always), then runs the
demo job (``examples/arithmetic/job.toml``) from it at each ``max_staleness`` in
``--staleness``, once with the precisions at 'auto' (``model.dtype``, ``trainer.precision``:
what the run resolved them to is in the table) and once pinned to fp32, interleaved. Per
run: held-out accuracy at the start and the end of RL, the same-version log-prob mismatch
(``train/logprob_mismatch_same_version``, mean and max over steps, against its warning
threshold), AIPO's mean importance ratio, and samples/s. A seed's fp32 band is the range
of its fp32 runs' final accuracy over the staleness values (the warm-start seed moves
accuracy far more than anything else); each 'auto' run is checked against its seed's band.

    OMP_NUM_THREADS=1 python bench/precision_learning.py --seeds 0,1 --staleness 1,4 --steps 300
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

from learning import run_rl, warmstart  # bench/ is the script's folder

ROOT = Path(__file__).resolve().parents[1]
PRECISIONS = {
    "auto": ['model.dtype="auto"', 'trainer.precision="auto"'],
    "fp32": ['model.dtype="float32"', 'trainer.precision="fp32"'],
}


def step_stats(run_dir: Path) -> dict[str, float]:
    from loomrl.telemetry.metrics import read_metrics

    steps = [r for r in read_metrics(run_dir) if "train/loss" in r]
    gap = [
        r["train/logprob_mismatch_same_version"]
        for r in steps
        if "train/logprob_mismatch_same_version" in r
    ]
    ratio = [r["train/importance_ratio_mean"] for r in steps if "train/importance_ratio_mean" in r]
    return {
        "mismatch_mean": statistics.fmean(gap) if gap else float("nan"),
        "mismatch_max": max(gap) if gap else float("nan"),
        "ratio_mean": statistics.fmean(ratio) if ratio else float("nan"),
        "warnings": steps[-1].get("train/logprob_mismatch_warnings", 0.0) if steps else 0.0,
    }


def run_cell(model: Path, seed: int, staleness: int, precision: str, args) -> dict:
    out = args.work / f"rl-s{seed}-st{staleness}-{precision}"
    ns = argparse.Namespace(
        runtime="local", override=[*PRECISIONS[precision], *args.override], steps=args.steps
    )
    summary = run_rl(model, seed, staleness, dict(os.environ), out, ns)
    return {
        "seed": seed,
        "staleness": staleness,
        "precision": precision,
        "resolved": f"{summary['precision']['generator_dtype']}/{summary['precision']['trainer_precision']}",
        "start": summary["eval_start"],
        "end": summary["eval_end"],
        "samples_per_s": summary["samples_per_s"],
        **step_stats(out),
    }


def print_table(cells: list[dict], threshold: float) -> None:
    from rich.console import Console
    from rich.table import Table

    bands = {}
    for c in cells:
        if c["precision"] == "fp32":
            lo, hi = bands.get(c["seed"], (c["end"], c["end"]))
            bands[c["seed"]] = (min(lo, c["end"]), max(hi, c["end"]))
    table = Table(title="arithmetic demo: 'auto' precision against fp32 (held-out accuracy)")
    for col in (
        "seed",
        "staleness",
        "precision",
        "computes in",
        "start",
        "end",
        "in fp32 band",
        "mismatch mean",
        "mismatch max",
        "warnings",
        "ratio mean",
        "samples/s",
    ):
        table.add_column(col, justify="right")
    for c in cells:
        lo, hi = bands[c["seed"]]
        band = "" if c["precision"] == "fp32" else ("yes" if lo <= c["end"] <= hi else "NO")
        table.add_row(
            str(c["seed"]),
            str(c["staleness"]),
            c["precision"],
            c["resolved"],
            f"{100 * c['start']:.1f}%",
            f"{100 * c['end']:.1f}%",
            band,
            f"{c['mismatch_mean']:.4f}",
            f"{c['mismatch_max']:.4f}",
            f"{c['warnings']:.0f}",
            f"{c['ratio_mean']:.4f}",
            f"{c['samples_per_s']:.0f}",
        )
    console = Console()
    console.print(table)
    console.print(
        "fp32 band (final accuracy) by seed: "
        + ", ".join(f"{s}: {100 * lo:.1f}%-{100 * hi:.1f}%" for s, (lo, hi) in bands.items())
        + "; mismatch warning above "
        f"{threshold} nats (logging.logprob_mismatch_warning)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", default="0,1", help="warm-start (and job) seeds")
    parser.add_argument("--staleness", default="1,4", help="algorithm.max_staleness values")
    parser.add_argument("--steps", type=int, default=300, help="trainer.num_steps")
    parser.add_argument("--override", action="append", default=[], help="extra dotted job override")
    parser.add_argument("--work", type=Path, default=ROOT / "runs/bench-precision-learning")
    parser.add_argument("--json", type=Path, help="also write the cells as JSON here")
    args = parser.parse_args()
    from loomrl.config_common import LoggingConfig

    args.work.mkdir(parents=True, exist_ok=True)
    cells = []
    for seed in [int(s) for s in args.seeds.split(",") if s]:
        model = args.work / f"warmstart-s{seed}"
        warmstart(seed, 1, dict(os.environ), model, [])
        for staleness in [int(s) for s in args.staleness.split(",") if s]:
            for precision in PRECISIONS:
                cells.append(run_cell(model, seed, staleness, precision, args))
                c = cells[-1]
                print(
                    f"seed {seed} staleness {staleness} {precision} ({c['resolved']}): "
                    f"{100 * c['start']:.1f}% -> {100 * c['end']:.1f}%",
                    flush=True,
                )
                if args.json:
                    args.json.write_text(json.dumps(cells, indent=2))
    print_table(cells, LoggingConfig().logprob_mismatch_warning)


if __name__ == "__main__":
    sys.exit(main())
