"""Per-step curves of several runs side by side, from their ``metrics.jsonl``.

    python bench/plot_runs.py RUN_DIR[=LABEL] ... --out curves.png
    python bench/plot_runs.py runs/a=learns runs/b=flat --metrics rollout/reward_mean,train/entropy

One panel per metric, one line per run, smoothed over ``--smooth`` steps (eval metrics are
plotted at the steps they were measured).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

DEFAULT_METRICS = (
    "rollout/reward_mean,eval/mean_reward,train/grad_norm,train/update_rms,train/entropy,"
    "train/importance_ratio_mean,train/importance_ratio_max,train/clip_fraction"
)


def read_series(run_dir: Path, metric: str, smooth: int) -> tuple[list[int], list[float]]:
    points = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if metric in record and "step" in record:
            points.append((record["step"], float(record[metric])))
    if metric.startswith("eval/") or smooth <= 1:
        return [s for s, _ in points], [v for _, v in points]
    steps, values = [], []
    for i in range(0, len(points) - smooth + 1, smooth):
        chunk = points[i : i + smooth]
        steps.append(chunk[-1][0])
        values.append(sum(v for _, v in chunk) / len(chunk))
    return steps, values


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("runs", nargs="+", help="run folder, optionally =LABEL")
    parser.add_argument("--metrics", default=DEFAULT_METRICS)
    parser.add_argument("--smooth", type=int, default=20, help="steps per averaged point")
    parser.add_argument("--out", type=Path, default=Path("curves.png"))
    parser.add_argument("--title", default="")
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [m for m in args.metrics.split(",") if m]
    cols = 2
    rows = (len(metrics) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(11, 2.6 * rows), squeeze=False)
    for ax, metric in zip(axes.flat, metrics):
        for spec in args.runs:
            path, _, label = spec.partition("=")
            steps, values = read_series(Path(path), metric, args.smooth)
            ax.plot(
                steps,
                values,
                label=label or Path(path).name,
                marker="o" if metric.startswith("eval/") else None,
            )
        ax.set_title(metric, fontsize=10)
        ax.set_xlabel("step", fontsize=8)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(metrics) :]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=8)
    if args.title:
        fig.suptitle(args.title)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
