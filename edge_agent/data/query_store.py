# A query's whole life on a device in one SQLite store: asked (with the model's guess), sent to the fleet's queue,
# queued, answered and corrected by whatever road, taken into the labelled store.
from __future__ import annotations

import csv
import io
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from edge_agent.data.oracle import Guess
from protocol.errors import UsageError
from protocol.sqlite_store import Migration, Schema, open_store, statements, transaction

STORE_FILE = "answers.sqlite"  # (its name since release 0.1.0, when it held the answers alone)
QUERIES_DIR = "queries"
INDEX_FILE = "index.csv"  # queries/index.csv: the queries listed for people and tools, written, never read back
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


@dataclass(frozen=True)
class Query:
    """One image shown to a person: its copy (`<round>/<name>` under queries/), round, pool index, origin, when it
    was asked and the model's guess then (None: the device had none, or the query predates guesses being kept)."""

    file: str
    round_id: int
    index: int
    sha256: str
    source: str
    asked_at: float
    guess: Guess | None = None

    @property
    def name(self) -> str:
        """The copy's file name, unique across rounds: what labels.csv refers to."""
        return Path(self.file).name

    @property
    def query_id(self) -> str:
        """The query's key in the store and on the wire: its copy's name without the suffix."""
        return Path(self.file).stem

    def row(self) -> tuple:
        """The query as the store's columns (QUERY_COLUMNS)."""
        guess = (None, None, None, None) if self.guess is None else tuple(vars(self.guess).values())
        return (self.file, self.round_id, self.index, self.sha256, self.source, self.asked_at, *guess)


def query_of(row: tuple) -> Query:
    """A Query from the store's columns (QUERY_COLUMNS)."""
    file, round_id, index, sha256, source, asked_at, *guess = row
    held = None if guess[0] is None else Guess(int(guess[0]), float(guess[1]), float(guess[2]), float(guess[3]))
    return Query(str(file), int(round_id), int(index), str(sha256), str(source), float(asked_at), held)


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


class Road(StrEnum):
    """The roads an answer reaches a device by; each only delivers to the query store."""

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


class QueryStore:
    """ORACLE_DIR/answers.sqlite: each query's one record, from its asking (with the model's guess) to its label
    taken into the labelled store. Every write is one durable transaction (WAL, synchronous FULL) before it
    returns, so a road acknowledges an answer (a page's redirect, a receipt to the coordinator) only once it
    survives a crash. Delivering the same answer again, by any road, changes nothing; a correction replaces the
    label a query carries (a central one only when its revision is newer than any seen). The fleet's central queue's
    bookkeeping lives on the same record: when a query was sent, whether the queue holds it, whether it was told of
    answers and corrections given on the device. Whoever waits for news (`listen`) is called after each new query,
    answer or correction, instead of reading the store again and again."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._lock = threading.Lock()
        self._listeners: list[Callable[[], None]] = []
        self._conn = open_store(path, QUERY_SCHEMA)

    def listen(self, listener: Callable[[], None]) -> None:
        """Calls `listener` (on the writer's thread: it must only wake its own) after each new query, answer or
        correction is stored."""
        self._listeners.append(listener)

    def _changed(self) -> None:
        """Wakes the listeners: something they wait for was stored."""
        for listener in self._listeners:
            listener()

    def add(self, queries: list[Query]) -> None:
        """Records newly asked queries (their copies already in place), in one transaction."""
        if not queries:
            return
        rows = [(*query.row(), query.query_id) for query in queries]
        with self._lock, transaction(self._conn):
            self._conn.executemany(
                f"INSERT INTO queries ({QUERY_COLUMNS}, query_id) VALUES ({', '.join('?' * 11)})", rows
            )
        self._changed()

    def queries(self) -> list[Query]:
        """Every query ever asked, in the order asked."""
        return self._queries("")

    def query(self, name: str) -> Query | None:
        """The query whose copy's name or id is `name` (None: no such query)."""
        found = self._queries("WHERE query_id = ?", (Path(name).stem,))
        return next((query for query in found if name in (query.name, query.query_id)), None)

    def asked_indices(self) -> set[int]:
        """The pool indices ever asked."""
        with self._lock:
            return {int(index) for (index,) in self._conn.execute("SELECT pool_index FROM queries")}

    def unanswered(self) -> list[Query]:
        """The queries no road answered yet and the queue did not close without a label, in the order asked."""
        return self._queries("WHERE closed_at IS NULL AND query_id NOT IN (SELECT query_id FROM answers)")

    def to_send(self) -> list[Query]:
        """The queries the fleet's queue does not hold and nobody answered: those the central link sends."""
        return self._queries(
            "WHERE queued = 0 AND closed_at IS NULL AND query_id NOT IN (SELECT query_id FROM answers)"
        )

    def _queries(self, where: str, parameters: tuple = ()) -> list[Query]:
        """The queries a WHERE clause picks, in the order asked."""
        with self._lock:
            rows = self._conn.execute(f"SELECT {QUERY_COLUMNS} FROM queries {where} ORDER BY rowid", parameters)
            return [query_of(row) for row in rows]

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
        if delivery in (Delivery.STORED, Delivery.CORRECTED):
            self._changed()
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
        return self._answers(
            "SELECT query_id, label, road, answered_by, answered_at FROM answers ORDER BY stored_at, rowid"
        )

    def unreported_local_answers(self) -> list[StoredAnswer]:
        """The answers given on the device (its page, labels.csv) to queries the queue holds, which it was not told
        of yet."""
        return self._answers(
            "SELECT a.query_id, a.label, a.road, a.answered_by, a.answered_at FROM answers a JOIN queries q "
            "ON q.query_id = a.query_id WHERE a.road != 'central' AND q.queued = 1 AND q.answer_reported = 0 "
            "ORDER BY a.stored_at, a.rowid"
        )

    def unreported_corrections(self) -> list[StoredAnswer]:
        """The corrections made on the device (its page, labels.csv) that the queue was not told of yet."""
        return self._answers(
            "SELECT query_id, label, road, corrected_by, corrected_at FROM corrections WHERE reported = 0 "
            "ORDER BY stored_at"
        )

    def _answers(self, sql: str) -> list[StoredAnswer]:
        """The answers (or corrections) a query of (id, label, road, who, when) rows finds."""
        with self._lock:
            return stored_answers(self._conn.execute(sql).fetchall())

    def note_sent(self, query_id: str) -> None:
        """Notes that a query went to the fleet's queue now (it goes again until the queue confirms it)."""
        self._update("UPDATE queries SET sent_at = ? WHERE query_id = ?", (time.time(), query_id))

    def note_queued(self, query_id: str) -> None:
        """Notes that the fleet's labelling queue holds (or refused for good) a query: it is not sent again."""
        self._update("UPDATE queries SET queued = 1 WHERE query_id = ?", (query_id,))

    def note_closed(self, query_id: str) -> None:
        """Notes that the fleet's queue holds a query and closed it without a label for this device (a field test
        query): nothing waits for it and it is not sent again (its pool index stays asked, so it is never asked
        again)."""
        self._update(
            "UPDATE queries SET queued = 1, closed_at = COALESCE(closed_at, ?) WHERE query_id = ?",
            (time.time(), query_id),
        )

    def queued(self) -> set[str]:
        """The query ids the fleet's labelling queue holds or refused."""
        with self._lock:
            return {str(query_id) for (query_id,) in self._conn.execute("SELECT query_id FROM queries WHERE queued")}

    def note_reported(self, query_id: str) -> None:
        """Notes that the queue was told of an answer given on the device (it is not told again)."""
        self._update("UPDATE queries SET answer_reported = 1 WHERE query_id = ?", (query_id,))

    def reported(self) -> set[str]:
        """The query ids whose device-side answers the queue was told of."""
        with self._lock:
            rows = self._conn.execute("SELECT query_id FROM queries WHERE answer_reported")
            return {str(query_id) for (query_id,) in rows}

    def note_correction_reported(self, query_id: str, label: int) -> None:
        """Notes that the queue was told of a correction made on the device (unless it changed again since)."""
        self._update("UPDATE corrections SET reported = 1 WHERE query_id = ? AND label = ?", (query_id, label))

    def note_taken(self, pool_indices: list[int]) -> None:
        """Notes that the labels of the queries of these pool indices went into the labelled store now."""
        now = time.time()
        with self._lock, transaction(self._conn):
            self._conn.executemany(
                "UPDATE queries SET taken_at = ? WHERE pool_index = ?", [(now, index) for index in pool_indices]
            )

    def _update(self, sql: str, parameters: tuple) -> None:
        """One bookkeeping write in its own transaction."""
        with self._lock, transaction(self._conn):
            self._conn.execute(sql, parameters)

    def close(self) -> None:
        """Closes the database."""
        with self._lock:
            self._conn.close()
