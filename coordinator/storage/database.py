# The run's SQLite database: its schema's migrations, one connection shared by threads, each write one transaction.
from __future__ import annotations

import sqlite3
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from protocol.sqlite_store import Migration, Schema, execute_all, open_store, statements, transaction

TABLES = (
    """
    CREATE TABLE IF NOT EXISTS config (
        id INTEGER PRIMARY KEY CHECK (id = 1),
        body TEXT NOT NULL
    )
    """,
    """
    CREATE TABLE IF NOT EXISTS checkpoints (
        round_id INTEGER PRIMARY KEY,
        model_hash TEXT NOT NULL,
        file_name TEXT NOT NULL,
        saved_at REAL NOT NULL
    )
    """,
    """
    CREATE TABLE IF NOT EXISTS rounds (
        round_id INTEGER PRIMARY KEY,
        started_at REAL NOT NULL,
        closed_at REAL NOT NULL,
        model_hash TEXT NOT NULL,
        accuracy REAL,
        labels INTEGER NOT NULL,
        accepted INTEGER NOT NULL,
        rejected INTEGER NOT NULL,
        report TEXT NOT NULL,
        metrics TEXT NOT NULL
    )
    """,
    """
    CREATE TABLE IF NOT EXISTS device_rounds (
        round_id INTEGER NOT NULL REFERENCES rounds (round_id),
        device_id TEXT NOT NULL,
        accepted INTEGER NOT NULL,
        reason TEXT NOT NULL,
        num_samples INTEGER NOT NULL,
        class_counts TEXT NOT NULL,
        local_accuracy REAL,
        divergence TEXT NOT NULL,
        update_bytes INTEGER NOT NULL,
        received_at REAL NOT NULL,
        acquired_labels INTEGER NOT NULL DEFAULT 0,
        PRIMARY KEY (round_id, device_id)
    )
    """,
    """
    CREATE TABLE IF NOT EXISTS strategy_state (
        round_id INTEGER PRIMARY KEY REFERENCES rounds (round_id),
        strategy TEXT NOT NULL,
        body TEXT NOT NULL
    )
    """,
    """
    CREATE TABLE IF NOT EXISTS rejections (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        round_id INTEGER NOT NULL,
        device_id TEXT NOT NULL,
        reason TEXT NOT NULL,
        update_bytes INTEGER NOT NULL,
        recorded_at REAL NOT NULL,
        kind TEXT NOT NULL DEFAULT ''
    )
    """,
    """
    CREATE TABLE IF NOT EXISTS serving (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        round_id INTEGER NOT NULL,
        decision TEXT NOT NULL,
        serving INTEGER NOT NULL,
        reason TEXT NOT NULL,
        who TEXT NOT NULL,
        recorded_at REAL NOT NULL
    )
    """,
    """
    CREATE TABLE IF NOT EXISTS nonces (
        device_id TEXT NOT NULL,
        nonce BLOB NOT NULL,
        round_id INTEGER NOT NULL,
        PRIMARY KEY (device_id, nonce)
    )
    """,
)


def adopt_release_0_1_0(connection: sqlite3.Connection) -> None:
    """Schema version 1, the tables of release 0.1.0: each created where missing; a 0.1.0 run written before
    rejections had kinds gains the column (its rejections of no kind)."""
    execute_all(connection, TABLES)
    columns = [row[1] for row in connection.execute("PRAGMA table_info(rejections)")]
    if "kind" not in columns:
        connection.execute("ALTER TABLE rejections ADD COLUMN kind TEXT NOT NULL DEFAULT ''")


# Schema version 2: the devices' prediction counts (storage/prediction_counts.py), so a restart keeps the hour's
# (created where missing, as version 1's tables are: a step run again changes nothing).
PREDICTION_TABLES = (
    """
    CREATE TABLE IF NOT EXISTS prediction_hours (
        device_id TEXT NOT NULL,
        hour INTEGER NOT NULL,
        predictions INTEGER NOT NULL,
        uncertain INTEGER NOT NULL,
        classes TEXT NOT NULL,
        PRIMARY KEY (device_id, hour)
    )
    """,
    """
    CREATE TABLE IF NOT EXISTS prediction_devices (
        device_id TEXT PRIMARY KEY,
        total INTEGER NOT NULL,
        serving_version INTEGER NOT NULL
    )
    """,
)

RUN_SCHEMA = Schema(
    "run database",
    (
        Migration("the tables of release 0.1.0", adopt_release_0_1_0),
        statements("the devices' prediction counts by hour", *PREDICTION_TABLES),
    ),
)


class Database:
    """One SQLite connection shared by threads: writes in one transaction each, reads under the same lock."""

    def __init__(self, path: Path, read_only: bool) -> None:
        """Opens the database, its schema brought up to date (RUN_SCHEMA); read_only opens an existing one beside
        its writer."""
        self._lock = threading.Lock()
        self._conn = open_store(path, RUN_SCHEMA, read_only)

    def close(self) -> None:
        """Closes the connection."""
        with self._lock:
            self._conn.close()

    def write(self, statements: Sequence[tuple[str, tuple]]) -> None:
        """Runs statements in one transaction: all are applied or none."""
        with self._lock, transaction(self._conn):
            for sql, params in statements:
                self._conn.execute(sql, params)

    def write_after_reading(
        self, statements_of: Callable[[Callable[..., list[tuple]]], Sequence[tuple[str, tuple]]]
    ) -> None:
        """Runs the statements `statements_of` builds from what it reads, reads and writes in one transaction that
        holds the write lock throughout: another process's writer cannot slip in between what was read and what is
        written from it."""
        with self._lock, transaction(self._conn):
            for sql, params in statements_of(lambda query, args=(): self._conn.execute(query, args).fetchall()):
                self._conn.execute(sql, params)

    def read(self, sql: str, params: tuple = ()) -> list[tuple]:
        """All rows of one query."""
        with self._lock:
            return self._conn.execute(sql, params).fetchall()
