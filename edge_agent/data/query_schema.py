# The device's query store on disk: its file, its tables and their ordered migrations (0.1.0's queries/index.csv
# moved in once).
from __future__ import annotations

import csv
import io
import sqlite3
from pathlib import Path

from edge_agent.data.query_records import Query
from protocol.errors import UsageError
from protocol.sqlite_store import Migration, Schema, statements

STORE_FILE = "answers.sqlite"  # (its name since release 0.1.0, when it held the answers alone)
QUERIES_DIR = "queries"
INDEX_FILE = "index.csv"  # queries/index.csv: the queries listed for people and tools, written, never read back
SCHEMA = (
    "CREATE TABLE IF NOT EXISTS answers (query_id TEXT PRIMARY KEY, label INTEGER NOT NULL, road TEXT NOT NULL, "
    "answered_by TEXT NOT NULL, answered_at REAL NOT NULL, stored_at REAL NOT NULL)",
    "CREATE TABLE IF NOT EXISTS queued (query_id TEXT PRIMARY KEY)",
    "CREATE TABLE IF NOT EXISTS reported (query_id TEXT PRIMARY KEY)",
)
CORRECTIONS = (
    # a query's latest correction: its label, the newest central revision seen, and whether the queue was told of
    # one made on the device
    "CREATE TABLE IF NOT EXISTS corrections (query_id TEXT PRIMARY KEY, label INTEGER NOT NULL, "
    "revision INTEGER NOT NULL, road TEXT NOT NULL, corrected_by TEXT NOT NULL, corrected_at REAL NOT NULL, "
    "stored_at REAL NOT NULL, reported INTEGER NOT NULL)",
)
# One row per query asked: where its copy is, what it shows, the model's guess when asked (NULL: none), when it
# was last sent to the fleet's queue, whether the queue holds it, whether the queue was told of an answer given on
# the device, when its label was taken into the labelled store. (Release 0.1.0 kept the rows in queries/index.csv
# and the two flags in tables of their own: the step moves both in.)
QUERIES = (
    "CREATE TABLE queries (query_id TEXT PRIMARY KEY, file TEXT NOT NULL, round_id INTEGER NOT NULL, "
    "pool_index INTEGER NOT NULL, sha256 TEXT NOT NULL, source TEXT NOT NULL, asked_at REAL NOT NULL, "
    "guess INTEGER, probability REAL, uncertainty REAL, score REAL, sent_at REAL, "
    "queued INTEGER NOT NULL DEFAULT 0, answer_reported INTEGER NOT NULL DEFAULT 0, taken_at REAL)",
    "CREATE INDEX queries_by_pool_index ON queries (pool_index)",
)
FLAGS_MOVED_IN = (
    "UPDATE queries SET queued = 1 WHERE query_id IN (SELECT query_id FROM queued)",
    "UPDATE queries SET answer_reported = 1 WHERE query_id IN (SELECT query_id FROM reported)",
    "DROP TABLE queued",
    "DROP TABLE reported",
)
CURRENT_LABELS = (
    "SELECT a.query_id, COALESCE(c.label, a.label), COALESCE(c.road, a.road) FROM answers a "
    "LEFT JOIN corrections c ON c.query_id = a.query_id"
)
QUERY_COLUMNS = "file, round_id, pool_index, sha256, source, asked_at, guess, probability, uncertainty, score"
INDEX_HEADER = ("file", "round_id", "index", "sha256", "source", "asked_at")


def index_rows(text: str, path: Path) -> list[Query]:
    """The queries of a 0.1.0 queries/index.csv; a UsageError naming the file when it is damaged (the upgrade stops
    with the store as it was)."""
    try:
        return [
            Query(
                row["file"],
                int(row["round_id"]),
                int(row["index"]),
                row["sha256"],
                row["source"],
                float(row["asked_at"]),
            )
            for row in csv.DictReader(io.StringIO(text))
        ]
    # float() and int() raise ValueError, a missing column KeyError, a short row TypeError: the file's damage, named
    except (KeyError, TypeError, ValueError) as exc:
        raise UsageError(
            f"{path}: not a query index ({str(exc)[:100]}); the query store was not upgraded: restore the file "
            "from the copy taken before the upgrade"
        ) from exc


def move_queries_in(connection: sqlite3.Connection) -> None:
    """The queries step: the queries table, filled from the 0.1.0 index beside the store (queries/index.csv, left
    in place for people and tools), with the queue's two flags moved in."""
    database = Path(connection.execute("PRAGMA database_list").fetchone()[2])
    index = database.parent / QUERIES_DIR / INDEX_FILE
    for statement in QUERIES:
        connection.execute(statement)
    if index.is_file():
        queries = index_rows(index.read_text(), index)
        connection.executemany(
            f"INSERT INTO queries ({QUERY_COLUMNS}, query_id) VALUES ({', '.join('?' * 11)})",
            [(*query.row(), query.query_id) for query in queries],
        )
    for statement in FLAGS_MOVED_IN:
        connection.execute(statement)


# When the fleet's queue closed a query without a label (it chose it for the field's test set): nobody waits for it,
# it is not sent again, and it is never asked again.
CLOSED = ("ALTER TABLE queries ADD COLUMN closed_at REAL",)
QUERY_SCHEMA = Schema(
    "query store",
    (
        statements("the tables of release 0.1.0", *SCHEMA),
        statements("corrections (0.5.0)", *CORRECTIONS),
        Migration("queries, with the queue's flags (0.5.0)", move_queries_in),
        statements("queries closed without a label (0.5.0)", *CLOSED),
    ),
)
