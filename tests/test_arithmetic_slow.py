"""The arithmetic example for real (slow): warm-start, then async RL with full and with
delta weight sync; both learn, and delta sync reaches the same accuracy as full sync."""

from __future__ import annotations

import subprocess
import sys

import pytest

from loomrl.job import Job

from conftest import ROOT


@pytest.mark.slow
def test_async_arithmetic_with_delta_sync_matches_full_sync(tmp_path):
    model = tmp_path / "warmstart"
    subprocess.run([sys.executable, "-m", "examples.arithmetic.warmstart", "--out", str(model)],
                   cwd=ROOT, check=True, capture_output=True)
    accuracy = {}
    for codec in ("full", "delta"):
        overrides = [f'model.path="{model}"', f'weight_sync.codec="{codec}"', "trainer.num_steps=300",
                     "algorithm.max_staleness=2", f'output_dir="{tmp_path / codec}"', "eval.every_steps=1000"]
        result = Job.from_toml(ROOT / "examples/arithmetic/job.toml", overrides).run()
        s = result.summary
        assert s["generated"] == s["trained"] + s["dropped_stale"] + s["failed"] + s["in_flight"]
        accuracy[codec] = (s["eval_start"], s["eval_end"])
    (start_full, end_full), (start_delta, end_delta) = accuracy["full"], accuracy["delta"]
    assert start_full == start_delta
    assert end_full >= start_full + 0.15 and end_delta >= start_delta + 0.15  # RL learned
    assert abs(end_full - end_delta) <= 0.08  # the same accuracy band (200 eval rows)
