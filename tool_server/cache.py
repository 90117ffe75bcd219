"""Persistent response cache (SQLite, WAL mode) keyed by the normalised request.

One file can be shared by every server process of a job (WAL allows concurrent readers with one writer;
``busy_timeout`` makes a second writer wait instead of failing). Only successful and "no results" answers are
stored: infra, budget and bad-request failures are never cached, so a transient outage cannot poison later runs.
"""
from __future__ import annotations

import hashlib
import json
import sqlite3
import threading
import time
import unicodedata


def normalize_text(text: str) -> str:
    """NFKC, collapse whitespace, casefold: requests that differ only in those hit the same entry."""
    return " ".join(unicodedata.normalize("NFKC", text).split()).casefold()


def cache_key(namespace: str, request: dict) -> str:
    """sha256 over a canonical JSON of (namespace, request); the namespace names the backend and its settings."""
    blob = json.dumps([namespace, request], sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


class ResponseCache:
    """``get``/``put`` of JSON values. Calls are short local SQLite operations done inline on the event loop."""

    def __init__(self, path: str | None, *, ttl_s: float | None = None) -> None:
        self.path = path or ":memory:"
        self.ttl_s = ttl_s
        # one connection guarded by a lock: the server runs one event loop, tests may call from threads.
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=10.0)
        if self.path != ":memory:":
            mode = self._db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if mode.lower() != "wal":
                raise RuntimeError(f"cache {self.path!r}: SQLite refused WAL mode (got {mode!r}); "
                                   "put the cache on a local filesystem (WAL does not work over NFS)")
            self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("PRAGMA busy_timeout=10000")
        self._db.execute("CREATE TABLE IF NOT EXISTS responses ("
                         "key TEXT PRIMARY KEY, value TEXT NOT NULL, created REAL NOT NULL)")

    def get(self, key: str) -> dict | None:
        with self._lock:
            row = self._db.execute("SELECT value, created FROM responses WHERE key = ?", (key,)).fetchone()
        if row is None:
            return None
        value, created = row
        if self.ttl_s is not None and time.time() - created > self.ttl_s:
            return None
        return json.loads(value)

    def put(self, key: str, value: dict) -> None:
        blob = json.dumps(value, ensure_ascii=False)
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO responses (key, value, created) VALUES (?, ?, ?)",
                             (key, blob, time.time()))

    def __len__(self) -> int:
        with self._lock:
            return self._db.execute("SELECT COUNT(*) FROM responses").fetchone()[0]

    def close(self) -> None:
        with self._lock:
            self._db.close()
