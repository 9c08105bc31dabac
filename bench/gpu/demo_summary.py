"""One line about a finished (or stopped) run folder, for bench/gpu_check.sh: steps, samples/s,
held-out reward at each evaluation, the median step time of the second half, the device.

    python3 bench/gpu/demo_summary.py RUN_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def describe(run: Path) -> str:
    records = []
    metrics = run / "metrics.jsonl"
    if metrics.is_file():
        for line in metrics.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except ValueError:
                continue
    steps = [r for r in records if "timing/step_s" in r]
    evals = [(r.get("step"), r["eval/mean_reward"]) for r in records if "eval/mean_reward" in r]
    summary = (
        json.loads((run / "summary.json").read_text()) if (run / "summary.json").is_file() else {}
    )
    parts = [f"steps {summary.get('steps', len(steps))}"]
    if summary.get("samples_per_s"):
        parts.append(f"samples/s {summary['samples_per_s']:.0f}")
    if evals:
        parts.append("held-out reward " + " -> ".join(f"{v:.3f}@{k}" for k, v in evals))
    late = sorted(r["timing/step_s"] for r in steps[len(steps) // 2 :])
    if late:
        parts.append(f"median step {late[len(late) // 2] * 1000:.0f} ms (2nd half)")
    config = run / "config.json"
    if config.is_file():
        parts.append(f"model.device={json.loads(config.read_text())['model']['device']}")
    return "; ".join(parts)


if __name__ == "__main__":
    print(describe(Path(sys.argv[1])))
