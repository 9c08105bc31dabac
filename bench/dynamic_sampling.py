"""Does dynamic sampling reach the plain run's held-out accuracy in no more wall time?

For each warm-start seed in ``--seeds`` this warm-starts the tiny model of the arithmetic
demo (``examples.arithmetic.warmstart --seed``), then runs the demo job on it twice with the
same steps: plain, and with ``algorithm.dynamic_sampling = true`` (groups whose completions
all got the same reward are dropped and replaced). The baseline is the plain run of the same
seed, measured in the same invocation: its held-out accuracy at the end (``target``) and its
wall time. From the dynamic-sampling run's evaluations (every ``--eval-every`` steps and at
the end) it reads the first at or above ``target`` and the RL wall time at that point;
``time ratio`` = that time / the plain run's (below 1: reached sooner). Cells run
seed-major, plain first, so a shared machine's noise hits both alike. A warm-start folder
already in ``--work`` is reused (the warm-start repeats bit for bit at one thread on one
machine); ``--fresh-warmstart`` makes it again.

    python bench/dynamic_sampling.py --seeds 0,1 --steps 300
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "examples/arithmetic/job.toml"


def warmstart(seed: int, out: Path, fresh: bool = True) -> None:
    """The demo's warm-start of ``seed`` in ``out`` (kept where it is already there and not
    ``fresh``)."""
    if not fresh and (out / "config.json").is_file():
        return
    cmd = [sys.executable, "-m", "examples.arithmetic.warmstart", "--out", str(out)]
    cmd += ["--seed", str(seed), "--threads", "1", "--force"]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True)


def run_rl(model: Path, seed: int, dynamic: bool, args, out: Path, extra=()) -> dict:
    """One RL run (``extra``: more dotted overrides); its summary and the (RL seconds,
    held-out accuracy) of each evaluation."""
    shutil.rmtree(out, ignore_errors=True)
    overrides = [
        f'model.path="{model}"',
        f"seed={seed}",
        f"trainer.num_steps={args.steps}",
        f"eval.every_steps={args.eval_every}",
        "checkpoint.every_steps=100000",
        f"algorithm.dynamic_sampling={str(dynamic).lower()}",
        *extra,
        *args.override,
    ]
    cmd = [sys.executable, "-m", "loomrl.cli", "run", str(JOB), *overrides]
    proc = subprocess.run(
        [*cmd, "--output-dir", str(out)], cwd=ROOT, capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise RuntimeError(f"run {out} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    summary = json.loads((out / "summary.json").read_text())
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [
        (r["timing/elapsed_s"], r["eval/mean_reward"])
        for r in records
        if "eval/mean_reward" in r and "timing/elapsed_s" in r
    ]
    evals.append((summary["elapsed_s"], summary["eval_end"]))
    return {"summary": summary, "evals": evals}


def compare(seed: int, plain: dict, dynamic: dict) -> dict:
    target = plain["summary"]["eval_end"]
    reached = next(((t, acc) for t, acc in dynamic["evals"] if acc >= target), None)
    s = dynamic["summary"]
    return {
        "seed": seed,
        "start": plain["summary"]["eval_start"],
        "plain_end": target,
        "plain_s": plain["summary"]["elapsed_s"],
        "dynamic_end": s["eval_end"],
        "dynamic_s": s["elapsed_s"],
        "reached_s": reached[0] if reached else None,
        "time_ratio": reached[0] / plain["summary"]["elapsed_s"] if reached else None,
        "dropped_frac": s["dropped_zero_variance"] / max(s["generated"], 1),
        "short_steps": s["short_steps"],
        "identity": s["generated"]
        == s["trained"]
        + s["dropped_stale"]
        + s["dropped_zero_variance"]
        + s["failed"]
        + s["in_flight"],
    }


def print_table(rows: list[dict], steps: int) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"arithmetic demo, {steps} steps: dynamic sampling against plain")
    columns = [
        "seed",
        "start",
        "plain end",
        "plain s",
        "DS end",
        "DS s",
        "DS reaches plain end at s",
    ]
    for col in [*columns, "time ratio", "dropped", "short steps", "identity"]:
        table.add_column(col, justify="right")
    for r in rows:
        reached = "never" if r["reached_s"] is None else f"{r['reached_s']:.0f}"
        ratio = "-" if r["time_ratio"] is None else f"{r['time_ratio']:.2f}"
        table.add_row(
            str(r["seed"]),
            f"{100 * r['start']:.1f}%",
            f"{100 * r['plain_end']:.1f}%",
            f"{r['plain_s']:.0f}",
            f"{100 * r['dynamic_end']:.1f}%",
            f"{r['dynamic_s']:.0f}",
            reached,
            ratio,
            f"{100 * r['dropped_frac']:.0f}%",
            str(r["short_steps"]),
            "holds" if r["identity"] else "BROKEN",
        )
    Console().print(table)


def print_medians(rows: list[dict]) -> None:
    """Per seed, the median over repeats of each pair's time ratio (a pair whose dynamic run
    never reached its plain run's end counts as infinitely slow)."""
    import statistics

    for seed in sorted({r["seed"] for r in rows}):
        mine = [r for r in rows if r["seed"] == seed]
        ratios = [r["time_ratio"] if r["time_ratio"] is not None else float("inf") for r in mine]
        plain = statistics.median(r["plain_end"] for r in mine)
        dynamic = statistics.median(r["dynamic_end"] for r in mine)
        print(
            f"seed {seed}: {len(mine)} pairs, time ratio median {statistics.median(ratios):.2f} "
            f"(each {', '.join(f'{x:.2f}' for x in ratios)}); end accuracy median plain "
            f"{100 * plain:.1f}%, dynamic {100 * dynamic:.1f}%"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument(
        "--repeats", type=int, default=1, help="plain/dynamic pairs a seed (medians printed)"
    )
    parser.add_argument("--override", action="append", default=[], help="extra dotted job override")
    parser.add_argument("--work", type=Path, default=ROOT / "runs/bench-dynamic-sampling")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    parser.add_argument(
        "--fresh-warmstart", action="store_true", help="warm-start again even if --work has one"
    )
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    rows = []
    for seed in [int(s) for s in args.seeds.split(",") if s]:
        model = args.work / f"warmstart-s{seed}"
        warmstart(seed, model, args.fresh_warmstart)
        for rep in range(args.repeats):
            tag = f"s{seed}" if args.repeats == 1 else f"s{seed}-r{rep}"
            plain = run_rl(model, seed, False, args, args.work / f"rl-{tag}-plain")
            dynamic = run_rl(model, seed, True, args, args.work / f"rl-{tag}-dynamic")
            rows.append({**compare(seed, plain, dynamic), "repeat": rep})
            print(json.dumps(rows[-1]), flush=True)
            if args.json:
                args.json.write_text(json.dumps(rows, indent=2))
    print_table(rows, args.steps)
    if args.repeats > 1:
        print_medians(rows)


if __name__ == "__main__":
    main()
