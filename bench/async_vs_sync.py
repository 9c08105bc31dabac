"""Asynchronous vs synchronous RL on the same workload, in one run.

Runs the arithmetic job with identical settings except ``algorithm.max_staleness``
(0 = synchronous baseline, N = asynchronous), on each runtime asked for (``local``:
executors are threads of one process; ``process``: one spawned process each), and prints
samples/s for each, the async/sync ratio per runtime, and the ideal ratio from the stage
times measured in the synchronous run:

    ideal = (gen + train + sync) / max(gen, train)

where gen is the generator's busy time, train the trainer's (without publishing) and sync
the time spent publishing weights. The baseline of every row is sync on ``local``. Also
printed: the controller loop's own CPU time as a share of wall ("loop overhead": neither
waiting nor an executor call) and the CPU time of the controller's whole process.
Repeats each configuration, interleaved, and reports medians.

    python bench/async_vs_sync.py --steps 40 --repeats 3 --runtimes local,process
    python bench/async_vs_sync.py --model "tiny:llama?hidden_size=256&num_layers=2" --max-new-tokens 32
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def run_once(
    runtime: str, event_loop: str, max_staleness: int, args: argparse.Namespace, out: Path
) -> dict[str, float]:
    from loomrl.job import Job
    from loomrl.telemetry.metrics import read_metrics

    overrides = [
        f'model.path="{args.model}"',
        f'runtime="{runtime}"',
        f'event_loop="{event_loop}"',
        f"algorithm.max_staleness={max_staleness}",
        f"trainer.num_steps={args.steps}",
        f"algorithm.groups_per_step={args.groups_per_step}",
        f'output_dir="{out}"',
        "eval.every_steps=100000",
        "checkpoint.every_steps=100000",
        'data.eval="examples/arithmetic/eval.jsonl"',
        "data.max_eval_examples=8",
        *([f"generation.max_new_tokens={args.max_new_tokens}"] if args.max_new_tokens else []),
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
        "controller_overhead": s["controller_overhead"],
        "controller_process_cpu_s": s["controller_process_cpu_s"],
        "controller_cpu_ms_per_step": s["controller_cpu_s"] * 1e3 / max(s["steps"], 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--async-staleness", type=int, default=2)
    parser.add_argument("--groups-per-step", type=int, default=16)
    parser.add_argument(
        "--model", default="tiny:llama", help="model spec (default: random tiny Llama)"
    )
    parser.add_argument("--max-new-tokens", type=int, default=None, help="default: the job's (4)")
    parser.add_argument(
        "--runtimes", default="local,process", help="comma-separated: local, process"
    )
    parser.add_argument(
        "--event-loops",
        default="auto",
        help="comma-separated event_loop settings to compare: auto, uvloop, asyncio",
    )
    args = parser.parse_args()
    import logging

    logging.disable(logging.INFO)
    from rich.console import Console
    from rich.table import Table

    runtimes = [r.strip() for r in args.runtimes.split(",") if r.strip()]
    loops = [e.strip() for e in args.event_loops.split(",") if e.strip()]
    pairs = [(rt, ev) for rt in runtimes for ev in loops]
    configs = [(rt, ev, mode) for rt, ev in pairs for mode in ("sync", "async")]
    results: dict[tuple[str, str, str], list[dict[str, float]]] = {c: [] for c in configs}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):  # interleave configurations so machine noise hits all
            for rt, ev, mode in configs:
                staleness = 0 if mode == "sync" else args.async_staleness
                out = Path(tmp) / f"{rt}-{ev}-{mode}-{rep}"
                results[(rt, ev, mode)].append(run_once(rt, ev, staleness, args, out))

    def med(config: tuple[str, str, str], key: str) -> float:
        return statistics.median(r[key] for r in results[config])

    baseline = med(configs[0], "samples_per_s")
    table = Table(
        title=f"async vs sync: {args.steps} steps x {args.groups_per_step} groups, median of {args.repeats}"
    )
    cols = (
        "runtime",
        "event loop",
        "mode",
        "samples/s",
        f"vs {runtimes[0]} {loops[0]} sync",
        "gen busy s",
        "train busy s",
        "sync s",
        "staleness",
        "wall s",
        "loop overhead",
        "loop CPU ms/step",
        "controller process CPU s",
    )
    for col in cols:
        table.add_column(col, justify="right")
    for c in configs:
        table.add_row(
            *c,
            f"{med(c, 'samples_per_s'):.1f}",
            f"{med(c, 'samples_per_s') / baseline:.2f}x",
            f"{med(c, 'gen_s'):.2f}",
            f"{med(c, 'train_s'):.2f}",
            f"{med(c, 'sync_s'):.2f}",
            f"{med(c, 'staleness_mean'):.2f}",
            f"{med(c, 'elapsed_s'):.2f}",
            f"{med(c, 'controller_overhead'):.2%}",
            f"{med(c, 'controller_cpu_ms_per_step'):.3f}",
            f"{med(c, 'controller_process_cpu_s'):.2f}",
        )
    console = Console(width=max(Console().width, 120))
    console.print(table)
    for rt, ev in pairs:
        sync_sps, async_sps = (
            med((rt, ev, "sync"), "samples_per_s"),
            med((rt, ev, "async"), "samples_per_s"),
        )
        gen, train, sync = (med((rt, ev, "sync"), k) for k in ("gen_s", "train_s", "sync_s"))
        ideal = (gen + train + sync) / max(gen, train)
        console.print(
            f"{rt} ({ev}): async / sync samples/s {async_sps / sync_sps:.2f}x; ideal "
            f"(gen + train + sync) / max(gen, train) from its sync run {ideal:.2f}x; share of ideal "
            f"{async_sps / sync_sps / ideal:.2f}"
        )


if __name__ == "__main__":
    main()
