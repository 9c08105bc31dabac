"""``[logging.wandb]``: every record and each step's samples go to W&B under a run id that
follows the run folder (a resume continues it); offline mode needs no network; a missing
wandb package is a clear error."""

from __future__ import annotations

import importlib.machinery
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from loomrl.job import Job, resume_job


class FakeRun:
    def __init__(self, calls, kwargs):
        self.calls, self.kwargs = calls, kwargs

    def log(self, data, step=None):
        self.calls.append(("log", data, step))

    def finish(self):
        self.calls.append(("finish",))


@pytest.fixture
def fake_wandb(monkeypatch):
    calls: list = []
    module = types.ModuleType("wandb")
    module.__spec__ = importlib.machinery.ModuleSpec("wandb", None)  # find_spec asks for it

    def init(**kwargs):
        calls.append(("init", kwargs))
        return FakeRun(calls, kwargs)

    class Table:
        def __init__(self, columns):
            self.columns, self.rows = columns, []

        def add_data(self, *row):
            self.rows.append(row)

    def settings(**kwargs):
        return kwargs

    module.init, module.Table, module.Settings = init, Table, settings
    monkeypatch.setitem(sys.modules, "wandb", module)
    return calls


def test_records_and_samples_reach_wandb_and_resume_keeps_the_run(tiny_job, fake_wandb):
    wandb = {"project": "p", "mode": "offline", "tags": ["t"]}
    cfg = tiny_job(trainer={"num_steps": 2}, logging={"wandb": wandb, "report": False})
    result = Job(cfg).run()
    inits = [c[1] for c in fake_wandb if c[0] == "init"]
    assert len(inits) == 1
    first = inits[0]
    assert first["project"] == "p" and first["mode"] == "offline" and first["tags"] == ["t"]
    assert first["dir"] == str(result.run_dir) and first["resume"] == "allow"
    assert first["config"]["trainer"]["num_steps"] == 2
    logs = [(c[1], c[2]) for c in fake_wandb if c[0] == "log"]
    steps = {step for data, step in logs if "rollout/reward_mean" in data}
    assert steps == {1, 2}
    tables = [data["samples"] for data, _ in logs if "samples" in data]
    columns = ["step", "prompt", "rendered_prompt", "completion", "reward", "rewards"]
    assert tables and tables[0].columns == columns
    assert all(
        isinstance(row[2], str) and isinstance(row[3], str) for t in tables for row in t.rows
    )
    assert first["settings"] == {"quiet": True}
    assert fake_wandb[-1] == ("finish",)
    resume_job(result.run_dir, overrides=["trainer.num_steps=3"])
    again = [c[1] for c in fake_wandb if c[0] == "init"]
    assert len(again) == 2 and again[1]["id"] == first["id"]


def test_a_missing_wandb_package_is_a_clear_error(tiny_job, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    cfg = tiny_job(trainer={"num_steps": 1}, logging={"wandb": {}})
    with pytest.raises(RuntimeError, match=r"logging.wandb is set but the wandb package is not"):
        Job(cfg).run()


def test_offline_mode_writes_a_local_run_with_the_records(tiny_job, tmp_path):
    pytest.importorskip("wandb")
    # in a fresh interpreter: wandb's service and module state outlive a run in this one
    cfg = tiny_job(trainer={"num_steps": 1}, logging={"wandb": {"mode": "offline"}})
    script = (
        "import sys, json; from loomrl.config import build_config; from loomrl.job import Job; "
        "Job(build_config(json.loads(sys.argv[1]))).run()"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [sys.executable, "-c", script, cfg.model_dump_json()],
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    # quiet: no history and summary tables at the end (issue 55)
    assert "Run summary" not in done.stdout + done.stderr
    assert "Run history" not in done.stdout + done.stderr
    files = list((Path(cfg.output_dir) / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1
    assert b"rollout/reward_mean" in files[0].read_bytes()
