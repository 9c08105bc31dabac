"""docs/python.md's loomrl example (issue 55, item 1), run as it is printed: a TRL-style
``Job(...)`` call with a model object, an in-memory conversational dataset and two TRL reward
functions with weights trains, and its run folder holds what the page says."""

from __future__ import annotations

import re

from loomrl.telemetry.metrics import read_metrics, read_samples

from conftest import ROOT


def doc_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "docs/python.md").read_text(), re.S)


def test_the_loomrl_example_of_docs_python_md_runs_as_printed(tmp_path, monkeypatch, capsys):
    trl_script, example = doc_blocks()[:2]
    assert "from trl import" in trl_script and "from loomrl import Job" in example
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LOOMRL_CACHE_DIR", str(tmp_path / "cache"))
    scope: dict = {"__name__": "__main__"}
    exec(compile(example, "docs/python.md", "exec"), scope)
    result = scope["result"]
    # Job.run() drew its progress bar (rich renders the last state where it is no terminal)
    assert "step 3/3" in capsys.readouterr().out
    assert (tmp_path / result.run_dir).resolve() == tmp_path / "runs/python-example"
    assert result.summary["steps"] == 3 and result.summary["failed"] == 0
    steps = [r for r in read_metrics(result.run_dir) if "train/loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    # each part logged (a record holds what was scored since the one before: a step may
    # have nothing new, so not every record has them)
    assert any("reward/correctness_mean" in r and "reward/brevity_mean" in r for r in steps)
    samples = read_samples(result.run_dir)
    assert samples
    for sample in samples:
        # the dataset's messages, and the text the model saw: the template's, with its BOS
        assert sample["prompt"][0]["role"] == "user"
        assert sample["rendered_prompt"].startswith("<bos><user>What is ")
        assert sample["rendered_prompt"].endswith("</user><assistant>")
        parts = sample["rewards"]
        assert set(parts) == {"correctness", "brevity"}
        assert sample["reward"] == 1.0 * parts["correctness"] + 0.2 * parts["brevity"]
