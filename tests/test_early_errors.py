"""The errors a new user meets first are clear, early and say what to do (issue 55, item
5): vLLM not installed, a model folder without its tokenizer, a prompt column that is not
there, a column the reward takes that the data lacks (found before any model loads), a row
of an in-memory dataset, a dataset folder with several configurations; and a run that fails
before its first step leaves no folder that blocks the next."""

from __future__ import annotations

import importlib.util
import json

import pytest

from loomrl.cli import main
from loomrl.config import ConfigError, build_config
from loomrl.data import DatasetError, load_rows_with_places
from loomrl.job import Job
from loomrl.models.loading import ModelLoadError, load_tokenizer
from loomrl.telemetry.run_status import run_status

from conftest import TINY_MODEL, json_to_toml, tiny_job_raw


@pytest.fixture
def train(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("".join(f'{{"prompt": "{i}+1=", "answer": "{i + 1}"}}\n' for i in range(32)))
    return path


def always_raises(prompt, completion, **row):
    raise ValueError("this reward never scores")


def needs_solution(prompt, completion, solution, **row):
    return float(completion.strip() == solution)


def trl_needs_solution(completions, solution, **kwargs):
    return [float(c == s) for c, s in zip(completions, solution)]


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed")
def test_vllm_not_installed_is_one_line_with_the_install_hint_and_makes_no_folder(
    tmp_path, train, capsys
):
    job = tmp_path / "job.toml"
    job.write_text(json_to_toml(tiny_job_raw(tmp_path, train)))
    out = tmp_path / "out"
    assert main(["run", str(job), "generation.engine=vllm", "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ConfigError: generation.engine.type = 'vllm', but vLLM is not")
    assert "make vllm-env" in err and "pip install 'loomrl[vllm]'" in err
    assert len(err.splitlines()) == 1 and not out.exists()
    # the Python API: the same error, before the run folder is made
    cfg = build_config(tiny_job_raw(tmp_path, train, generation={"engine": "vllm"}))
    with pytest.raises(ConfigError, match=r"make vllm-env"):
        Job(cfg).run()
    assert not (tmp_path / "run").exists()


def test_a_run_that_fails_before_its_first_step_does_not_block_the_next(tmp_path, train):
    bad = tiny_job_raw(tmp_path, train)
    bad["task"] = {"reward": "test_early_errors:always_raises", "max_failure_rate": 0.2}
    bad["task"]["failure_window"] = 8
    with pytest.raises(RuntimeError, match="never scores"):
        Job(build_config(bad)).run()
    assert run_status(tmp_path / "run")["state"] == "failed"
    good = tiny_job_raw(tmp_path, train, trainer={"num_steps": 1})
    result = Job(build_config(good)).run()  # same output_dir, no --overwrite
    assert result.summary["steps"] == 1 and not result.summary.get("job_failed")
    # a run that trained a step still blocks a new one
    with pytest.raises(ValueError, match="already holds a run"):
        Job(build_config(good)).run()


def test_a_model_folder_without_tokenizer_files_names_the_folder_and_the_files(tmp_path, train):
    from loomrl.models.tiny import build_tiny_model

    model, _ = build_tiny_model("llama", hidden_size=32, num_layers=1, num_heads=2)
    folder = tmp_path / "model"
    model.save_pretrained(folder)
    with pytest.raises(ModelLoadError) as err:
        load_tokenizer(str(folder))
    text = str(err.value)
    assert f"model folder {str(folder)!r} has no tokenizer files" in text
    assert "tokenizer.json" in text and "config.json" in text and "save_pretrained" in text
    # with chat prompts, the job says the same, not "has no chat template"
    chat = tmp_path / "chat.jsonl"
    row = {"prompt": [{"role": "user", "content": "1+1="}], "answer": "2"}
    chat.write_text(json.dumps(row) + "\n")
    raw = tiny_job_raw(tmp_path, chat, model={"path": str(folder)})
    raw["task"]["reward"] = "examples.arithmetic.reward:exact_match"
    with pytest.raises(ModelLoadError, match="has no tokenizer files"):
        Job(build_config(raw)).run()


def test_a_missing_prompt_column_lists_the_columns_and_the_key(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"question": "1+1=", "answer": "2"}\n')
    with pytest.raises(DatasetError) as err:
        load_rows_with_places(path)
    assert str(err.value) == (
        f"{path}:1: row has no 'prompt' column (its columns: ['answer', 'question']); set "
        "data.prompt_key to the column that holds the prompt (e.g. data.prompt_key='question')"
    )


@pytest.mark.parametrize("reward", ["needs_solution", "trl_needs_solution"])
def test_a_column_the_reward_takes_is_found_missing_before_the_model_loads(
    tmp_path, train, reward, monkeypatch
):
    import loomrl.session.run as session_run

    def no_training(*args, **kwargs):
        raise AssertionError("the executors started: the check came too late")

    monkeypatch.setattr(session_run, "_train", no_training)
    raw = tiny_job_raw(tmp_path, train)
    raw["task"]["reward"] = f"test_early_errors:{reward}"
    with pytest.raises(DatasetError) as err:
        Job(build_config(raw)).run()
    assert str(err.value).startswith(
        f"{train}:1: the reward 'test_early_errors:{reward}' takes 'solution', which this row "
        "has no column for (its columns: ['answer', 'prompt'])"
    )


def test_a_row_of_an_in_memory_dataset_is_named_by_its_index(tmp_path, monkeypatch):
    monkeypatch.setenv("LOOMRL_CACHE_DIR", str(tmp_path / "cache"))
    rows = [{"prompt": "1+1=", "answer": "2"}, {"question": "2+2=", "answer": "4"}]
    job = Job(
        model=TINY_MODEL,
        dataset=rows,
        reward="examples.arithmetic.reward:exact_match",
        output_dir=str(tmp_path / "run"),
    )
    with pytest.raises(DatasetError) as err:
        job.run()
    assert str(err.value).startswith("in-memory dataset[1]: row has no 'prompt' column")
    assert str(tmp_path / "cache") not in str(err.value)


def test_a_dataset_folder_with_several_configurations_names_them_and_the_key(tmp_path):
    pytest.importorskip("datasets")
    folder = tmp_path / "gsm"
    for name, answer in (("main", "2"), ("socratic", "3")):
        (folder / name).mkdir(parents=True)
        (folder / name / "train.jsonl").write_text(
            json.dumps({"prompt": "1+1=", "answer": answer}) + "\n"
        )
    configs = "".join(
        f"- config_name: {n}\n  data_files:\n  - split: train\n    path: {n}/train.jsonl\n"
        for n in ("main", "socratic")
    )
    (folder / "README.md").write_text(f"---\nconfigs:\n{configs}---\n# gsm\n")
    with pytest.raises(DatasetError) as err:
        load_rows_with_places(folder)
    assert str(err.value) == (
        f"{folder}: holds 2 configurations ['main', 'socratic']; choose one with "
        "data.dataset_config (e.g. data.dataset_config='main')"
    )
    rows, _ = load_rows_with_places(folder, config="socratic")
    assert rows == [{"prompt": "1+1=", "answer": "3"}]
    with pytest.raises(DatasetError, match=r"no configuration 'nope' \(data.dataset_config\)"):
        load_rows_with_places(folder, config="nope")
