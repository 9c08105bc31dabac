"""SIGTERM and SIGHUP stop a job as a first Ctrl-C does (issue 41, finding 4): the step in
progress is checkpointed, summary.json is written with accounting that adds up, the shm
weight channel is removed, also when the signal goes to the whole process group (systemd,
docker, Slurm), and ``loomrl resume`` continues."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from loomrl.training.checkpoint import checkpoint_step, latest_checkpoint

from conftest import ROOT, child_env, tiny_job_raw, write_job_file


def _default_signals() -> None:
    """In the job's process: default dispositions, whatever the test runner inherited."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)


def _start(
    tmp_path: Path, tiny_data, new_group: bool, **sections
) -> tuple[subprocess.Popen, Path, dict]:
    train, _ = tiny_data
    raw = tiny_job_raw(
        tmp_path,
        train,
        None,
        trainer={"num_steps": 200},
        checkpoint={"every_steps": 1000},
        **sections,
    )
    job_file = write_job_file(tmp_path, raw)
    env = child_env()
    proc = subprocess.Popen(
        [sys.executable, "-m", "loomrl.cli", "run", str(job_file)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_default_signals,
        start_new_session=new_group,
    )
    return proc, Path(raw["output_dir"]), raw


def _wait_for_steps(
    proc: subprocess.Popen, run_dir: Path, steps: int, timeout_s: float = 120
) -> None:
    metrics, deadline = run_dir / "metrics.jsonl", time.time() + timeout_s
    while time.time() < deadline and proc.poll() is None:
        if (
            metrics.is_file()
            and sum('"step"' in line for line in metrics.read_text().splitlines()) >= steps
        ):
            return
        time.sleep(0.1)
    proc.kill()
    pytest.fail(
        f"the job made fewer than {steps} steps in {timeout_s} s: {proc.communicate()[1][-2000:]}"
    )


def _shm_files_of(proc: subprocess.Popen) -> set[str]:
    """The /dev/shm files the job's processes have mapped (its weight channel)."""
    found = set()
    for p in [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]:
        try:
            found |= {m.path for m in p.memory_maps() if m.path.startswith("/dev/shm/loomrl-")}
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def _check_summary(run_dir: Path) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["interrupted"] is True
    parts = ("trained", "dropped_stale", "failed", "in_flight")
    assert summary["generated"] == sum(summary[k] for k in parts) + summary.get("in_step", 0), (
        summary
    )
    return summary


def test_sigterm_checkpoints_the_current_step_and_resume_continues(tmp_path, tiny_data):
    proc, run_dir, _ = _start(tmp_path, tiny_data, new_group=False)
    _wait_for_steps(proc, run_dir, 3)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-2000:]
    last = latest_checkpoint(run_dir / "checkpoints")
    assert last is not None and checkpoint_step(last) >= 3, stderr[-2000:]
    assert f"continues from {last.name}" in stderr
    assert _check_summary(run_dir)["steps"] == checkpoint_step(last)
    config = json.loads((run_dir / "config.json").read_text())
    config["trainer"]["num_steps"] = checkpoint_step(last) + 1  # a short resume
    (run_dir / "config.json").write_text(json.dumps(config))
    env = child_env()
    resumed = subprocess.run(
        [sys.executable, "-m", "loomrl.cli", "resume", str(run_dir)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == checkpoint_step(last) + 1


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_signal_to_the_process_group_leaves_a_checkpoint_and_no_shm(tmp_path, tiny_data, sig):
    proc, run_dir, _ = _start(
        tmp_path, tiny_data, new_group=True, runtime="process", weight_sync={"transport": "shm"}
    )
    _wait_for_steps(proc, run_dir, 2, timeout_s=180)
    channel = _shm_files_of(proc)
    assert channel, "the job maps no /dev/shm/loomrl-* file"
    os.killpg(proc.pid, sig)  # as systemd, docker and Slurm do: every process of the job
    _, stderr = proc.communicate(timeout=90)
    assert proc.returncode == 128 + sig, stderr[-2000:]
    assert latest_checkpoint(run_dir / "checkpoints") is not None, stderr[-2000:]
    _check_summary(run_dir)
    prefixes = {path.split(".")[0] for path in channel}  # /dev/shm/loomrl-<channel>
    left = [str(p) for p in Path("/dev/shm").glob("loomrl-*") if str(p).split(".")[0] in prefixes]
    assert not left, f"shm left behind: {left}"


def test_sigterm_outside_training_raises_once_and_handlers_are_restored(caplog):
    from loomrl.stop_signals import StopSignal, raise_on_stop_signals

    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGHUP)}
    if signal.SIG_IGN in before.values():
        pytest.skip("the test runner ignores SIGTERM or SIGHUP")
    with pytest.raises(StopSignal, match="stopped by SIGTERM"), raise_on_stop_signals():
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # (the handler raises here)
        finally:  # cleanup in progress: a second one is logged, not raised
            os.kill(os.getpid(), signal.SIGHUP)
            time.sleep(0.1)
    assert "SIGHUP again: still cleaning up" in caplog.text
    assert {sig: signal.getsignal(sig) for sig in before} == before


def test_a_signal_ignored_where_the_job_starts_stays_ignored():
    from loomrl.stop_signals import raise_on_stop_signals

    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as under nohup
    try:
        with raise_on_stop_signals():
            os.kill(os.getpid(), signal.SIGHUP)
            time.sleep(0.1)
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, previous)
