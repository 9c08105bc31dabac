"""Data sources: JSON arrays, dataset folders (save_to_disk, hub-style files with splits) and
in-memory datasets handed to ``Job``; each bad source fails naming the file and what to do."""

from __future__ import annotations

import json

import pytest

from loomrl.data import DatasetError, load_rows, load_rows_with_places
from loomrl.data_sources import materialize

datasets = pytest.importorskip("datasets")
pq = pytest.importorskip("pyarrow.parquet")
pa = pytest.importorskip("pyarrow")

ROWS = [{"prompt": f"{a}+{a}=", "answer": str(2 * a)} for a in range(5)]


def test_a_json_array_file_reads_with_item_places(tmp_path):
    path = tmp_path / "rows.json"
    path.write_text("\n  " + json.dumps(ROWS, indent=2))
    rows, places = load_rows_with_places(path)
    assert rows == ROWS
    assert places[2] == f"{path} item 3"
    path.write_text(json.dumps([{"prompt": "a"}, {"question": "b"}]))
    with pytest.raises(DatasetError, match=rf"{path} item 2: row has no 'prompt' column"):
        load_rows(path)
    path.write_text('[{"prompt": "a"},\n {"prompt": }]')
    with pytest.raises(DatasetError, match=rf"{path}:2: not valid JSON"):
        load_rows(path)
    lines = tmp_path / "lines.json"  # JSON lines in a .json file still read as lines
    lines.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    assert load_rows_with_places(lines)[1][0] == f"{lines}:1"


def test_a_save_to_disk_dataset_and_dataset_dict_read_by_split(tmp_path):
    ds = datasets.Dataset.from_list(ROWS)
    ds.save_to_disk(str(tmp_path / "one"))
    rows, places = load_rows_with_places(tmp_path / "one")
    assert rows == ROWS and places[0] == f"{tmp_path / 'one'}[train] row 1"
    both = datasets.DatasetDict({"train": ds, "test": ds.select([0, 1])})
    both.save_to_disk(str(tmp_path / "both"))
    assert load_rows(tmp_path / "both", split="test") == ROWS[:2]
    with pytest.raises(DatasetError, match=r"no split 'validation'.*\['test', 'train'\]"):
        load_rows(tmp_path / "both", split="validation")


def test_a_hub_style_folder_finds_splits_from_file_names(tmp_path):
    folder = tmp_path / "gsm8k-copy" / "main"
    folder.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(ROWS[:3]), folder / "train-00000-of-00001.parquet")
    pq.write_table(pa.Table.from_pylist(ROWS[3:]), folder / "test-00000-of-00001.parquet")
    assert load_rows(tmp_path / "gsm8k-copy") == ROWS[:3]
    assert load_rows(tmp_path / "gsm8k-copy", split="test") == ROWS[3:]
    with pytest.raises(DatasetError, match=r"no split 'dev'"):
        load_rows(tmp_path / "gsm8k-copy", split="dev")
    empty = tmp_path / "empty"
    (empty / "sub").mkdir(parents=True)
    (empty / "notes.txt").write_text("hello")
    with pytest.raises(DatasetError, match=r"a folder with no data files"):
        load_rows(empty)


def test_a_folder_without_the_prompt_column_names_the_row(tmp_path):
    datasets.Dataset.from_list([{"question": "1+1="}]).save_to_disk(str(tmp_path / "q"))
    with pytest.raises(DatasetError, match=r"q\[train\] row 1: row has no 'prompt' column"):
        load_rows(tmp_path / "q")
    assert load_rows(tmp_path / "q", prompt_key="question") == [{"question": "1+1="}]


def test_materialize_writes_once_by_content(tmp_path, monkeypatch):
    monkeypatch.setenv("LOOMRL_CACHE_DIR", str(tmp_path / "cache"))
    ds = datasets.Dataset.from_list(ROWS)
    first = materialize(ds)
    assert first.startswith(str(tmp_path / "cache")) and load_rows(first) == ROWS
    assert materialize(datasets.Dataset.from_list(ROWS)) == first  # same rows, same folder
    other = materialize(datasets.Dataset.from_list(ROWS[:2]))
    assert other != first and load_rows(other) == ROWS[:2]
    rows_path = materialize(ROWS)
    assert rows_path.endswith(".jsonl") and load_rows(rows_path) == ROWS
    assert materialize(list(ROWS)) == rows_path
    assert materialize("some/file.jsonl") == "some/file.jsonl"
    with pytest.raises(TypeError, match=r"DatasetDict with splits \['train'\]: pass one split"):
        materialize(datasets.DatasetDict({"train": ds}))
    with pytest.raises(TypeError, match=r"dataset\[1\] is a str, expected a dict"):
        materialize([{"prompt": "a"}, "b"], "dataset")
    with pytest.raises(TypeError, match="must be a path, a datasets.Dataset"):
        materialize(42)


def test_job_trains_from_a_datasets_object(tmp_path, monkeypatch, tiny_data):
    from loomrl import Job

    from conftest import TINY_MODEL

    monkeypatch.setenv("LOOMRL_CACHE_DIR", str(tmp_path / "cache"))
    train, _ = tiny_data
    rows = [json.loads(line) for line in train.read_text().splitlines()][:64]
    job = Job(
        model=TINY_MODEL,
        dataset=datasets.Dataset.from_list(rows),
        eval_dataset=rows[:8],
        reward="examples.arithmetic.reward:exact_match",
        group_size=4,
        groups_per_step=2,
        num_steps=2,
        output_dir=str(tmp_path / "run"),
    )
    assert job.config.data.train.startswith(str(tmp_path / "cache"))
    result = job.run()
    assert result.summary["steps"] == 2


@pytest.mark.parametrize("where", ["../secret.jsonl", "{outside}", "sub/../../secret.jsonl"])
def test_a_readme_pointing_data_files_outside_the_folder_is_refused(tmp_path, where):
    secret = tmp_path / "secret.jsonl"
    secret.write_text('{"prompt": "the secret"}\n')
    folder = tmp_path / "handed"
    (folder / "sub").mkdir(parents=True)
    (folder / "train.jsonl").write_text('{"prompt": "ok"}\n')
    target = where.format(outside=secret)
    (folder / "README.md").write_text(
        f"---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n"
        f"    path: {target}\n---\n# a dataset\n"
    )
    with pytest.raises(DatasetError, match=r"handed: its README.md .*outside the folder"):
        load_rows(folder)


def test_a_data_file_linked_from_outside_the_folder_is_refused(tmp_path):
    secret = tmp_path / "secret.jsonl"
    secret.write_text('{"prompt": "the secret"}\n')
    folder = tmp_path / "handed"
    folder.mkdir()
    (folder / "train.jsonl").symlink_to(secret)
    with pytest.raises(DatasetError, match=r"train.jsonl.*outside the folder"):
        load_rows(folder)


def test_a_readme_with_data_files_inside_the_folder_still_reads(tmp_path):
    folder = tmp_path / "ok"
    (folder / "data").mkdir(parents=True)
    (folder / "data" / "mine.jsonl").write_text('{"prompt": "ok"}\n')
    (folder / "README.md").write_text(
        "---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n"
        "    path: data/*.jsonl\n---\n"
    )
    assert load_rows(folder) == [{"prompt": "ok"}]


def test_a_folder_linked_from_outside_is_refused(tmp_path):
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "train.jsonl").write_text('{"prompt": "the secret"}\n')
    folder = tmp_path / "handed"
    folder.mkdir()
    (folder / "data").symlink_to(tmp_path / "elsewhere")
    (folder / "x.jsonl").write_text('{"prompt": "ok"}\n')
    with pytest.raises(DatasetError, match=r"data.*outside the folder"):
        load_rows(folder)


def test_a_saved_dataset_whose_state_names_a_file_outside_is_refused(tmp_path):
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "other"))
    folder = tmp_path / "handed"
    datasets.Dataset.from_list(ROWS[:1]).save_to_disk(str(folder))
    state = json.loads((folder / "state.json").read_text())
    arrow = next((tmp_path / "other").glob("*.arrow")).name
    state["_data_files"] = [{"filename": f"../other/{arrow}"}]
    (folder / "state.json").write_text(json.dumps(state))
    with pytest.raises(DatasetError, match=r"state.json names data files .*outside the folder"):
        load_rows(folder)
