"""One run per run folder: a folder holding a run is refused unless overwritten, a folder
in use is locked, and a folder that cannot be written is refused before any model loads."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loomrl.job import Job
from loomrl.run_folder import RunFolderError, RunFolderLock
from loomrl.telemetry.metrics import read_metrics

from conftest import ROOT, tiny_job_raw


def _steps(run_dir: Path) -> list[int]:
    return [r["step"] for r in read_metrics(run_dir) if "train/loss" in r]


def test_run_into_a_folder_holding_a_run_is_refused_unless_overwrite(tiny_job):
    first = Job(tiny_job(trainer={"num_steps": 3}, checkpoint={"every_steps": 1, "keep": 5})).run()
    summary_before = (first.run_dir / "summary.json").read_text()
    with pytest.raises(RunFolderError, match="already holds a run.*--overwrite"):
        Job(tiny_job(trainer={"num_steps": 1})).run()
    assert (first.run_dir / "summary.json").read_text() == summary_before  # untouched
    assert _steps(first.run_dir) == [1, 2, 3]
    second = Job(tiny_job(trainer={"num_steps": 1}, checkpoint={"every_steps": 1, "keep": 5})).run(
        overwrite=True
    )
    assert second.run_dir == first.run_dir
    assert _steps(second.run_dir) == [1]  # the old run's records are gone, not appended to
    assert [p.name for p in (second.run_dir / "checkpoints").iterdir()] == ["step_000001"]
    assert json.loads((second.run_dir / "summary.json").read_text())["steps"] == 1


def test_a_folder_in_use_by_another_process_is_refused_at_once(tiny_job, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; sys.path.insert(0, 'src'); from loomrl.run_folder import RunFolderLock;"
            f" RunFolderLock(__import__('pathlib').Path({str(run_dir)!r})).acquire(); print('locked', flush=True);"
            " time.sleep(60)",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        t0 = time.perf_counter()
        with pytest.raises(
            RunFolderError, match=rf"in use by another loomrl run \(pid {holder.pid}\)"
        ):
            Job(tiny_job(trainer={"num_steps": 1})).run()
        assert time.perf_counter() - t0 < 2.0
        assert not (run_dir / "config.json").exists()
    finally:
        holder.kill()
        holder.wait()
    lock = RunFolderLock(run_dir)  # the holder died: the lock went with it
    lock.acquire()
    lock.release()


def test_unwritable_output_dir_fails_in_one_line_before_loading_a_model(tmp_path, tiny_data):
    train, _ = tiny_data
    blocker = tmp_path / 'a "file'
    blocker.write_text("not a folder")
    raw = tiny_job_raw(tmp_path, train)
    raw.pop("output_dir")
    job_file = tmp_path / "job.toml"
    job_file.write_text(
        "\n".join(
            f"[{k}]\n" + "\n".join(f"{kk} = {json.dumps(vv)}" for kk, vv in v.items())
            for k, v in raw.items()
            if isinstance(v, dict)
        )
        + "\n"
    )
    target = str(blocker / "run")  # a quote in the path: passed as a value, not as TOML
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "loomrl.cli", "run", str(job_file), "--output-dir", target],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert f"output dir {target!r} is not usable" in lines[0]
    assert time.perf_counter() - t0 < 20  # before the model: no 6 s of loading first


def test_cli_refuses_a_used_output_dir_and_overwrite_replaces_it(tmp_path, tiny_data, capsys):
    from loomrl import cli

    train, _ = tiny_data
    raw = tiny_job_raw(tmp_path, train, trainer={"num_steps": 1})
    raw.pop("output_dir")
    job_file = tmp_path / "job.toml"
    job_file.write_text(
        "\n".join(f"{k} = {json.dumps(v)}" for k, v in raw.items() if not isinstance(v, dict))
        + "\n"
        + "\n".join(
            f"[{k}]\n" + "\n".join(f"{kk} = {json.dumps(vv)}" for kk, vv in v.items())
            for k, v in raw.items()
            if isinstance(v, dict)
        )
        + "\n"
    )
    out = str(tmp_path / "out")
    assert cli.main(["run", str(job_file), "--output-dir", out]) == 0
    capsys.readouterr()
    assert cli.main(["run", str(job_file), "--output-dir", out]) == 2
    assert f"output dir {out!r} already holds a run" in capsys.readouterr().err
    assert (
        cli.main(["run", str(job_file), "--output-dir", out, "--overwrite", "trainer.num_steps=2"])
        == 0
    )
    assert _steps(Path(out)) == [1, 2]


def test_summary_written_on_a_full_disk_is_never_partial(tmp_path, monkeypatch):
    from loomrl.run_folder import write_json_atomically

    path = tmp_path / "summary.json"
    assert write_json_atomically(path, {"steps": 2})

    def full_disk_dump(obj, f, **kwargs):
        f.write('{"steps": ')
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(json, "dump", full_disk_dump)
    assert not write_json_atomically(path, {"steps": 3})
    assert json.loads(path.read_text()) == {"steps": 2}  # the one before, whole
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]  # no temporary file left


def test_an_aborted_step_is_counted_in_the_summary(tmp_path):
    from types import SimpleNamespace

    from loomrl.session.resume import write_failure_summary
    from loomrl.stop_signals import StopSignal

    counts = {
        "generated": 43,
        "trained": 16,
        "dropped_stale": 4,
        "dropped_zero_variance": 3,
        "failed": 2,
        "in_flight": 10,
        "lost_on_resume": 0,
        "prompts_trained_twice": 0,
    }
    controller = SimpleNamespace(
        version=1,
        scorer=SimpleNamespace(first_failures=dict, failure_counts=dict),
        accounting=lambda: {f"rollout/{k}": v for k, v in counts.items()},
    )
    # 8 rollouts were in the step it cut short
    write_failure_summary(tmp_path, controller, StopSignal(15))
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (
        summary["interrupted"] is True
        and summary["stopped_by"] == "SIGTERM"
        and summary["in_step"] == 8
    )
