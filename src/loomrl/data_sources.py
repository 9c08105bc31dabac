"""Where training rows come from: files, folders and in-memory datasets.

``data.train`` / ``data.eval`` name one of

- a ``.jsonl`` file (one JSON object a line) or a ``.json`` file (a JSON array of objects, or
  JSON lines), a ``.parquet`` file;
- a folder written by ``datasets``' ``save_to_disk`` (a ``Dataset``, or a ``DatasetDict``
  from which ``data.train_split`` / ``data.eval_split`` is taken);
- any other folder of data files ``datasets.load_dataset`` reads, such as a copy of a hub
  repository (``main/train-00000-of-00001.parquet``, ``data/test.jsonl``): the split is found
  from the file names, as on the hub.

``Job(dataset=...)`` also takes a ``datasets.Dataset`` or a list of row dicts: they are written
once to a cache folder named by their content (``materialize``), so executors in other
processes read the same rows and a resumed run finds them again.

Folders need the ``datasets`` package (``pip install 'loomrl[data]'``); files do not.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

FILE_SUFFIXES = (".jsonl", ".json", ".parquet")


class DatasetSourceError(ValueError):
    """A data source that cannot be read (missing, an unknown kind, a missing split)."""


def read_folder(
    path: Path, split: str, config: str | None = None
) -> tuple[list[dict[str, Any]], list[str]]:
    """The rows of ``split`` in a dataset folder (of its configuration ``config``, where its
    README lists several: ``data.dataset_config``), and where each one is (``PATH[split] row
    N``, counted from 1)."""
    datasets = _import_datasets(path)
    _check_inside(path)
    with _quiet(datasets):
        if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
            loaded = datasets.load_from_disk(str(path))
        else:
            loaded = _load_data_files(datasets, path, split, config)
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise DatasetSourceError(
                f"{path}: no split {split!r} in this dataset (it holds {sorted(loaded)}); set "
                "data.train_split / data.eval_split to one of them"
            )
        loaded = loaded[split]
    rows = loaded.to_list()
    return rows, [f"{path}[{split}] row {n}" for n in range(1, len(rows) + 1)]


def _load_data_files(datasets, path: Path, split: str, config: str | None):
    """``datasets.load_dataset`` of a plain folder of data files, offline."""
    if not any(p.suffix in (".jsonl", ".json", ".parquet", ".csv") for p in path.rglob("*")):
        raise DatasetSourceError(
            f"{path}: a folder with no data files (.parquet, .jsonl, .json, .csv) and not a "
            "datasets save_to_disk folder"
        )
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # a local folder needs no network
    _check_config(datasets, path, config)
    try:
        return datasets.load_dataset(str(path), config, split=split)
    except ValueError as err:
        if "split" in str(err).lower() or "Unknown split" in str(err):
            raise DatasetSourceError(
                f"{path}: no split {split!r} found from its file names ({err}); name files as "
                "the hub does (train-*.parquet, test.jsonl, ...) or set data.train_split / "
                "data.eval_split"
            ) from None
        raise DatasetSourceError(f"{path}: datasets could not read this folder: {err}") from None


def _check_config(datasets, path: Path, config: str | None) -> None:
    """A folder whose README lists several configurations needs one chosen, and a chosen
    one must be among them: an error naming them and ``data.dataset_config``."""
    try:
        names = datasets.get_dataset_config_names(str(path))
    except (ValueError, OSError):  # no configurations to read: load_dataset says what is wrong
        return
    names = [n for n in names if n != "default"] if config is None else names
    if config is None and len(names) > 1:
        raise DatasetSourceError(
            f"{path}: holds {len(names)} configurations {names}; choose one with "
            f"data.dataset_config (e.g. data.dataset_config={names[0]!r})"
        )
    if config is not None and config not in names:
        raise DatasetSourceError(
            f"{path}: no configuration {config!r} (data.dataset_config); it holds {names}"
        )


def _check_inside(path: Path) -> None:
    """Refuse a folder that makes ``datasets`` read files outside it: a ``README.md`` whose
    ``configs: data_files`` (or ``data_dir``) names a path outside (``../``, absolute, a URL)
    or a link (to a file or a folder) to somewhere outside. A handed dataset folder must not
    read the user's other files."""
    root = path.resolve()
    for file in path.rglob("*"):
        # (a link to a folder is not descended into by rglob, but datasets' globs may be)
        if file.is_symlink() and not _within(file.resolve(), root):
            raise DatasetSourceError(
                f"{file}: leads outside the folder {path} (to {file.resolve()}); refused"
            )
    for pattern in _readme_data_files(path / "README.md") + _saved_data_files(path):
        where = os.path.normpath(os.path.join(root, pattern))
        if "://" in pattern or pattern.startswith("hf:") or not _within(Path(where), root):
            raise DatasetSourceError(
                f"{path}: its README.md or state.json names data files {pattern!r} outside the "
                f"folder; refused (a dataset folder reads only its own files)"
            )


def _within(file: Path, root: Path) -> bool:
    return file == root or root in file.parents


def _saved_data_files(path: Path) -> list[str]:
    """The files a ``save_to_disk`` folder's ``state.json`` files (and its
    ``dataset_dict.json`` splits) name, relative to ``path``."""
    found: list[str] = []
    for name in ("state.json", "dataset_dict.json"):
        for file in path.rglob(name):
            try:
                state = json.loads(file.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, ValueError, RecursionError):
                continue
            if not isinstance(state, dict):
                continue
            entries = state.get("_data_files") or [{"filename": s} for s in state.get("splits", [])]
            for entry in entries if isinstance(entries, list) else []:
                if isinstance(entry, dict) and isinstance(entry.get("filename"), str):
                    found.append(str(file.parent.relative_to(path) / entry["filename"]))
    return found


def _readme_data_files(readme: Path) -> list[str]:
    """Every path or pattern a dataset card's YAML header gives ``datasets`` to read
    (``configs[].data_files`` in each of its forms, and ``configs[].data_dir``)."""
    if not readme.is_file():
        return []
    # lazy: yaml (not a loomrl dependency) only for a dataset folder's README card
    import yaml

    text = readme.read_text(encoding="utf-8", errors="replace")
    if not text.startswith("---"):
        return []
    try:
        header = yaml.safe_load(text[3:].partition("\n---")[0])
    except yaml.YAMLError:
        return []
    configs = header.get("configs") if isinstance(header, dict) else None
    found: list[str] = []

    def walk(value: Any) -> None:
        if isinstance(value, str):
            found.append(value)
        elif isinstance(value, list):
            for item in value:
                walk(item)
        elif isinstance(value, dict):
            for key, item in value.items():
                walk(item if key != "split" else None)

    for config in configs if isinstance(configs, list) else [configs]:
        if isinstance(config, dict):
            walk(config.get("data_files"))
            walk(config.get("data_dir"))
    return found


def _import_datasets(path: Path):
    try:
        # lazy: datasets is optional (the data extra)
        import datasets
    except ImportError:
        raise DatasetSourceError(
            f"{path} is a folder: reading dataset folders needs the `datasets` package "
            "(pip install 'loomrl[data]'); or point data.train at a .jsonl/.json/.parquet file"
        ) from None
    return datasets


@contextmanager
def _quiet(datasets):
    """No ``datasets`` progress bars while loomrl's own progress runs."""
    was_enabled = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if was_enabled:
            datasets.enable_progress_bars()


def cache_root() -> Path:
    """Where ``materialize`` writes: ``$LOOMRL_CACHE_DIR/datasets`` (default
    ``~/.cache/loomrl/datasets``)."""
    base = os.environ.get("LOOMRL_CACHE_DIR") or Path.home() / ".cache" / "loomrl"
    return Path(base) / "datasets"


def materialize(data: Any, what: str = "dataset") -> str:
    """A path for ``data``: a str or Path is returned as is; a ``datasets.Dataset`` is saved
    with ``save_to_disk`` and a list of row dicts as JSON lines, under ``cache_root()`` in a
    folder named by a digest of their content (written once, atomically)."""
    if isinstance(data, (str, os.PathLike)):
        return str(data)
    if isinstance(data, list):
        return _materialize_rows(data, what)
    kind = type(data)
    if kind.__module__.startswith("datasets"):
        return _materialize_dataset(data, what)
    raise TypeError(
        f"{what} must be a path, a datasets.Dataset or a list of row dicts, not {kind.__name__}"
    )


def _materialize_rows(rows: list[Any], what: str) -> str:
    for n, row in enumerate(rows):
        if not isinstance(row, dict):
            raise TypeError(f"{what}[{n}] is a {type(row).__name__}, expected a dict (a row)")
    try:
        text = "".join(json.dumps(row, ensure_ascii=False, sort_keys=True) + "\n" for row in rows)
    except TypeError as err:
        raise TypeError(f"{what}: a row holds a value JSON cannot write ({err})") from None
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    target = cache_root() / f"rows-{digest}.jsonl"
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, target)
    return str(target)


def _materialize_dataset(data: Any, what: str) -> str:
    # lazy: datasets is optional (the data extra)
    import datasets

    if isinstance(data, datasets.DatasetDict):
        raise TypeError(
            f"{what} is a DatasetDict with splits {sorted(data)}: pass one split, e.g. "
            f"ds[{next(iter(data), 'train')!r}]"
        )
    if not isinstance(data, datasets.Dataset):
        raise TypeError(
            f"{what} is a {type(data).__name__}; pass a datasets.Dataset (an IterableDataset "
            "has no length: materialize it with Dataset.from_generator or .take(n))"
        )
    target = cache_root() / f"dataset-{data._fingerprint}"
    if not (target / "state.json").is_file():
        tmp = target.with_name(f"{target.name}.tmp{os.getpid()}")
        with _quiet(datasets):
            data.save_to_disk(str(tmp))
        try:
            os.replace(tmp, target)
        except OSError:  # another process wrote it first: theirs is the same content
            shutil.rmtree(tmp, ignore_errors=True)
    logger.info("%s: %d rows saved at %s", what, data.num_rows, target)
    return str(target)
