"""``loomrl eval JOB.toml [--checkpoint DIR]``: the held-out prompts completed greedily and
scored on a checkpoint's weights, no step trained; results printed and written to
``eval.json``, every completion to ``eval_samples.jsonl``."""

from __future__ import annotations

import json

import pytest

from loomrl.cli import main
from loomrl.config import build_config
from loomrl.job import Job
from loomrl.telemetry.metrics import read_metrics

from conftest import json_to_toml, tiny_job_raw


def varied_reward(prompt, completion, **row):
    """Differs between almost any two completions: two sets of weights score apart."""
    return float(sum(map(ord, completion)) % 17)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A two-step run with an eval set, its job file, and its checkpoint at step 2."""
    tmp = tmp_path_factory.mktemp("eval_command")
    src = [json.loads(line) for line in open("examples/arithmetic/train.jsonl")]
    train, evals = tmp / "train.jsonl", tmp / "eval.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in src[:64]))
    evals.write_text("".join(json.dumps(r) + "\n" for r in src[400:412]))
    raw = tiny_job_raw(
        tmp, train, evals, trainer={"num_steps": 2, "lr": 0.1}, generation={"max_new_tokens": 6}
    )
    raw["task"]["reward"] = "test_eval_command:varied_reward"
    result = Job(build_config(raw)).run()
    # the two steps changed what the model answers: an eval tells the weights apart
    assert result.summary["eval_start"] != result.summary["eval_end"]
    job = tmp / "job.toml"
    job.write_text(json_to_toml({**raw, "output_dir": ""}))
    return job, result


def evaluate(job, out, *args):
    assert main(["eval", str(job), "--output-dir", str(out), *args]) == 0
    results = json.loads((out / "eval.json").read_text())
    samples = [json.loads(line) for line in (out / "eval_samples.jsonl").read_text().splitlines()]
    return results, samples


def test_eval_of_a_checkpoint_scores_its_weights_and_saves_every_completion(
    trained, tmp_path, capsys
):
    job, result = trained
    checkpoint = result.run_dir / "checkpoints" / "step_000002"
    results, samples = evaluate(job, tmp_path / "ckpt", "--checkpoint", str(checkpoint))
    out = capsys.readouterr().out
    assert f"  weights      {checkpoint}\n" in out
    assert f"  samples      {tmp_path / 'ckpt' / 'eval_samples.jsonl'}\n" in out
    # the training run's last evaluation was of these weights: the same greedy completions
    assert results["eval/mean_reward"] == result.summary["eval_end"]
    assert results["checkpoint"] == str(checkpoint) and results["eval/version"] == 2
    assert len(samples) == results["num_prompts"] == 12
    assert all(s["status"] == "ok" for s in samples)
    rewards = [s["reward"] for s in samples]
    assert results["eval/mean_reward"] == pytest.approx(sum(rewards) / len(rewards))
    assert {s["index"] for s in samples} == set(range(12))
    assert all(s["prompt"] == s["row"]["prompt"] for s in samples)
    # the same completions as the training run's own last evaluation, which it saved too
    run_samples = [
        json.loads(line)
        for line in (result.run_dir / "eval_samples.jsonl").read_text().splitlines()
    ]
    assert [s["version"] for s in run_samples] == [0] * 12 + [2] * 12
    assert [s["completion"] for s in run_samples[12:]] == [s["completion"] for s in samples]
    assert [s["completion"] for s in run_samples[:12]] != [s["completion"] for s in samples]
    # no step trained: the folder holds no checkpoint and no final model
    assert not (tmp_path / "ckpt" / "checkpoints").exists()
    assert not (tmp_path / "ckpt" / "final").exists()
    # the run's final model folder holds the same weights
    final, final_samples = evaluate(
        job, tmp_path / "final", "--checkpoint", str(result.run_dir / "final")
    )
    assert [s["completion"] for s in final_samples] == [s["completion"] for s in samples]
    assert final["eval/mean_reward"] == results["eval/mean_reward"]


def test_eval_without_a_checkpoint_scores_the_jobs_model(trained, tmp_path):
    job, result = trained
    results, samples = evaluate(job, tmp_path / "base")
    assert results["eval/mean_reward"] == result.summary["eval_start"]
    assert results["checkpoint"] is None and results["eval/version"] == 0
    assert [r for r in read_metrics(tmp_path / "base") if "eval/mean_reward" in r]


def test_eval_without_an_eval_set_says_how_to_give_one(trained, tmp_path, capsys):
    job, _ = trained
    assert main(["eval", str(job), "data.eval=null", "--output-dir", str(tmp_path / "x")]) == 2
    assert "data.eval is not set" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_a_resume_drops_the_evaluations_after_its_checkpoint(tmp_path):
    from loomrl.session.resume import cut_record

    (tmp_path / "checkpoints" / "step_000002").mkdir(parents=True)
    lines = [json.dumps({"version": v, "completion": str(v)}) for v in (0, 2, 4, 4)]
    (tmp_path / "eval_samples.jsonl").write_text("\n".join(lines) + "\n")
    cut_record(tmp_path, tmp_path / "checkpoints" / "step_000002", 2)
    kept = (tmp_path / "eval_samples.jsonl").read_text().splitlines()
    assert [json.loads(line)["version"] for line in kept] == [0, 2]
