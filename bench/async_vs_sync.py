"""Asynchronous vs synchronous RL on the same workload, in one run.

Runs the arithmetic job twice with identical settings except ``algorithm.max_staleness``
(0 = synchronous baseline, N = asynchronous) and prints samples/s for each, their ratio,
and the ideal ratio from the stage times measured in the synchronous run:

    ideal = (gen + train + sync) / max(gen, train)

where gen is the generator's busy time, train the trainer's (without publishing) and sync
the time spent publishing weights. Repeats each mode and reports medians.

    python bench/async_vs_sync.py --steps 40 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def run_once(max_staleness: int, args: argparse.Namespace, out: Path) -> dict[str, float]:
    from loomrl.job import Job
    from loomrl.telemetry.metrics import read_metrics

    overrides = [
        f'model.path="{args.model}"',
        f"algorithm.max_staleness={max_staleness}",
        f"trainer.num_steps={args.steps}",
        f"algorithm.groups_per_step={args.groups_per_step}",
        f'output_dir="{out}"',
        "eval.every_steps=100000",
        "checkpoint.every_steps=100000",
        'data.eval="examples/arithmetic/eval.jsonl"',
        "data.max_eval_examples=8",
    ]
    result = Job.from_toml(ROOT / "examples/arithmetic/job.toml", overrides).run()
    records = [r for r in read_metrics(out) if "train/loss" in r]
    publish_s = sum(r.get("timing/publish_s", 0.0) for r in records)
    s = result.summary
    return {
        "samples_per_s": s["samples_per_s"],
        "gen_s": s["generator_busy_s"],
        "train_s": s["trainer_busy_s"] - publish_s,
        "sync_s": publish_s,
        "elapsed_s": s["elapsed_s"],
        "staleness_mean": statistics.mean(r["rollout/staleness_mean"] for r in records),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--async-staleness", type=int, default=2)
    parser.add_argument("--groups-per-step", type=int, default=16)
    parser.add_argument("--model", default="tiny:llama", help="model spec (default: random tiny Llama)")
    args = parser.parse_args()
    import logging

    logging.disable(logging.INFO)
    from rich.console import Console
    from rich.table import Table

    results: dict[str, list[dict[str, float]]] = {"sync": [], "async": []}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):  # interleave modes so machine noise hits both
            for mode, staleness in (("sync", 0), ("async", args.async_staleness)):
                results[mode].append(run_once(staleness, args, Path(tmp) / f"{mode}-{rep}"))

    def med(mode: str, key: str) -> float:
        return statistics.median(r[key] for r in results[mode])

    sync_sps, async_sps = med("sync", "samples_per_s"), med("async", "samples_per_s")
    gen, train, sync = med("sync", "gen_s"), med("sync", "train_s"), med("sync", "sync_s")
    ideal = (gen + train + sync) / max(gen, train)
    table = Table(title=f"async vs sync: {args.steps} steps x {args.groups_per_step} groups, median of {args.repeats}")
    for col in ("mode", "samples/s", "gen busy s", "train busy s", "sync s", "staleness", "wall s"):
        table.add_column(col, justify="right")
    for mode in ("sync", "async"):
        table.add_row(
            mode, f"{med(mode, 'samples_per_s'):.1f}", f"{med(mode, 'gen_s'):.2f}", f"{med(mode, 'train_s'):.2f}",
            f"{med(mode, 'sync_s'):.2f}", f"{med(mode, 'staleness_mean'):.2f}", f"{med(mode, 'elapsed_s'):.2f}",
        )
    console = Console()
    console.print(table)
    console.print(f"async / sync samples/s ratio: {async_sps / sync_sps:.2f}x")
    console.print(f"ideal ratio (gen + train + sync) / max(gen, train) from the sync run: {ideal:.2f}x")


if __name__ == "__main__":
    main()
