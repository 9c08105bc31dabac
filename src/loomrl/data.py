"""Datasets from local files and folders (``loomrl.data_sources``), checked row by row, and
the epoch-ordered prompt stream."""

from __future__ import annotations

import json
import random
import sys
from collections import deque
from pathlib import Path
from typing import Any

from loomrl.data_sources import DatasetSourceError, cache_root, read_folder


class DatasetError(ValueError):
    """A dataset file that is missing or malformed."""


def load_rows(
    path: str | Path, prompt_key: str = "prompt", split: str = "train", config: str | None = None
) -> list[dict[str, Any]]:
    """All rows of a data file or folder (``loomrl.data_sources``); every row must have
    ``prompt_key``."""
    return load_rows_with_places(path, prompt_key, split, config)[0]


def load_rows_with_places(
    path: str | Path, prompt_key: str = "prompt", split: str = "train", config: str | None = None
) -> tuple[list[dict[str, Any]], list[str]]:
    """The rows, and where each one is for error messages: ``file:LINE`` for JSON lines
    (counted from 1, like JSON errors), ``file item N`` for a JSON array, ``file row N`` (from
    1) for Parquet, ``folder[split] row N`` for a dataset folder (``split`` and ``config``
    are read only there), ``in-memory dataset[i]`` for what ``Job(dataset=...)`` was given."""
    rows, places = _read_rows(Path(path), split, config)
    if in_memory(path):
        places = [f"in-memory dataset[{n}]" for n in range(len(rows))]
    for row, place in zip(rows, places):
        check_row(row, place, prompt_key)
    return rows, places


def check_row(row: Any, place: str, prompt_key: str) -> None:
    """A row is an object with ``prompt_key`` holding a string or a list of messages; else
    a DatasetError naming its place (and, for a missing prompt, its columns)."""
    if not isinstance(row, dict):
        raise DatasetError(
            f"{place}: row is {_kind(row)}, expected a JSON object with a {prompt_key!r} column"
        )
    if prompt_key not in row:
        raise DatasetError(
            f"{place}: row has no {prompt_key!r} column (its columns: {sorted(row)}); set "
            f"data.prompt_key to the column that holds the prompt{_guess(row, prompt_key)}"
        )
    prompt = row[prompt_key]
    if isinstance(prompt, list):
        check_messages(prompt, f"{place}: {prompt_key!r}")
    elif not isinstance(prompt, str):
        raise DatasetError(
            f"{place}: {prompt_key!r} is {_kind(prompt)}, expected a string or a list of "
            "{role, content} messages"
        )


# Columns that hold the prompt in common datasets, in the order they are suggested.
PROMPT_COLUMNS = ("prompt", "messages", "question", "problem", "query", "instruction", "input")


def _guess(row: dict[str, Any], prompt_key: str) -> str:
    """`` (e.g. data.prompt_key='question')`` for a row with a usual prompt column."""
    for name in PROMPT_COLUMNS:
        if name != prompt_key and isinstance(row.get(name), str | list):
            return f" (e.g. data.prompt_key={name!r})"
    return ""


def in_memory(path: str | Path) -> bool:
    """``path`` is where ``Job(dataset=...)`` wrote a dataset or rows it was given."""
    return Path(path).parent == cache_root()


def _read_rows(path: Path, split: str, config: str | None) -> tuple[list[Any], list[str]]:
    if path.is_dir():
        try:
            rows, places = read_folder(path, split, config)
        except DatasetSourceError as err:
            raise DatasetError(str(err)) from None
    elif not path.is_file():
        raise DatasetError(f"dataset file not found: {path}")
    elif path.suffix == ".parquet":
        # lazy: pyarrow loads only for a .parquet file
        import pyarrow.parquet as pq

        rows = pq.read_table(path).to_pylist()
        places = [f"{path} row {n}" for n in range(1, len(rows) + 1)]
    elif path.suffix == ".json" and _starts_with(path, b"["):
        rows, places = _read_json_array(path)
    elif path.suffix in (".jsonl", ".json"):
        rows, places = _read_json_lines(path)
    else:
        raise DatasetError(
            f"{path}: unsupported dataset format {path.suffix!r}; use .jsonl, .json, .parquet "
            "or a dataset folder"
        )
    if not rows:
        raise DatasetError(f"{'an in-memory dataset' if in_memory(path) else path}: no rows")
    return rows, places


def check_messages(messages: list[Any], where: str) -> None:
    """A conversational prompt (TRL's format): a non-empty list of ``{"role": str,
    "content": str}`` objects; else a DatasetError naming ``where`` (file:line) and the message."""
    if not messages:
        raise DatasetError(f"{where} is an empty list of messages")
    for n, message in enumerate(messages):
        if not isinstance(message, dict):
            raise DatasetError(
                f"{where}: message {n} is {_kind(message)}, expected an object "
                '{"role": ..., "content": ...}'
            )
        for field in ("role", "content"):
            if not isinstance(message.get(field), str):
                got = "missing" if field not in message else _kind(message[field])
                raise DatasetError(f"{where}: message {n} has {field!r} {got}, expected a string")


def _kind(value: Any) -> str:
    """A JSON value's type for a message: ``null``, ``a list`` ..."""
    if value is None:
        return "null"
    name = type(value).__name__
    return f"an {name}" if name[0] in "aeiou" else f"a {name}"


def _starts_with(path: Path, prefix: bytes) -> bool:
    """The file's first non-blank bytes are ``prefix`` (a JSON array starts with ``[``)."""
    with path.open("rb") as f:
        return f.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n").startswith(prefix)


def _read_json_array(path: Path) -> tuple[list[Any], list[str]]:
    """A ``.json`` file holding one array of rows; places are ``file item N`` (from 1)."""
    try:
        rows = json.loads(path.read_bytes().decode("utf-8-sig"))
    except UnicodeDecodeError as err:
        raise DatasetError(
            f"{path}: not UTF-8 ({err.reason}); re-encode the file as UTF-8"
        ) from None
    except json.JSONDecodeError as err:
        raise DatasetError(
            f"{path}:{err.lineno}: not valid JSON ({err.msg}, column {err.colno})"
        ) from None
    except RecursionError:
        raise DatasetError(
            f"{path}: nested too deeply to read (past Python's recursion limit of "
            f"{sys.getrecursionlimit()})"
        ) from None
    if not isinstance(rows, list):
        raise DatasetError(f"{path}: expected a JSON array of row objects, got {_kind(rows)}")
    return rows, [f"{path} item {n}" for n in range(1, len(rows) + 1)]


def _read_json_lines(path: Path) -> tuple[list[Any], list[str]]:
    rows, places = [], []
    for lineno, raw in enumerate(path.read_bytes().splitlines(), 1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise DatasetError(
                f"{path}:{lineno}: not UTF-8 (byte {raw[err.start]:#04x} at column {err.start + 1}); "
                "re-encode the file as UTF-8"
            ) from None
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as err:
            raise DatasetError(f"{path}:{lineno}: not valid JSON ({err.msg})") from None
        except RecursionError:
            raise DatasetError(
                f"{path}:{lineno}: nested too deeply to read (arrays or objects inside each other "
                f"past Python's recursion limit of {sys.getrecursionlimit()})"
            ) from None
        places.append(f"{path}:{lineno}")
    return rows, places


class PromptStream:
    """Prompts in a seeded per-epoch order, with exactly-once training per epoch.

    ``trained`` holds the indices trained on in the current epoch. Prompts handed out but
    not trained (dropped as stale, or lost in a crash) are handed out again: ``requeue``
    puts them back at the front, and on resume every untrained prompt of the epoch is
    still to come. ``set_aside`` holds those whose group had nothing to learn from
    (dynamic sampling dropped it): they are not handed out again in the epoch, trained or
    not, and come back with every other prompt in the next epoch's order.
    """

    def __init__(self, num_rows: int, seed: int, shuffle: bool = True) -> None:
        self.num_rows = num_rows
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.trained: list[int] = []
        self.set_aside: list[int] = []
        self.trained_twice = 0  # prompts trained a second time in one epoch: a bug if ever > 0
        self._start_epoch()

    def _order(self, epoch: int) -> list[int]:
        order = list(range(self.num_rows))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def _start_epoch(self) -> None:
        self._trained_set = set(self.trained)
        done = self._trained_set | set(self.set_aside)
        self._pending = deque(i for i in self._order(self.epoch) if i not in done)
        self._outstanding: set[int] = set()

    def next(self) -> tuple[int, int]:
        """``(epoch, row index)`` of the next prompt to dispatch."""
        while not self._pending:
            # Epoch over: groups of the old epoch still in flight train but are not
            # recorded (or requeued) in the new one.
            self.epoch += 1
            self.trained, self.set_aside = [], []
            self._start_epoch()
        index = self._pending.popleft()
        self._outstanding.add(index)
        return self.epoch, index

    def next_many(self, n: int) -> list[tuple[int, int]]:
        """The next ``n`` prompts, as ``next`` hands them out (one call a request)."""
        pending = self._pending
        if len(pending) < n:
            return [self.next() for _ in range(n)]
        indices = [pending.popleft() for _ in range(n)]
        self._outstanding.update(indices)
        return list(zip([self.epoch] * n, indices))

    def requeue(self, epoch: int, index: int) -> None:
        if epoch == self.epoch and index in self._outstanding:
            self._outstanding.discard(index)
            self._pending.appendleft(index)

    def set_aside_for_epoch(self, epoch: int, index: int) -> None:
        """Dynamic sampling dropped the prompt's group: not handed out again this epoch."""
        if epoch == self.epoch and index in self._outstanding:
            self._outstanding.discard(index)
            self.set_aside.append(index)

    def mark_trained(self, epoch: int, index: int) -> None:
        self.mark_trained_many([(epoch, index)])

    def mark_trained_many(self, picks: list[tuple[int, int]]) -> None:
        """``mark_trained`` for each ``(epoch, index)``: one call a step."""
        epoch = self.epoch
        indices = [index for e, index in picks if e == epoch]
        self._outstanding.difference_update(indices)
        before = len(self._trained_set)
        self._trained_set.update(indices)
        # Each index trained before (in this epoch, or earlier in ``picks``) counts once more.
        self.trained_twice += len(indices) - (len(self._trained_set) - before)
        self.trained += indices

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "trained": list(self.trained),
            "set_aside": list(self.set_aside),
            "seed": self.seed,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch = int(state["epoch"])
        self.trained = list(state["trained"])
        # (a checkpoint from before dynamic sampling has none)
        self.set_aside = list(state.get("set_aside", []))
        self._start_epoch()
