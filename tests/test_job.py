"""End-to-end jobs with a tiny model: exact resume, kill -9 and resume, corrupted
checkpoints, bad paths, the final model, and the accounting identity."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loomrl.config import build_config
from loomrl.data import DatasetError
from loomrl.job import Job, resume_job
from loomrl.models import ModelLoadError
from loomrl.telemetry.metrics import read_metrics
from loomrl.training.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint

from conftest import ROOT, json_to_toml, tiny_job_raw


def length_reward(prompt, completion, **row):
    """Varies with the sample, so advantages (and the loss) are not zero."""
    return float(len(completion.strip())) / 3.0


LENGTH_REWARD = "test_job:length_reward"


def step_records(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(run_dir) if "train/loss" in r}


def test_sync_resume_gives_bit_identical_next_step_loss(tiny_job, tmp_path):
    sync = {"algorithm": {"max_staleness": 0}, "task": {"reward": LENGTH_REWARD}}
    full = Job(tiny_job(**sync, trainer={"num_steps": 3}, output_dir=str(tmp_path / "a"))).run()
    part = Job(tiny_job(**sync, trainer={"num_steps": 2}, output_dir=str(tmp_path / "b"))).run()
    assert [p.name for p in (part.run_dir / "checkpoints").iterdir()] == ["step_000002"]
    with pytest.raises(ValueError, match=r"model.path cannot change on resume"):
        resume_job(part.run_dir, overrides=["model.path='tiny:qwen2'"])
    resumed = resume_job(part.run_dir, overrides=["trainer.num_steps=3"])  # train on past the end
    a, b = step_records(full.run_dir), step_records(resumed.run_dir)
    assert a[3]["train/loss"] != 0.0
    assert a[3]["train/loss"] == b[3]["train/loss"]  # bit-identical, not approximately equal
    assert a[3]["train/grad_norm"] == b[3]["train/grad_norm"]
    assert a[3]["rollout/reward_mean"] == b[3]["rollout/reward_mean"]
    # and the uninterrupted run is itself deterministic step by step
    assert a[1]["train/loss"] == b[1]["train/loss"] and a[2]["train/loss"] == b[2]["train/loss"]


def test_run_writes_run_folder_and_final_model_loads_with_transformers(tiny_job):
    result = Job(tiny_job(trainer={"num_steps": 2})).run()
    run = result.run_dir
    assert (run / "config.json").is_file() and (run / "summary.json").is_file()
    assert latest_checkpoint(run / "checkpoints").name == "step_000002"
    s = result.summary
    assert s["generated"] == s["trained"] + s["dropped_stale"] + s["failed"] + s["in_flight"]
    assert s["trained"] == 2 * 4 * 4
    records = read_metrics(run)
    keys = set().union(*records)
    # traces: 'auto' is on for local
    for key in (
        "rollout/staleness_mean",
        "throughput/samples_per_s",
        "executor/trainer_busy_frac",
        "train/entropy",
        "train/clip_fraction",
        "weight_sync/bytes_sent",
        "eval/mean_reward",
        "generation/traced_forwards",
        "train/traced_forwards",
    ):
        assert key in keys, key
    # The generator's side of weight sync, renamed, with what it applied by the last step.
    applied = [
        r["weight_sync/generator_num_applied"]
        for r in records
        if "weight_sync/generator_num_applied" in r
    ]
    assert applied and applied[-1] >= 1
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(run / "final")
    tok = AutoTokenizer.from_pretrained(run / "final")
    assert model.config.vocab_size == len(tok)


def test_job_keyword_api(tmp_path, tiny_data):
    from conftest import TINY_MODEL

    train, evals = tiny_data
    job = Job(
        model=TINY_MODEL,
        dataset=str(train),
        reward="examples.arithmetic.reward:exact_match",
        group_size=4,
        groups_per_step=2,
        max_staleness=2,
        num_steps=2,
        output_dir=str(tmp_path / "kw"),
    )
    result = job.run()
    assert result.summary["steps"] == 2
    with pytest.raises(
        TypeError, match=r"Job\(modle=...\): unknown keyword \(did you mean model\?"
    ):
        Job(modle="tiny:llama")


def test_corrupted_checkpoint_is_refused(tiny_job):
    result = Job(tiny_job(trainer={"num_steps": 2})).run()
    ckpt = latest_checkpoint(result.run_dir / "checkpoints")
    state = ckpt / "state.pt"
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0xFF
    state.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupted"):
        load_checkpoint(ckpt)
    with pytest.raises(CheckpointError, match="corrupted"):
        resume_job(result.run_dir)
    (ckpt / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="incomplete"):
        load_checkpoint(ckpt)


def test_missing_model_and_dataset_paths_fail_clearly(tiny_job, tmp_path):
    with pytest.raises(ModelLoadError, match="not a local Hugging Face model folder"):
        Job(tiny_job(model={"path": str(tmp_path / "no-model")})).run()
    with pytest.raises(DatasetError, match="dataset file not found"):
        Job(tiny_job(data={"train": str(tmp_path / "none.jsonl")})).run()
    with pytest.raises(CheckpointError, match="nothing to resume"):
        Job(tiny_job()).run(resume=True)


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if (
                entry.name.isdigit()
                and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid
            ):
                found.append(int(entry.name))
        except (OSError, IndexError, ValueError):
            continue
    return found


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _all_gone(pids: list[int], timeout_s: float = 30.0) -> bool:
    deadline = time.time() + timeout_s
    while time.time() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    return not any(_alive(p) for p in pids)


def _shm_files() -> set[str]:
    return (
        {p.name for p in Path("/dev/shm").glob("loomrl-*")} if Path("/dev/shm").is_dir() else set()
    )


def _shm_held_by(pids: list[int]) -> set[str]:
    """The loomrl shm files that these processes map or hold open: this job's weight
    channel, whatever other jobs on the machine create meanwhile."""
    found: set[str] = set()
    for pid in pids:
        try:
            lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
            fds = [str(fd.readlink()) for fd in Path(f"/proc/{pid}/fd").iterdir()]
        except OSError:
            continue
        for path in [line.split()[-1] for line in lines if len(line.split()) >= 6] + fds:
            if path.startswith("/dev/shm/loomrl-"):
                found.add(path.removeprefix("/dev/shm/").removesuffix(" (deleted)"))
    return found


@pytest.mark.parametrize("runtime", ["local", "process"])
def test_async_run_killed_and_resumed_loses_and_duplicates_no_prompt(tmp_path, tiny_data, runtime):
    train, evals = tiny_data
    raw = tiny_job_raw(
        tmp_path,
        train,
        None,
        algorithm={"max_staleness": 2},
        runtime=runtime,
        trainer={"num_steps": 40},
        checkpoint={"every_steps": 5, "keep": 50},
    )
    job_file = tmp_path / "job.toml"
    job_file.write_text(json_to_toml(raw))
    run_dir = Path(raw["output_dir"])
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    shm_at_start = _shm_files()
    proc = subprocess.Popen(
        [sys.executable, "-m", "loomrl.cli", "run", str(job_file)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if max(step_records(run_dir), default=0) >= 12:
            break
        time.sleep(0.1)
    assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
    executors = _children(proc.pid)
    job_shm = (_shm_files() - shm_at_start) & _shm_held_by([proc.pid, *executors])
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert _all_gone(executors)  # executor processes notice the controller is gone and exit
    if runtime == "process":
        assert len(executors) >= 2 and job_shm  # trainer, generator; their weight channel
        assert not job_shm & _shm_files()  # the trainer removed it on its way out
    killed_at = max(step_records(run_dir))
    last = latest_checkpoint(run_dir / "checkpoints")
    assert last is not None and int(last.name.split("_")[1]) < 40
    result = resume_job(run_dir)
    assert result.summary["steps"] == 40
    final = load_checkpoint(latest_checkpoint(run_dir / "checkpoints"))
    trained = final["controller"]["stream"]["trained"]
    assert len(trained) == 40 * 4 and len(set(trained)) == len(trained)  # nothing twice
    # every prompt trained before the last pre-crash checkpoint is still trained, once
    before = load_checkpoint(last)["controller"]["stream"]["trained"]
    assert trained[: len(before)] == before
    s = result.summary
    assert s["generated"] == s["trained"] + s["dropped_stale"] + s["failed"] + s["in_flight"]
    assert killed_at >= 12


def test_build_config_rejects_unknown_section():
    with pytest.raises(ValueError, match="unknown key"):
        build_config({"data": {"train": "x"}, "task": {"reward": "a:b"}, "trainr": {}})


def test_lora_job_syncs_only_the_adapter_and_saves_a_merged_model(tiny_job):
    cfg = tiny_job(
        model={"lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}},
        task={"reward": LENGTH_REWARD},
        trainer={"num_steps": 2},
    )
    result = Job(cfg).run()
    records = [r for r in read_metrics(result.run_dir) if "weight_sync/bytes_full" in r]
    full_model = Job(
        tiny_job(trainer={"num_steps": 1}, output_dir=str(result.run_dir) + "-full")
    ).run()
    full_records = [r for r in read_metrics(full_model.run_dir) if "weight_sync/bytes_full" in r]
    assert records[-1]["weight_sync/bytes_full"] < full_records[-1]["weight_sync/bytes_full"] / 5
    mismatch = [
        r["train/logprob_mismatch_same_version"]
        for r in records
        if "train/logprob_mismatch_same_version" in r
    ]
    # the generator runs the trainer's adapter (bf16-rounded)
    assert mismatch and max(mismatch) < 0.01
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(result.run_dir / "final")  # merged: loads without peft
    assert (result.run_dir / "final" / "adapter" / "adapter_config.json").is_file()


@pytest.mark.parametrize("runtime", ["local", "process"])
def test_ctrl_c_checkpoints_the_current_step_and_names_it_for_resume(tmp_path, tiny_data, runtime):
    train, _ = tiny_data
    raw = tiny_job_raw(
        tmp_path,
        train,
        None,
        runtime=runtime,
        trainer={"num_steps": 400},
        checkpoint={"every_steps": 1000},
    )
    job_file = tmp_path / "job.toml"
    job_file.write_text(json_to_toml(raw))
    run_dir = Path(raw["output_dir"])
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "loomrl.cli", "run", str(job_file)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.time() + 120
    while (
        time.time() < deadline and proc.poll() is None and max(step_records(run_dir), default=0) < 3
    ):
        time.sleep(0.1)
    executors = _children(proc.pid)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr[-2000:]
    last = latest_checkpoint(run_dir / "checkpoints")
    assert f"loomrl resume {run_dir}` continues from {last.name}" in stderr
    assert "Traceback" not in stderr
    assert _all_gone(executors)
    # the run stopped after a whole step and checkpointed exactly that step
    assert int(last.name.split("_")[1]) == max(step_records(run_dir)) < 400
    assert json.loads((run_dir / "summary.json").read_text())["interrupted"] is True
    assert not (run_dir / "final").exists()


def test_sync_run_is_bit_identical_on_uvloop_and_asyncio(tiny_job, tmp_path):
    """The controller's event loop orders callbacks its own way; a synchronous run's
    numbers must not depend on it (and the summary names the loop that ran)."""
    pytest.importorskip("uvloop")
    sync = {
        "algorithm": {"max_staleness": 0},
        "task": {"reward": LENGTH_REWARD},
        "trainer": {"num_steps": 3},
    }
    runs = {
        loop: Job(tiny_job(**sync, event_loop=loop, output_dir=str(tmp_path / loop))).run()
        for loop in ("asyncio", "uvloop")
    }
    assert {loop: r.summary["event_loop"] for loop, r in runs.items()} == {
        "asyncio": "asyncio",
        "uvloop": "uvloop",
    }
    a, b = (step_records(r.run_dir) for r in runs.values())
    assert sorted(a) == sorted(b) == [1, 2, 3]
    for step in a:
        for key in ("train/loss", "train/grad_norm", "rollout/reward_mean"):
            assert a[step][key] == b[step][key], (step, key)
    assert a[3]["train/loss"] != 0.0


def test_event_loop_uvloop_without_uvloop_fails_before_anything_starts(tiny_job, monkeypatch):
    from loomrl.config import ConfigError
    from loomrl.session import event_loop_factory

    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop now raises ImportError
    assert event_loop_factory("auto") is None  # auto falls back to asyncio's loop
    assert event_loop_factory("asyncio") is None
    cfg = tiny_job(event_loop="uvloop")
    with pytest.raises(ConfigError, match="uvloop is not installed"):
        Job(cfg).run()
    assert not Path(cfg.output_dir).exists()  # no run folder made
