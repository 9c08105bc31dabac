"""Does an off-policy correction keep accuracy at high staleness, and what happens without one?

Runs the arithmetic demo job from one warm-start model for every ``max_staleness`` in
``--staleness`` and every policy loss in ``--losses`` (``pg`` is plain policy gradient with
no importance weight: the "no correction" baseline), for each job seed in ``--seeds``. The
trainer is the slower executor in this job, so the generator runs ahead until the gate
stops it and rollouts are trained close to ``max_staleness`` versions old (the table shows
the staleness actually measured). Prints, per cell, the final held-out accuracy (mean and
spread over seeds), samples/s and mean staleness, with each cell's accuracy against the
synchronous run of the same loss (``max_staleness = 0``, measured in the same run), and
writes one plot: accuracy against staleness, one line per loss.

    python bench/staleness_ablation.py                        # the full grid: 5 x 4 x 3 runs
    python bench/staleness_ablation.py --staleness 0,4 --losses pg,aipo --seeds 0 --steps 300

Cells run interleaved (seed-major), so the noise of a shared machine hits every cell alike.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "examples/arithmetic/job.toml"


def run_cell(model: Path, loss: str, staleness: int, seed: int, args, out: Path) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    overrides = [
        f'model.path="{model}"',
        f'algorithm.loss="{loss}"',
        f"algorithm.max_staleness={staleness}",
        f"seed={seed}",
        "eval.every_steps=100000",
        "checkpoint.every_steps=100000",
        *args.override,
    ]
    if args.steps:
        overrides.append(f"trainer.num_steps={args.steps}")
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
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"run {out} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    summary = json.loads((out / "summary.json").read_text())
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    stale = [r["rollout/staleness_mean"] for r in records if "rollout/staleness_mean" in r]
    return {
        "loss": loss,
        "max_staleness": staleness,
        "seed": seed,
        "start": summary["eval_start"],
        "end": summary["eval_end"],
        "samples_per_s": summary["samples_per_s"],
        "staleness_mean": statistics.mean(stale) if stale else 0.0,
    }


def summarise(cells: list[dict]) -> dict[tuple[str, int], dict[str, float]]:
    by_cell: dict[tuple[str, int], list[dict]] = {}
    for c in cells:
        by_cell.setdefault((c["loss"], c["max_staleness"]), []).append(c)
    out = {}
    for key, runs in by_cell.items():
        ends = [r["end"] for r in runs]
        out[key] = {
            "acc_mean": statistics.mean(ends),
            "acc_min": min(ends),
            "acc_max": max(ends),
            "samples_per_s": statistics.median(r["samples_per_s"] for r in runs),
            "staleness": statistics.mean(r["staleness_mean"] for r in runs),
            "n": len(runs),
        }
    return out


def print_table(stats: dict, losses: list[str], staleness: list[int], start: float) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"final held-out accuracy by loss and max_staleness (start {100 * start:.1f}%)"
    )
    for col in (
        "loss",
        "max_staleness",
        "staleness (measured)",
        "accuracy mean",
        "min..max",
        "vs sync",
        "samples/s",
        "seeds",
    ):
        table.add_column(col, justify="right")
    for loss in losses:
        sync = stats.get((loss, 0))
        for s in staleness:
            st = stats.get((loss, s))
            if st is None:
                continue
            ratio = f"{100 * (st['acc_mean'] - sync['acc_mean']):+.1f} pts" if sync else "-"
            table.add_row(
                loss,
                str(s),
                f"{st['staleness']:.2f}",
                f"{st['acc_mean']:.1%}",
                f"{st['acc_min']:.1%}..{st['acc_max']:.1%}",
                ratio,
                f"{st['samples_per_s']:.0f}",
                str(st["n"]),
            )
    Console(width=120).print(table)


def plot(stats: dict, losses: list[str], staleness: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for loss in losses:
        xs = [s for s in staleness if (loss, s) in stats]
        mean = [stats[(loss, s)]["acc_mean"] for s in xs]
        low = [stats[(loss, s)]["acc_min"] for s in xs]
        high = [stats[(loss, s)]["acc_max"] for s in xs]
        ax.plot(xs, mean, marker="o", label=loss)
        ax.fill_between(xs, low, high, alpha=0.15)
    ax.set_xlabel("max_staleness (versions)")
    ax.set_ylabel("final held-out accuracy")
    ax.set_xticks(staleness)
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(title="loss")
    ax.set_title("arithmetic demo: accuracy vs staleness (band: min..max over seeds)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--staleness", default="0,1,2,4,8")
    parser.add_argument("--losses", default="pg,grpo,aipo,tis")
    parser.add_argument("--seeds", default="0,1,2", help="job seeds (sampling, data order)")
    parser.add_argument("--warmstart-seed", type=int, default=0)
    parser.add_argument(
        "--steps", type=int, default=0, help="override trainer.num_steps (0: the job's)"
    )
    parser.add_argument("--override", action="append", default=[], help="extra dotted job override")
    parser.add_argument("--work", type=Path, default=ROOT / "runs/bench-staleness")
    parser.add_argument("--plot", type=Path, default=ROOT / "docs/img/staleness_ablation.png")
    parser.add_argument("--json", type=Path, help="also write the cells as JSON here")
    args = parser.parse_args()
    staleness = [int(s) for s in args.staleness.split(",")]
    losses = [s.strip() for s in args.losses.split(",")]
    seeds = [int(s) for s in args.seeds.split(",")]
    args.work.mkdir(parents=True, exist_ok=True)
    model = args.work / f"warmstart-s{args.warmstart_seed}"
    if not (model / "config.json").is_file():
        subprocess.run(
            [
                sys.executable,
                "-m",
                "examples.arithmetic.warmstart",
                "--out",
                str(model),
                "--seed",
                str(args.warmstart_seed),
            ],
            cwd=ROOT,
            check=True,
            capture_output=True,
        )
    cells = []
    for seed in seeds:
        for loss in losses:
            for s in staleness:
                cells.append(
                    run_cell(model, loss, s, seed, args, args.work / f"{loss}-s{s}-seed{seed}")
                )
                c = cells[-1]
                print(
                    f"{loss} max_staleness={s} seed={seed}: {c['start']:.1%} -> {c['end']:.1%}, "
                    f"staleness {c['staleness_mean']:.2f}, {c['samples_per_s']:.0f} samples/s",
                    flush=True,
                )
                if args.json:
                    args.json.write_text(json.dumps(cells, indent=2))
    stats = summarise(cells)
    print_table(stats, losses, staleness, cells[0]["start"])
    args.plot.parent.mkdir(parents=True, exist_ok=True)
    plot(stats, losses, staleness, args.plot)
    print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
