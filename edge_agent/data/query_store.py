# A query's whole life on a device in one SQLite store: asked (with the model's guess), sent to the fleet's queue,
# queued, answered and corrected by whatever road, taken into the labelled store.
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

from edge_agent.data.query_records import (
    Delivery,
    Held,
    LabelKind,
    Query,
    Road,
    StoredAnswer,
    delivery_of,
    query_of,
    stored_answers,
)
from edge_agent.data.query_schema import CURRENT_LABELS, QUERY_COLUMNS, QUERY_SCHEMA
from protocol.sqlite_store import open_store, transaction


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
