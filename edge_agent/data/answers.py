# The one answer path of a device: every answer to a query, and every correction of one, by whatever road it came,
# recorded once by query id.
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
CORRECTIONS = (
    # a query's latest correction: its label, the newest central revision seen, and whether the queue was told of
    # one made on the device
    "CREATE TABLE IF NOT EXISTS corrections (query_id TEXT PRIMARY KEY, label INTEGER NOT NULL, "
    "revision INTEGER NOT NULL, road TEXT NOT NULL, corrected_by TEXT NOT NULL, corrected_at REAL NOT NULL, "
    "stored_at REAL NOT NULL, reported INTEGER NOT NULL)",
)
CURRENT_LABELS = (
    "SELECT a.query_id, COALESCE(c.label, a.label), COALESCE(c.road, a.road) FROM answers a "
    "LEFT JOIN corrections c ON c.query_id = a.query_id"
)
ANSWERS_SCHEMA = Schema(
    "answer book",
    (statements("the tables of release 0.1.0", *SCHEMA), statements("corrections (0.5.0)", *CORRECTIONS)),
)


class Road(StrEnum):
    """The roads an answer reaches a device by; each only delivers to the answer book."""

    PAGE = "page"  # the device's own label page
    LABELS_CSV = "labels.csv"  # a person's or a labelling tool's file in the oracle folder
    CENTRAL = "central"  # the coordinator's labelling queue


class LabelKind(StrEnum):
    """What a person's word on a query is: its first answer, or a correction of the answer it holds."""

    ANSWER = "answer"
    CORRECTION = "correction"


class Delivery(StrEnum):
    """What a delivery did: stored the first answer, found the same label held, found another answer held (the
    first answer stays: a second answer is never applied), corrected the label held, or found a newer correction
    held (a late copy of an older revision changes nothing)."""

    STORED = "stored"
    SAME = "same"
    CONFLICT = "conflict"
    CORRECTED = "corrected"
    STALE = "stale"


@dataclass(frozen=True)
class StoredAnswer:
    """One answer as the book keeps it."""

    query_id: str
    label: int
    road: str
    answered_by: str
    answered_at: float


def stored_answers(rows: list[tuple]) -> list[StoredAnswer]:
    """Rows of (query id, label, road, who, when) as StoredAnswers."""
    return [StoredAnswer(str(q), int(label), str(road), str(who), float(at)) for q, label, road, who, at in rows]


@dataclass(frozen=True)
class Held:
    """What the book holds of one query inside a delivery's transaction: its first answer's label and its latest
    correction's label and central revision (None where there is none)."""

    answer: int | None
    correction: int | None
    revision: int

    @property
    def current(self) -> int | None:
        """The label the query carries now (its correction's, else its answer's)."""
        return self.correction if self.correction is not None else self.answer


def delivery_of(held: Held, label: int, kind: LabelKind, road: Road, revision: int) -> Delivery:
    """What delivering `label` does to a query holding `held` (pure): the first answer is stored and stays; a
    correction replaces the label held unless it is a central revision no newer than one seen."""
    if held.current is None:
        return Delivery.STORED
    stale_revision = road is Road.CENTRAL and held.correction is not None and revision <= held.revision
    if held.current == label:
        return Delivery.SAME
    if kind is LabelKind.ANSWER or stale_revision:
        return Delivery.STALE if held.correction is not None else Delivery.CONFLICT
    return Delivery.CORRECTED


class AnswerBook:
    """ORACLE_DIR/answers.sqlite: one row per query id, written in one durable transaction (WAL, synchronous FULL)
    before `deliver` returns, so a road acknowledges an answer (a page's redirect, a receipt to the coordinator)
    only once it survives a crash. Delivering the same answer again, by any road, changes nothing; a correction
    replaces the label a query carries (a central one only when its revision is newer than any seen). Beside the
    answers: which queries the fleet's central queue confirmed holding, and which answers and corrections given on
    the device it was told of (`--labelling central`)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._lock = threading.Lock()
        self._conn = open_store(path, ANSWERS_SCHEMA)

    def deliver(
        self,
        query_id: str,
        label: int,
        road: Road,
        answered_by: str = "",
        answered_at: float = 0.0,
        kind: LabelKind = LabelKind.ANSWER,
        revision: int = 0,
    ) -> Delivery:
        """Records an answer or a correction of a query (the one function every road calls); durable when it
        returns. `revision` is a central correction's (0 for an answer or a correction made on the device)."""
        now = time.time()
        with self._lock, transaction(self._conn):
            delivery = self._record(query_id, int(label), road, answered_by[:64], answered_at or now, kind, revision)
        return delivery

    def _record(
        self, query_id: str, label: int, road: Road, by: str, at: float, kind: LabelKind, revision: int
    ) -> Delivery:
        """deliver's writes inside its transaction."""
        answer = self._conn.execute("SELECT label FROM answers WHERE query_id = ?", (query_id,)).fetchone()
        fix = self._conn.execute("SELECT label, revision FROM corrections WHERE query_id = ?", (query_id,)).fetchone()
        held = Held(None if answer is None else int(answer[0]), *((int(fix[0]), int(fix[1])) if fix else (None, 0)))
        delivery = delivery_of(held, label, kind, road, revision)
        now = time.time()
        if answer is None:
            self._conn.execute(
                "INSERT INTO answers VALUES (?, ?, ?, ?, ?, ?)", (query_id, label, road.value, by, at, now)
            )
        if kind is LabelKind.CORRECTION and delivery is not Delivery.STALE:
            newest = max(revision, held.revision)
            if delivery is Delivery.CORRECTED or (delivery is Delivery.STORED and road is Road.CENTRAL):
                reported = int(road is Road.CENTRAL)
                self._conn.execute(
                    "INSERT OR REPLACE INTO corrections VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    (query_id, label, newest, road.value, by, at, now, reported),
                )
            else:
                self._conn.execute("UPDATE corrections SET revision = ? WHERE query_id = ?", (newest, query_id))
        return delivery

    def labels(self) -> dict[str, int]:
        """Query id -> the label it carries now (its latest correction's, else its answer's; DECLINED for 'none of
        these')."""
        return {query_id: label for query_id, (label, _) in self.current().items()}

    def current(self) -> dict[str, tuple[int, str]]:
        """Query id -> (the label it carries now, the road that brought that label)."""
        with self._lock:
            return {str(query): (int(label), str(road)) for query, label, road in self._conn.execute(CURRENT_LABELS)}

    def corrected(self) -> set[str]:
        """The query ids whose label a correction set."""
        with self._lock:
            return {str(query_id) for (query_id,) in self._conn.execute("SELECT query_id FROM corrections")}

    def answers(self) -> list[StoredAnswer]:
        """Every stored first answer, in the order stored."""
        with self._lock:
            rows = self._conn.execute(
                "SELECT query_id, label, road, answered_by, answered_at FROM answers ORDER BY stored_at, rowid"
            ).fetchall()
        return stored_answers(rows)

    def unreported_corrections(self) -> list[StoredAnswer]:
        """The corrections made on the device (its page, labels.csv) that the queue was not told of yet."""
        with self._lock:
            rows = self._conn.execute(
                "SELECT query_id, label, road, corrected_by, corrected_at FROM corrections WHERE reported = 0 "
                "ORDER BY stored_at"
            ).fetchall()
        return stored_answers(rows)

    def note_correction_reported(self, query_id: str, label: int) -> None:
        """Notes that the queue was told of a correction made on the device (unless it changed again since)."""
        with self._lock:
            self._conn.execute(
                "UPDATE corrections SET reported = 1 WHERE query_id = ? AND label = ?", (query_id, label)
            )

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
