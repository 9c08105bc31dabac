"""Fixed-seed synchronous jobs whose per-step losses, grad norms and rewards are kept in
``tests/data/golden_sync.json``; ``test_golden_sync.py`` runs them again and compares
exactly. A refactor must not change a bit of them.

Regenerate only on purpose, for a change that is meant to move the numbers, and say so in
the commit: ``PYTHONPATH=src python tests/golden_sync.py`` (one torch thread), and once more
with ``ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2`` for the AVX2 record.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from loomrl.envs.base import Environment, StepResult

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests/data/golden_sync.json"
TINY_MODEL = "tiny:llama?hidden_size=32&num_layers=2&num_heads=2&intermediate_size=64"

# The keys compared per step: what training computes, not how long it took.
STEP_KEYS = (
    "train/loss",
    "train/grad_norm",
    "train/lr",
    "train/entropy",
    "train/update_rms",
    "train/importance_ratio_mean",
    "train/advantage_abs_mean",
    "train/num_tokens",
    "rollout/reward_mean",
    "rollout/completion_len_mean",
    "rollout/staleness_max",
)


def length_reward(prompt: str, completion: str, **row: Any) -> float:
    """Varies with the sample, so advantages (and the loss) are not zero."""
    return float(len(completion.strip())) / 3.0


class TwoTurns(Environment):
    """Two turns: the first answer gets feedback, the second is scored on its length."""

    def __init__(self) -> None:
        self.turn = 0

    def reset(self, row):
        return row["prompt"]

    def step(self, completion):
        self.turn += 1
        if self.turn == 1:
            return StepResult(observation=" again:", reward=0.0, done=False)
        return StepResult(observation="", reward=len(completion.strip()) / 3, done=True)


def _raw(out: Path, data: tuple[Path, Path], **sections: Any) -> dict[str, Any]:
    train, evals = data
    raw: dict[str, Any] = {
        "name": "golden",
        "seed": 3,
        "output_dir": str(out),
        # fp32 pinned: 'auto' would compute in bf16 on a CPU with native bf16
        "model": {"path": TINY_MODEL, "dtype": "float32"},
        "data": {"train": str(train), "eval": str(evals)},
        "task": {"reward": "golden_sync:length_reward", "reward_timeout_s": 10.0},
        "generation": {"max_new_tokens": 4, "prompts_per_request": 2},
        "algorithm": {"group_size": 4, "groups_per_step": 4, "max_staleness": 0},
        "trainer": {
            "precision": "fp32",
            "num_steps": 10,
            "lr": 3e-3,
            "micro_batch_size": 8,
            "warmup_steps": 3,
            "lr_schedule": "cosine",
        },
        "weight_sync": {"codec": "delta"},
        "checkpoint": {"every_steps": 100},
        "eval": {"every_steps": 5},
    }
    for section, values in sections.items():
        if isinstance(values, dict):
            raw.setdefault(section, {}).update(values)
        else:
            raw[section] = values
    return raw


# name -> config sections over the base above
CASES: dict[str, dict[str, Any]] = {
    "reward_local": {},
    "linear_schedule": {
        "trainer": {"num_steps": 6, "warmup_steps": 2, "lr_schedule": "linear"},
        "weight_sync": {"codec": "full"},
    },
    "environment_local": {
        "task": {"reward": None, "environment": "golden_sync:TwoTurns", "max_turns": 3},
        "trainer": {"num_steps": 4},
        "eval": {"every_steps": 2},
    },
    "reward_process_shm": {"runtime": "process", "trainer": {"num_steps": 4}},
}


def write_data(folder: Path) -> tuple[Path, Path]:
    rows = [
        json.loads(line)
        for line in (ROOT / "examples/arithmetic/train.jsonl").read_text().splitlines()
    ]
    train, evals = folder / "train.jsonl", folder / "eval.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows[:200]))
    evals.write_text("".join(json.dumps(r) + "\n" for r in rows[200:208]))
    return train, evals


def run_case(name: str, folder: Path) -> dict[str, Any]:
    """Run one case; its per-step values and its evals, as the golden file keeps them."""
    from loomrl.config import build_config
    from loomrl.job import Job
    from loomrl.telemetry.metrics import read_metrics

    folder.mkdir(parents=True, exist_ok=True)
    data = write_data(folder)
    result = Job(build_config(_raw(folder / "run", data, **CASES[name]))).run()
    records = read_metrics(result.run_dir)
    steps = [
        {k: r.get(k) for k in STEP_KEYS} | {"step": r["step"]} for r in records if "train/loss" in r
    ]
    # eval/accuracy (7a184df) and eval/mean_reward (later) are the same number: the mean reward
    evals = [
        {"step": r["step"], "mean_reward": r.get("eval/mean_reward", r.get("eval/accuracy"))}
        for r in records
        if "eval/version" in r
    ]
    return {"steps": steps, "evals": evals}


def record_key() -> str:
    """What decides the floating-point order of these runs, so one record per kind of
    machine: torch's CPU kernel level and build. An AVX-512 machine writes the AVX2 record
    too, with ``ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2`` (the code paths an
    AVX2-only CPU takes; that reproduced an AMD machine's runs bit for bit).

    A CPU with AMX tiles (Intel Sapphire Rapids and later) gets records of its own: there
    MKL and oneDNN pick other fp32 kernels, and neither the AVX-512 record nor the AVX2 one
    (with the variables above, or ``MKL_CBWR``) was reproduced."""
    import torch

    amx = " AMX" if "amx_tile" in _cpu_flags() else ""
    return f"{torch.backends.cpu.get_cpu_capability()}{amx} torch {torch.__version__}"


def _cpu_flags() -> set[str]:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:  # not Linux: the kernel level alone names the record
        return set()
    return next(
        (set(line.split(":", 1)[1].split()) for line in lines if line.startswith("flags")), set()
    )


def main() -> None:
    import torch

    torch.set_num_threads(1)
    sys.path.insert(0, str(Path(__file__).parent))  # golden_sync:* for the reward and env
    sys.path.insert(0, str(ROOT))
    with tempfile.TemporaryDirectory() as tmp:
        record = {name: run_case(name, Path(tmp) / name) for name in CASES}
    key = record_key()
    golden = json.loads(GOLDEN.read_text()) if GOLDEN.is_file() else {}
    golden[key] = record
    GOLDEN.parent.mkdir(parents=True, exist_ok=True)
    GOLDEN.write_text(json.dumps(golden, indent=1, sort_keys=True) + "\n")
    print(f"wrote the {key} record of {GOLDEN}")


if __name__ == "__main__":
    main()
