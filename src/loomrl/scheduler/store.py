"""SQLite state and event log, so a restarted daemon keeps its jobs, queue and leases.

One table per record type (id -> JSON), an append-only ``events`` table, and a small
``meta`` table. WAL mode; one connection used under the daemon's lock.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
from pathlib import Path
from typing import Any, TypeVar

from loomrl.scheduler.model import Device, Job, Lease, Record, Request

R = TypeVar("R", bound=Record)

TABLES: dict[type, tuple[str, str]] = {
    Job: ("jobs", "id"),
    Device: ("devices", "name"),
    Request: ("requests", "id"),
    Lease: ("leases", "id"),
}


class SqliteStore:
    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            # the jobs' secret digests and names live here: the daemon's user alone reads it
            os.close(os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600))
            os.chmod(self.path, 0o600)
        self._lock = threading.Lock()
        self.db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        for table, _ in TABLES.values():
            self.db.execute(
                f"CREATE TABLE IF NOT EXISTS {table} (id TEXT PRIMARY KEY, state TEXT, body TEXT NOT NULL)"
            )
        self.db.execute(
            "CREATE TABLE IF NOT EXISTS events (seq INTEGER PRIMARY KEY AUTOINCREMENT, "
            "t REAL, kind TEXT, job TEXT, device TEXT, body TEXT)"
        )
        self.db.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT)")

    def save(self, record: Record) -> None:
        table, key = TABLES[type(record)]
        body = record.to_dict()
        with self._lock:
            self.db.execute(
                f"INSERT OR REPLACE INTO {table} (id, state, body) VALUES (?, ?, ?)",
                (body[key], body.get("state"), json.dumps(body)),
            )

    def load(self, cls: type[R]) -> list[R]:
        table, _ = TABLES[cls]
        with self._lock:
            rows = self.db.execute(f"SELECT body FROM {table} ORDER BY id").fetchall()
        return [cls.from_dict(json.loads(body)) for (body,) in rows]

    def get(self, cls: type[R], key: str) -> R | None:
        table, _ = TABLES[cls]
        with self._lock:
            row = self.db.execute(f"SELECT body FROM {table} WHERE id = ?", (key,)).fetchone()
        return None if row is None else cls.from_dict(json.loads(row[0]))

    def log_event(self, event: dict[str, Any]) -> None:
        with self._lock:
            self.db.execute(
                "INSERT INTO events (t, kind, job, device, body) VALUES (?, ?, ?, ?, ?)",
                (
                    event["t"],
                    event["kind"],
                    event.get("job"),
                    event.get("device"),
                    json.dumps(event),
                ),
            )

    def events(self, limit: int = 100) -> list[dict[str, Any]]:
        with self._lock:
            rows = self.db.execute(
                "SELECT body FROM events ORDER BY seq DESC LIMIT ?", (limit,)
            ).fetchall()
        return [json.loads(body) for (body,) in reversed(rows)]

    def get_meta(self, key: str, default: Any = None) -> Any:
        with self._lock:
            row = self.db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return default if row is None else json.loads(row[0])

    def set_meta(self, key: str, value: Any) -> None:
        with self._lock:
            self.db.execute(
                "INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (key, json.dumps(value))
            )

    def close(self) -> None:
        with self._lock:
            self.db.close()
