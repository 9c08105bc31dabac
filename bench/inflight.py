"""Drain-then-update vs in-flight updates vs partial rollouts on long completions (CPU).

The arithmetic demo's job with long completions (``--new-tokens``, 256 by default) on a
small model built from its config (no download, no warm start), asynchronous
(``max_staleness = 1``), run three ways from the same seed:

- ``drained``: ``generation.inflight_updates = false``: a generator applies a new version
  between generate calls only;
- ``inflight``: a newer version applied between two decode steps every
  ``--every`` tokens, the KV cache kept (PipelineRL);
- ``partial``: the same, each update cutting the requests and continuing them with the
  prefix recomputed (AReaL / verl partial rollouts).

Prints one row each: completions/s, the trainer's idle fraction (the step's
``timing/wait_for_batch_s`` over the run's time), the staleness the trainer saw (mean and
max of its oldest-token staleness), the share of trained tokens its own version sampled
(``train/current_version_token_frac``), groups dropped as stale, and the versions applied
mid-request. The model is untrained, so there is no learning column here: the demo's
warm-started learning comparison needs its ~10 min warm start per seed.

    python bench/inflight.py                       # 3 runs of 6 steps, ~1-2 min on 2 cores
    python bench/inflight.py --new-tokens 512 --steps 10 --every 8
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

from loomrl.config import load_config  # noqa: E402
from loomrl.job import Job  # noqa: E402
from loomrl.telemetry.metrics import read_metrics  # noqa: E402

JOB = ROOT / "examples/arithmetic/job.toml"
MODEL = (
    "tiny:llama?hidden_size=64&num_layers=2&num_heads=4&intermediate_size=128"
    "&max_position_embeddings=1024"
)
MODES = {
    "drained": [],
    "inflight": ["generation.inflight_updates=true"],
    "partial": ["generation.inflight_updates=true", "generation.partial_rollouts=true"],
}


def run(mode: str, args, out: Path) -> dict:
    """One run of ``mode`` in a folder of its own under ``out``; its row."""
    overrides = [
        f'model.path="{MODEL}"',
        'model.dtype="float32"',
        f"seed={args.seed}",
        f"generation.max_new_tokens={args.new_tokens}",
        "generation.prompts_per_request=2",
        f"generation.inflight_every_tokens={args.every}",
        "algorithm.group_size=4",
        "algorithm.groups_per_step=4",
        "algorithm.max_staleness=1",
        f"trainer.num_steps={args.steps}",
        "trainer.micro_batch_size=16",
        "checkpoint.every_steps=100000",
        "eval.every_steps=100000",
        "logging.report=false",
        f'output_dir="{out}"',
        *MODES[mode],
    ]
    cfg = load_config(JOB, overrides)
    cfg.data.eval = None
    result = Job(cfg).run()
    records = list(read_metrics(result.run_dir))
    steps = [r for r in records if "train/loss" in r]
    wait = sum(r.get("timing/wait_for_batch_s", 0.0) for r in steps)
    elapsed = max(r.get("timing/elapsed_s", 0.0) for r in records)
    inflight = [
        r["generation/inflight_updates"] for r in records if "generation/inflight_updates" in r
    ]
    return {
        "mode": mode,
        "completions_per_s": result.summary["samples_per_s"],
        "trainer_idle": wait / elapsed if elapsed else float("nan"),
        "staleness_mean": statistics.mean(r["rollout/staleness_mean"] for r in steps),
        "staleness_max": max(r["rollout/staleness_max"] for r in steps),
        "dropped_stale": result.summary["dropped_stale"],
        "inflight_updates": max(inflight, default=0.0),
        "current_tokens": statistics.mean(r["train/current_version_token_frac"] for r in steps),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--every", type=int, default=16, help="generation.inflight_every_tokens")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--rounds", type=int, default=1, help="runs of each mode, interleaved")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="loomrl-inflight-") as tmp:
        # interleaved rounds: a shared machine's noise hits every mode alike
        for round_ in range(args.rounds):
            for mode in args.modes.split(","):
                rows.append(run(mode, args, Path(tmp) / f"{round_}-{mode}"))
    print(
        f"\n{args.new_tokens} new tokens, {args.steps} steps, look every {args.every} tokens, "
        f"seed {args.seed}\n"
    )
    print(
        "| mode | completions/s | trainer idle | staleness mean / max | tokens at the trainer's "
        "version | dropped stale | mid-request updates |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['mode']} | {r['completions_per_s']:.1f} | {r['trainer_idle']:.0%} | "
            f"{r['staleness_mean']:.2f} / {r['staleness_max']} | {r['current_tokens']:.0%} | "
            f"{r['dropped_stale']} | "
            f"{r['inflight_updates']:.0f} |"
        )


if __name__ == "__main__":
    main()
