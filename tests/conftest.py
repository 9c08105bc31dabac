"""Shared fixtures: a tiny job config that runs in seconds on one CPU core."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # examples.* reward functions are importable by path
    sys.path.insert(0, str(ROOT))

# The suite runs as on a CPU without native bf16, whatever CPU it runs on: the 'auto'
# precisions resolve to fp32 here and in every process the tests start (the environment is
# inherited). tests/test_cpu_bf16.py sets other flags to test the policy itself.
os.environ["LOOMRL_CPU_FLAGS"] = ""

TINY_MODEL = "tiny:llama?hidden_size=32&num_layers=2&num_heads=2&intermediate_size=64"


@pytest.fixture
def tiny_data(tmp_path: Path) -> tuple[Path, Path]:
    src = [
        json.loads(line)
        for line in (ROOT / "examples/arithmetic/train.jsonl").read_text().splitlines()
    ]
    train, evals = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in src[:400]))
    evals.write_text("".join(json.dumps(r) + "\n" for r in src[400:416]))
    return train, evals


def tiny_job_raw(tmp_path: Path, train: Path, evals: Path | None = None, **sections) -> dict:
    raw = {
        "name": "tiny",
        "seed": 0,
        "output_dir": str(tmp_path / "run"),
        # fp32 pinned: tests compare runs bit for bit, whatever the CPU's bf16
        "model": {"path": TINY_MODEL, "dtype": "float32"},
        "data": {"train": str(train), **({"eval": str(evals)} if evals else {})},
        "task": {"reward": "examples.arithmetic.reward:exact_match", "reward_timeout_s": 2.0},
        "generation": {"max_new_tokens": 3, "prompts_per_request": 2},
        "algorithm": {"group_size": 4, "groups_per_step": 4, "max_staleness": 1},
        "trainer": {"num_steps": 4, "lr": 1e-3, "micro_batch_size": 8, "precision": "fp32"},
        "checkpoint": {"every_steps": 2},
        "eval": {"every_steps": 100},
        "logging": {"report": False},  # 1-2 s of plotting a run: tests/test_report.py draws it
    }
    for section, values in sections.items():
        if isinstance(values, dict):
            raw.setdefault(section, {}).update(values)
        else:
            raw[section] = values
    return raw


def json_to_toml(raw: dict) -> str:
    """A job dict (top-level keys and one table per section) as TOML text."""
    lines = [f"{k} = {json.dumps(v)}" for k, v in raw.items() if not isinstance(v, dict)]
    for section, values in raw.items():
        if isinstance(values, dict):
            lines.append(f"[{section}]")
            lines += [f"{k} = {json.dumps(v)}" for k, v in values.items()]
    return "\n".join(lines) + "\n"


def write_job_file(tmp_path: Path, raw: dict) -> Path:
    """``raw`` as ``tmp_path/job.toml``, for a job run by the CLI in a child process."""
    job_file = tmp_path / "job.toml"
    job_file.write_text(json_to_toml(raw))
    return job_file


def child_env(*extra_paths: Path) -> dict[str, str]:
    """The environment of a job run in a child process: loomrl's src/, the repo root (the
    examples' rewards) and ``extra_paths`` importable, one thread."""
    paths = [str(ROOT / "src"), str(ROOT), *map(str, extra_paths)]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "OMP_NUM_THREADS": "1"}


@pytest.fixture
def tiny_job(tmp_path: Path, tiny_data):
    """``tiny_job(**sections)`` -> a JobConfig for a 4-step job on 400 arithmetic rows."""
    from loomrl.config import build_config

    train, evals = tiny_data

    def make(**sections):
        return build_config(tiny_job_raw(tmp_path, train, evals, **sections))

    return make


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster for the whole test session (``ray``-marked tests only); every
    RayRuntime in the tests finds it initialized, uses it, and leaves it running."""
    ray = pytest.importorskip("ray")
    started = not ray.is_initialized()
    if started:
        ray.init(
            num_cpus=4,
            object_store_memory=300 << 20,
            include_dashboard=False,
            namespace="loomrl-tests",
            runtime_env={
                "env_vars": {
                    "LOOMRL_CPU_FLAGS": os.environ["LOOMRL_CPU_FLAGS"],
                    "PYTHONPATH": os.pathsep.join(
                        [
                            str(ROOT / "src"),
                            str(ROOT / "tests"),
                            str(ROOT),
                            os.environ.get("PYTHONPATH", ""),
                        ]
                    ),
                }
            },
        )
    yield ray
    if started:
        ray.shutdown()
