"""Jobs on the vLLM engine (``make test-vllm``): async RL steps with live weight updates,
the trainer's log-probs matching the engine's, and a killed generator healed."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vllm not installed (make vllm-env; make test-vllm)")

from test_faults import _assert_complete_and_accounted, _kill_at  # noqa: E402

from loomrl.job import Job  # noqa: E402
from loomrl.telemetry.metrics import read_metrics  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

MODEL = "tiny:llama?hidden_size=64&num_layers=2&num_heads=2&intermediate_size=128"
VLLM = {"type": "vllm", "multiprocessing": False, "cpu_kv_cache_gb": 0.25}


def _vllm_job(tiny_job, tmp_path, **sections):
    sections.setdefault(
        "generation", {"max_new_tokens": 3, "prompts_per_request": 2, "engine": VLLM}
    )
    return tiny_job(
        model={"path": MODEL},
        output_dir=str(tmp_path / "run"),
        **sections,
    )


def test_an_async_job_trains_on_vllm_and_the_trainer_sees_the_engines_logprobs(tiny_job, tmp_path):
    # fp32 publishing: the engine holds the trainer's weights exactly, so on tokens sampled
    # at the trainer's version the two log-probs differ only by kernels.
    cfg = _vllm_job(
        tiny_job,
        tmp_path,
        trainer={"num_steps": 6},
        algorithm={"max_staleness": 1},
        weight_sync={"codec": "delta", "publish_dtype": "float32"},
    )
    result = Job(cfg).run()
    s = result.summary
    assert s["steps"] == 6 and not s.get("job_failed")
    assert s["generated"] == s["trained"] + s["dropped_stale"] + s["failed"] + s["in_flight"]
    records = [r for r in read_metrics(result.run_dir) if "train/loss" in r]
    assert records[-1]["generation/vllm_reloads"] >= 5  # a live update a step, no restart
    assert records[-1]["generation/vllm_restarts"] == 0
    mismatch = [
        r["train/logprob_mismatch_same_version"]
        for r in records
        if "train/logprob_mismatch_same_version" in r
    ]
    assert mismatch and max(mismatch) <= 1e-3, mismatch


def test_a_killed_vllm_generator_is_replaced_and_the_job_completes(tiny_job, tmp_path):
    cfg = _vllm_job(
        tiny_job,
        tmp_path,
        runtime="process",
        trainer={"num_steps": 6},
        checkpoint={"every_steps": 2},
        faults={"min_deadline_s": 60.0, "deadline_factor": 10.0},
        weight_sync={"codec": "delta", "full_every": 1000},
    )
    on_record, killed = _kill_at(3, "process", "generator0")
    result = Job(cfg).run(on_record=on_record)
    assert killed
    faults = _assert_complete_and_accounted(result, cfg)
    assert faults["executor/generator_failures"] == 1
    assert faults["executor/generator_restarts"] == 1
    assert faults["executor/trainer_restarts"] == 0


@pytest.mark.slow
@pytest.mark.timeout(2400)  # a warm-start (unless .cache has one) and two 150-step runs
def test_the_arithmetic_job_on_vllm_reaches_the_hf_engines_accuracy_band(tmp_path):
    import subprocess
    import sys

    from conftest import ROOT

    warm = ROOT / ".cache/arithmetic-warmstart"  # `make demo`'s, when there
    if not (warm / "config.json").is_file():
        warm = tmp_path / "warmstart"
        subprocess.run(
            [sys.executable, "-m", "examples.arithmetic.warmstart", "--out", str(warm)],
            cwd=ROOT,
            check=True,
            capture_output=True,
        )
    ends = {}
    for engine in ("hf", "vllm"):
        overrides = [
            f'model.path="{warm}"',
            "seed=1",
            f'output_dir="{tmp_path / engine}"',
            "trainer.num_steps=150",
            "eval.every_steps=150",
            f'generation.engine.type="{engine}"',
        ]
        if engine == "vllm":
            overrides += ["generation.engine.multiprocessing=false"]
        s = Job.from_toml(ROOT / "examples/arithmetic/job.toml", overrides).run().summary
        assert s["steps"] == 150 and s["eval_end"] >= s["eval_start"] + 0.15, (engine, s)
        ends[engine] = s["eval_end"]
    assert abs(ends["vllm"] - ends["hf"]) <= 0.1, ends  # the same band (200 eval rows)


def test_a_colocated_job_stops_the_vllm_engine_while_the_trainer_steps(tiny_job, tmp_path):
    # One device for both (generation.colocate): on a CPU the engine is stopped for each of
    # the trainer's turns and started again from the verified weights for the next
    # generation, which must then hold the new version (the trainer's log-probs match).
    cfg = _vllm_job(
        tiny_job,
        tmp_path,
        trainer={"num_steps": 4},
        algorithm={"max_staleness": 0},
        weight_sync={"codec": "delta", "publish_dtype": "float32"},
    )
    cfg.generation.colocate = True
    result = Job(cfg).run()
    s = result.summary
    assert s["steps"] == 4 and s["trained"] == 4 * 4 * 4
    records = [r for r in read_metrics(result.run_dir) if "train/loss" in r]
    last = records[-1]
    assert last["generation/vllm_offloads"] >= 3  # stopped for every trainer turn it saw
    assert last["generation/vllm_restarts"] == 0  # a restore is not a failure
    assert last["colocate/switches"] >= 2 * 4
    mismatch = [r["train/logprob_mismatch_same_version"] for r in records]
    assert max(mismatch) <= 1e-3, mismatch  # each restart served the newest weights


def test_a_multi_turn_job_on_the_async_vllm_engine_sends_turns_as_they_come(tiny_job, tmp_path):
    # Each episode's turns are generate calls of their own: on AsyncLLM the calls of the
    # group's episodes overlap in vLLM (the local runtime runs them concurrently).
    cfg = _vllm_job(
        tiny_job,
        tmp_path,
        generation={
            "max_new_tokens": 3,
            "prompts_per_request": 2,
            "engine": {**VLLM, "async_engine": True},
        },
        task={
            "reward": None,
            "environment": "test_env_job:GuessTwice",
            "environment_args": {"bonus": 0.5},
            "max_turns": 3,
        },
        trainer={"num_steps": 3},
        weight_sync={"publish_dtype": "float32"},
    )
    result = Job(cfg).run()
    s = result.summary
    assert s["steps"] == 3 and not s.get("job_failed") and s["failed"] == 0
    assert s["generated"] == s["trained"] + s["dropped_stale"] + s["failed"] + s["in_flight"]
    records = [r for r in read_metrics(result.run_dir) if "train/loss" in r]
    assert records[-1]["generation/vllm_reloads"] >= 2  # live updates between the calls
    assert records[-1]["generation/vllm_restarts"] == 0
    # a turn of a group is one call of 4 requests (its episodes): more at once is calls
    # overlapping in vLLM (25 here)
    assert records[-1]["generation/vllm_peak_requests"] > 4
    assert all(r["rollout/reward_mean"] >= 0.5 for r in records)  # every episode: 2 turns
    mismatch = [  # tokens sampled at the trainer's version match its log-probs: one version each
        r["train/logprob_mismatch_same_version"]
        for r in records
        if "train/logprob_mismatch_same_version" in r
    ]
    assert mismatch and max(mismatch) <= 1e-3, mismatch


def test_the_async_vllm_engine_is_refused_on_the_process_runtime(tiny_job, tmp_path):
    engine = {**VLLM, "async_engine": True}
    with pytest.raises(ValueError, match="async_engine=true cannot run on runtime='process'"):
        _vllm_job(tiny_job, tmp_path, runtime="process", generation={"engine": engine})
