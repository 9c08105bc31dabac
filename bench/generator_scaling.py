"""Completions/s with 1 and 2 generators and 1 and 2 scorers, on a sandboxed task.

Runs the code example (one-line Python functions scored by running their unit tests in the
sandbox pool) with ``generation.num_generators`` x ``task.num_scorers`` in {1, 2} x {1, 2}
on the runtime asked for (``ray`` by default: each executor a Ray actor on a local
cluster), asynchronous, the same seed and steps; prints completions/s per configuration and
its ratio against 1 generator x 1 scorer measured in the same run (median of the repeats,
configurations interleaved).

On this 2-core machine the executors share two cores, so a second generator or scorer
can only help where one sat waiting (a sandbox exec, a weight update); the table shows what
2 cores allow. The projection below it uses each stage's measured busy seconds per
completion (generation, scoring, training, from the 1 x 1 run) for executors that each have
a machine to themselves: completions/s = min(G / gen, S / score, 1 / train), the slowest
stage bounding the pipeline (what an asynchronous run approaches, ``bench/async_vs_sync.py``);
with one trainer that is training here, so the table also shows what the rollout side alone
(generators and scorers) could feed: min(G / gen, S / score).

    python bench/generator_scaling.py --steps 30 --repeats 2
    python bench/generator_scaling.py --runtime process
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CONFIGS = [(1, 1), (2, 1), (1, 2), (2, 2)]


def run_once(gens: int, scorers: int, args: argparse.Namespace, out: Path) -> dict[str, float]:
    from loomrl.job import Job

    overrides = [
        f'runtime="{args.runtime}"',
        f"generation.num_generators={gens}",
        f"task.num_scorers={scorers}",
        f"trainer.num_steps={args.steps}",
        f"algorithm.max_staleness={args.staleness}",
        f'output_dir="{out}"',
        "eval.every_steps=100000",
        "data.max_eval_examples=4",
        "checkpoint.every_steps=100000",
        *args.override,
    ]
    if args.runtime != "local":
        overrides.append('weight_sync.transport="shm"')
    s = Job.from_toml(ROOT / "examples/code/job.toml", overrides).run().summary
    completions = s["trained"] + s["dropped_stale"] + s["failed"]
    return {
        "completions_per_s": completions / max(s["elapsed_s"], 1e-9),
        "gen_per_completion_s": s["generator_busy_s"] / max(s["generated"], 1),
        "score_per_completion_s": s["scorer_busy_s"] / max(s["generated"], 1),
        "train_per_completion_s": s["trainer_busy_s"] / max(s["trained"], 1),
        "failed": s["failed"],
        "elapsed_s": s["elapsed_s"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runtime", default="ray", choices=["ray", "process", "local"])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--staleness", type=int, default=2)
    parser.add_argument("--override", action="append", default=[], help="extra dotted job override")
    args = parser.parse_args()
    import logging

    logging.disable(logging.INFO)
    from rich.console import Console
    from rich.table import Table

    results: dict[tuple[int, int], list[dict[str, float]]] = {c: [] for c in CONFIGS}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            for gens, scorers in CONFIGS:
                out = Path(tmp) / f"g{gens}-s{scorers}-{rep}"
                results[(gens, scorers)].append(run_once(gens, scorers, args, out))

    def med(config, key):
        return statistics.median(r[key] for r in results[config])

    base = med((1, 1), "completions_per_s")
    console = Console(width=max(Console().width, 120))
    table = Table(
        title=f"code task on runtime={args.runtime}: {args.steps} steps, median of {args.repeats}"
    )
    for col in (
        "generators",
        "scorers",
        "completions/s",
        "vs 1 x 1",
        "gen s/compl",
        "score s/compl",
        "train s/compl",
        "failed",
        "wall s",
    ):
        table.add_column(col, justify="right")
    for c in CONFIGS:
        table.add_row(
            str(c[0]),
            str(c[1]),
            f"{med(c, 'completions_per_s'):.1f}",
            f"{med(c, 'completions_per_s') / base:.2f}x",
            f"{1e3 * med(c, 'gen_per_completion_s'):.2f} ms",
            f"{1e3 * med(c, 'score_per_completion_s'):.2f} ms",
            f"{1e3 * med(c, 'train_per_completion_s'):.2f} ms",
            f"{med(c, 'failed'):.0f}",
            f"{med(c, 'elapsed_s'):.1f}",
        )
    console.print(table)
    gen, score, train = (
        med((1, 1), k)
        for k in ("gen_per_completion_s", "score_per_completion_s", "train_per_completion_s")
    )
    proj = Table(title="projection: one machine per executor, stage times of the 1 x 1 run")
    for col in (
        "generators",
        "scorers",
        "completions/s",
        "vs 1 x 1",
        "bound by",
        "rollouts/s (gen + score)",
        "rollouts vs 1 x 1",
    ):
        proj.add_column(col, justify="right")
    one = min(1 / gen, 1 / score, 1 / train)
    rollouts_one = min(1 / gen, 1 / score)
    for g, s in [(1, 1), (2, 1), (1, 2), (2, 2), (4, 4), (8, 8)]:
        stages = {"generation": g / gen, "scoring": s / score, "training": 1 / train}
        bound = min(stages, key=stages.get)
        rollouts = min(stages["generation"], stages["scoring"])  # what the rollout side can feed
        proj.add_row(
            str(g),
            str(s),
            f"{stages[bound]:.0f}",
            f"{stages[bound] / one:.2f}x",
            bound,
            f"{rollouts:.0f}",
            f"{rollouts / rollouts_one:.2f}x",
        )
    console.print(proj)


if __name__ == "__main__":
    main()
