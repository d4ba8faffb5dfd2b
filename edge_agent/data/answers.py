# The one answer path of a device: every answer to a query, by whatever road it came, stored once by query id.
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from protocol.sqlite_store import Schema, open_store, statements, transaction

ANSWERS_FILE = "answers.sqlite"
# An answer's label when the person saw none of the classes (the wire's protocol.label_messages.NONE_OF_THESE).
DECLINED = -1
SCHEMA = (
    "CREATE TABLE IF NOT EXISTS answers (query_id TEXT PRIMARY KEY, label INTEGER NOT NULL, road TEXT NOT NULL, "
    "answered_by TEXT NOT NULL, answered_at REAL NOT NULL, stored_at REAL NOT NULL)",
    "CREATE TABLE IF NOT EXISTS queued (query_id TEXT PRIMARY KEY)",
    "CREATE TABLE IF NOT EXISTS reported (query_id TEXT PRIMARY KEY)",
)
ANSWERS_SCHEMA = Schema("answer book", (statements("the tables of release 0.1.0", *SCHEMA),))


class Road(StrEnum):
    """The roads an answer reaches a device by; each only delivers to the answer book."""

    PAGE = "page"  # the device's own label page
    LABELS_CSV = "labels.csv"  # a person's or a labelling tool's file in the oracle folder
    CENTRAL = "central"  # the coordinator's labelling queue


class Delivery(StrEnum):
    """What a delivery did: stored the answer, found the same answer stored, or found another one stored (the
    first answer stays: an answer is never applied twice, nor changed once stored)."""

    STORED = "stored"
    SAME = "same"
    CONFLICT = "conflict"


@dataclass(frozen=True)
class StoredAnswer:
    """One answer as the book keeps it."""

    query_id: str
    label: int
    road: str
    answered_by: str
    answered_at: float


class AnswerBook:
    """ORACLE_DIR/answers.sqlite: one row per query id, written in one durable transaction (WAL, synchronous FULL)
    before `deliver` returns, so a road acknowledges an answer (a page's redirect, a receipt to the coordinator)
    only once it survives a crash. Delivering the same answer again, by any road, changes nothing. Beside the
    answers: which queries the fleet's central queue confirmed holding, and which answers given on the device it was
    told of (`--labelling central`)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._lock = threading.Lock()
        self._conn = open_store(path, ANSWERS_SCHEMA)

    def deliver(
        self, query_id: str, label: int, road: Road, answered_by: str = "", answered_at: float = 0.0
    ) -> Delivery:
        """Stores an answer for a query unless one is stored already; durable when it returns."""
        now = time.time()
        with self._lock, transaction(self._conn):
            row = self._conn.execute("SELECT label FROM answers WHERE query_id = ?", (query_id,)).fetchone()
            if row is None:
                self._conn.execute(
                    "INSERT INTO answers VALUES (?, ?, ?, ?, ?, ?)",
                    (query_id, int(label), road.value, answered_by[:64], answered_at or now, now),
                )
        if row is None:
            return Delivery.STORED
        return Delivery.SAME if int(row[0]) == int(label) else Delivery.CONFLICT

    def labels(self) -> dict[str, int]:
        """Query id -> stored label (DECLINED for 'none of these')."""
        with self._lock:
            return {
                query_id: int(label) for query_id, label in self._conn.execute("SELECT query_id, label FROM answers")
            }

    def answers(self) -> list[StoredAnswer]:
        """Every stored answer, in the order stored."""
        with self._lock:
            rows = self._conn.execute(
                "SELECT query_id, label, road, answered_by, answered_at FROM answers ORDER BY stored_at, rowid"
            ).fetchall()
        return [StoredAnswer(str(q), int(label), str(road), str(who), float(at)) for q, label, road, who, at in rows]

    def note_queued(self, query_id: str) -> None:
        """Notes that the fleet's labelling queue holds (or refused for good) a query: it is not sent again."""
        with self._lock, transaction(self._conn):
            self._conn.execute("INSERT OR IGNORE INTO queued VALUES (?)", (query_id,))

    def queued(self) -> set[str]:
        """The query ids the fleet's labelling queue holds or refused."""
        with self._lock:
            return {str(query_id) for (query_id,) in self._conn.execute("SELECT query_id FROM queued")}

    def note_reported(self, query_id: str) -> None:
        """Notes that the queue was told of an answer given on the device (it is not told again)."""
        with self._lock, transaction(self._conn):
            self._conn.execute("INSERT OR IGNORE INTO reported VALUES (?)", (query_id,))

    def reported(self) -> set[str]:
        """The query ids whose device-side answers the queue was told of."""
        with self._lock:
            return {str(query_id) for (query_id,) in self._conn.execute("SELECT query_id FROM reported")}

    def close(self) -> None:
        """Closes the database."""
        with self._lock:
            self._conn.close()
