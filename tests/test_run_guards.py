"""Configs and runs that would hang: rejected at load time, caught by a watchdog, and a
first Ctrl-C that works while the job waits for a batch that never comes."""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loomrl.config import ConfigError, build_config
from loomrl.job import Job
from loomrl.scoring.client import JobFailedError
from loomrl.training.checkpoint import latest_checkpoint

from conftest import ROOT, child_env, tiny_job_raw, write_job_file

BASE = {"data": {"train": "t.jsonl"}, "task": {"reward": "m:f"}}


@pytest.mark.parametrize(("stale", "every"), [(0, 2), (1, 3), (2, 5)])
def test_sync_every_past_max_staleness_plus_one_is_rejected_at_load(stale, every):
    with pytest.raises(
        ConfigError, match=rf"sync_every={every} .*max_staleness={stale}.*<= max_staleness \+ 1"
    ):
        build_config(
            {**BASE, "algorithm": {"max_staleness": stale}, "weight_sync": {"sync_every": every}}
        )
    build_config(
        {**BASE, "algorithm": {"max_staleness": stale}, "weight_sync": {"sync_every": stale + 1}}
    )


def test_generators_stuck_on_an_old_version_fail_the_job_instead_of_spinning(tiny_job):
    cfg = tiny_job(algorithm={"max_staleness": 0}, trainer={"num_steps": 3})
    cfg.weight_sync.sync_every = 2  # past the load-time check: generators stay at version 0
    t0 = time.perf_counter()
    with pytest.raises(JobFailedError, match="dropped as too stale without one training step"):
        Job(cfg).run()
    assert time.perf_counter() - t0 < 60


def test_no_step_for_stall_warning_s_is_logged(tiny_job, tmp_path, caplog):
    (tmp_path / "slow_reward_mod.py").write_text(
        "import time\ndef reward(prompt, completion, **row):\n    time.sleep(0.6)\n    return 0.0\n"
    )
    sys.path.insert(0, str(tmp_path))
    try:
        cfg = tiny_job(
            task={"reward": "slow_reward_mod:reward", "reward_timeout_s": 10.0},
            trainer={"num_steps": 1},
            data={"eval": None},
            stall_warning_s=0.3,
        )
        with caplog.at_level(logging.WARNING, logger="loomrl.control.watchdog"):
            Job(cfg).run()
    finally:
        sys.path.remove(str(tmp_path))
    assert any("no training step completed for" in r.getMessage() for r in caplog.records)


def test_first_ctrl_c_stops_a_run_waiting_for_a_batch_that_never_comes(tmp_path, tiny_data):
    train, _ = tiny_data
    # the first two steps' rollouts score, then scoring hangs
    (tmp_path / "hang_reward.py").write_text(
        "import time\nCALLS = [0]\n"
        "def reward(prompt, completion, **row):\n"
        "    CALLS[0] += 1\n"
        "    if CALLS[0] > 40:\n        time.sleep(120)\n"
        "    return float(len(completion))\n"
    )
    raw = tiny_job_raw(
        tmp_path,
        train,
        None,
        task={"reward": "hang_reward:reward", "reward_timeout_s": 100.0},
        trainer={"num_steps": 50},
        checkpoint={"every_steps": 1000},
    )
    job_file = write_job_file(tmp_path, raw)
    run_dir = Path(raw["output_dir"])
    env = child_env(tmp_path)
    proc = subprocess.Popen(
        [sys.executable, "-m", "loomrl.cli", "run", str(job_file)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.time() + 90
    metrics = run_dir / "metrics.jsonl"
    while (
        time.time() < deadline
        and proc.poll() is None
        and not (metrics.is_file() and metrics.read_text())
    ):
        time.sleep(0.1)
    time.sleep(3)  # now waiting on the hung reward
    proc.send_signal(signal.SIGINT)
    t0 = time.time()
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr[-2000:]
    assert time.time() - t0 < 20  # not the reward's 120 s, and no second Ctrl-C needed
    last = latest_checkpoint(run_dir / "checkpoints")
    assert last is not None and f"continues from {last.name}" in stderr
    assert json.loads((run_dir / "summary.json").read_text())["interrupted"] is True
