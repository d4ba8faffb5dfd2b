# The labelling queue on disk: queries (SQLite rows, image files), people's votes, answers and corrections, the
# answers held for an undo, and what was delivered.
from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from coordinator.labelling.field_set import FieldAnswer, field_answers, image_file
from coordinator.labelling.queue_records import (
    AnswerError,
    Correction,
    Decided,
    Given,
    Outcome,
    QueuedQuery,
    QueueLimits,
    QueueRefusal,
    QueueStatus,
    Recorded,
    Recording,
    Tally,
    Undone,
    UndoWindow,
    image_refusal,
    midnight,
    query_kind,
)
from coordinator.labelling.queue_schema import (
    DATABASE,
    DEVICE_ROADS,
    DUE_HELD,
    FIELD_SET,
    FIELD_TEST,
    LABEL,
    NOT_HELD,
    QUERY_COLUMNS,
    QUEUE_FOLDER,
    QUEUE_SCHEMA,
    RANKED,
)
from protocol import wire
from protocol.files import atomic_write_bytes
from protocol.label_messages import NO_GUESS, NONE_OF_THESE, LabelQuery
from protocol.sqlite_store import open_store, transaction


class LabelQueue:
    """RUN_DIR/labelling/: queue.sqlite (queries, votes, skips, held answers, corrections; every write one durable
    transaction) and images/<device>/<query id>.<ext>. A query is decided when one label holds a majority of
    `voters` votes (1: the first answer decides); the decision is committed before anyone may send it to the device.
    A decision from the page waits as `undo` says before it may be sent; a change after it was sent is a
    correction, sent to the device in its turn. `record` is the one way in for every answer and correction.

    A share `field_test_share` of the queries (`query_kind`) is marked FIELD_TEST when queued, for good: its
    answer is the field's test set (`field_set`), never sent to its device (a change of it stays in place)."""

    def __init__(
        self,
        run_dir: Path,
        class_names: tuple[str, ...],
        limits: QueueLimits | None = None,
        voters: int = 1,
        undo: UndoWindow | None = None,
        field_test_share: float = 0.0,
    ) -> None:
        if voters < 1:
            raise ValueError(f"voters must be at least 1, got {voters}")
        if not 0.0 <= field_test_share < 1.0:
            raise ValueError(f"field_test_share must lie in [0, 1), got {field_test_share}")
        self.folder = Path(run_dir) / QUEUE_FOLDER
        self.folder.mkdir(parents=True, exist_ok=True)
        self.class_names = class_names
        self.limits = limits or QueueLimits()
        self.voters = voters
        self.undo_window = undo or UndoWindow()
        self.field_test_share = field_test_share
        self._lock = threading.Lock()
        self._conn = open_store(self.folder / DATABASE, QUEUE_SCHEMA)

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        """One durable write transaction under the queue's lock: committed when the block ends, rolled back when it
        raises."""
        with self._lock, transaction(self._conn):
            yield

    def image_path(self, device: str, query_id: str, media_type: str) -> Path:
        """Where a query's image is kept."""
        return image_file(self.folder, device, query_id, media_type)

    def add(self, query: LabelQuery, device: str) -> QueueRefusal | None:
        """Queues a device's query (its image written first, then its row, with its kind); None when queued or
        already there (its kind as it was decided then)."""
        valid_ids = wire.IDENTIFIER.fullmatch(query.query_id) and query.device_id == device
        if not valid_ids or not (query.guess == NO_GUESS or 0 <= query.guess < len(self.class_names)):
            return QueueRefusal.BAD_QUERY
        refusal = image_refusal(query.image, query.media_type, self.limits)
        if refusal is not None:
            return refusal
        with self._lock, transaction(self._conn):
            if self._one("SELECT COUNT(*) FROM queries WHERE device = ? AND query_id = ?", device, query.query_id):
                return None
            if self._one("SELECT COUNT(*) FROM queries WHERE label IS NULL AND device = ?", device) >= (
                self.limits.per_device
            ):
                return QueueRefusal.DEVICE_FULL
            if self._one("SELECT COUNT(*) FROM queries WHERE label IS NULL") >= self.limits.total:
                return QueueRefusal.QUEUE_FULL
            atomic_write_bytes(self.image_path(device, query.query_id, query.media_type), query.image)
            kind = query_kind(device, query.query_id, self.field_test_share)
            self._conn.execute(
                "INSERT INTO queries (device, query_id, media_type, image_bytes, guess, probability, uncertainty, "
                "score, asked_at, received_at, kind) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    *(device, query.query_id, query.media_type, len(query.image), query.guess),
                    *(query.probability, query.uncertainty, query.score, query.asked_at, time.time(), kind),
                ),
            )
        return None

    def is_field_test(self, device: str, query_id: str) -> bool:
        """Whether a queued query is a field test query (False for one not queued)."""
        with self._lock:
            return bool(
                self._one(
                    "SELECT COUNT(*) FROM queries WHERE device = ? AND query_id = ? AND kind = ?",
                    device,
                    query_id,
                    FIELD_TEST,
                )
            )

    def field_set(self) -> list[FieldAnswer]:
        """The field's test set as it stands (FIELD_SET), oldest answer first."""
        with self._lock:
            rows = self._conn.execute(FIELD_SET).fetchall()
        return field_answers(self.folder, rows)

    def next_for(self, person: str) -> QueuedQuery | None:
        """The open query worth most to the fleet that this person has neither answered nor skipped, each device
        taking its turn: a device's queries are ranked among themselves (rarest predicted class first, by the fewest
        answers of that class so far, then the device's score, then age) after the ones already answered, and every
        device's n-th comes before any device's (n+1)-th (ties: rarest class, then age). So what a device claims (its
        guesses, its scores) orders only its own queries: one device's hundred queries take one place in each turn,
        never the page."""
        found = self._ranked(person, None, 1)
        return found[0] if found else None

    def grid_for(self, person: str, size: int, guess: int | None = None) -> list[QueuedQuery]:
        """A page of up to `size` open queries of this person whose model guess is one class (`guess`, or the class
        with the most such queries, the rarest by answers on a tie), in the order `next_for` would show them."""
        if guess is None:
            with self._lock:
                row = self._conn.execute(
                    f"SELECT guess FROM ({RANKED}) WHERE guess >= 0 GROUP BY guess ORDER BY COUNT(*) DESC, "
                    "MIN(rarity), guess LIMIT 1",
                    {"person": person},
                ).fetchone()
            if row is None:
                return []
            guess = int(row[0])
        return self._ranked(person, guess, size)

    def _ranked(self, person: str, guess: int | None, limit: int) -> list[QueuedQuery]:
        """The first `limit` open queries of a person in the page's order, of one guessed class or any."""
        where = "" if guess is None else "WHERE guess = :guess"
        with self._lock:
            rows = self._conn.execute(
                f"SELECT {QUERY_COLUMNS} FROM ({RANKED}) {where} ORDER BY turn, rarity, received_at LIMIT :limit",
                {"person": person, "guess": guess, "limit": limit},
            ).fetchall()
        return [QueuedQuery(*row) for row in rows]

    def get(self, device: str, query_id: str) -> QueuedQuery | None:
        """One query, or None."""
        with self._lock:
            row = self._conn.execute(
                f"SELECT {QUERY_COLUMNS} FROM queries WHERE device = ? AND query_id = ?", (device, query_id)
            ).fetchone()
        return None if row is None else QueuedQuery(*row)

    def all(self) -> list[QueuedQuery]:
        """Every query, oldest first."""
        with self._lock:
            rows = self._conn.execute(f"SELECT {QUERY_COLUMNS} FROM queries ORDER BY received_at, rowid").fetchall()
        return [QueuedQuery(*row) for row in rows]

    def record(
        self, device: str, query_id: str, label: int, person: str, change: bool = False, hold: bool = False
    ) -> Recorded:
        """The one way a person's word enters the queue (the page, its grid, an import): a vote on an open query
        (deciding it when a majority holds; with `hold`, the decision waits for an undo as `undo_window` says), or
        with `change` a new label for a decided query (in place while its answer is not sent yet, else a
        correction). AnswerError for an unknown query, a label outside the spec, a second answer without `change`."""
        return self.record_all([(device, query_id)], label, person, change, hold).recorded[0]

    def record_all(
        self, queries: Sequence[tuple[str, str]], label: int, person: str, change: bool = False, hold: bool = False
    ) -> Recording:
        """`record` for several queries (a grid's) in one transaction: all of them, or (AnswerError) none; held
        answers it pushes out of their undo window are let go in the same transaction."""
        self._check_label(label)
        now = time.time()
        with self._transaction():
            recorded = [
                self._record(device, query_id, label, person, change, hold, now) for device, query_id in queries
            ]
            released = self._release(now) if hold else []
        return Recording(recorded, released)

    def _check_label(self, label: int) -> None:
        """AnswerError(400) for a label that is neither a class of the spec nor NONE_OF_THESE."""
        if not (0 <= label < len(self.class_names) or label == NONE_OF_THESE):
            raise AnswerError(
                400,
                f"label {wire.shown(label)} is not a class of the spec (0..{len(self.class_names) - 1}, or -1: none)",
            )

    def _record(
        self, device: str, query_id: str, label: int, person: str, change: bool, hold: bool, now: float
    ) -> Recorded:
        """One query's part of record_all, inside its transaction."""
        row = self._conn.execute(
            "SELECT label, kind FROM queries WHERE device = ? AND query_id = ?", (device, query_id)
        ).fetchone()
        if row is None:
            raise AnswerError(404, f"no query {wire.shown(query_id)} of device {wire.shown(device)}")
        field_test = row[1] == FIELD_TEST
        if row[0] is None:
            return self._vote(device, query_id, label, person, change, hold, now, field_test)
        if not change:
            raise AnswerError(409, f"query {wire.shown(query_id)} of device {wire.shown(device)} is answered already")
        if int(row[0]) == label:
            return Recorded(Outcome.UNCHANGED)
        self._upsert_vote(device, query_id, label, person, now)
        self._conn.execute("UPDATE queries SET label = ? WHERE device = ? AND query_id = ?", (label, device, query_id))
        if field_test or self._one("SELECT COUNT(*) FROM held WHERE device = ? AND query_id = ?", device, query_id):
            self._conn.execute(
                "UPDATE queries SET answered_by = ? WHERE device = ? AND query_id = ?", (person, device, query_id)
            )
            return Recorded(Outcome.REPLACED)
        return Recorded(Outcome.CORRECTED, correction=self._correct(device, query_id, label, person, now, None))

    def _vote(
        self,
        device: str,
        query_id: str,
        label: int,
        person: str,
        change: bool,
        hold: bool,
        now: float,
        field_test: bool,
    ) -> Recorded:
        """A person's vote on an open query (a second vote of the same person only with `change`, replacing the
        first), and the decision when a majority holds."""
        if not change and self._one(
            "SELECT COUNT(*) FROM votes WHERE device = ? AND query_id = ? AND person = ?", device, query_id, person
        ):
            raise AnswerError(409, f"{wire.shown(person)} answered query {wire.shown(query_id)} already")
        self._upsert_vote(device, query_id, label, person, now)
        voters = [
            str(voter)
            for (voter,) in self._conn.execute(
                "SELECT person FROM votes WHERE device = ? AND query_id = ? AND label = ? ORDER BY voted_at",
                (device, query_id, label),
            )
        ]
        if len(voters) < self.voters // 2 + 1:
            return Recorded(Outcome.VOTED)
        answered_by = ",".join(voters)[:200]
        self._conn.execute(
            "UPDATE queries SET label = ?, answered_by = ?, answered_at = ? WHERE device = ? AND query_id = ?",
            (label, answered_by, now, device, query_id),
        )
        if hold:
            self._conn.execute(
                "INSERT OR REPLACE INTO held VALUES (?, ?, ?, ?)",
                (device, query_id, person, now + self.undo_window.seconds),
            )
        decided = Decided(device, query_id, label, answered_by, now, field_test)
        return Recorded(Outcome.DECIDED, decided=decided, held=hold)

    def _upsert_vote(self, device: str, query_id: str, label: int, person: str, now: float) -> None:
        """A person's vote on a query, replacing theirs if they gave one."""
        self._conn.execute(
            "INSERT INTO votes VALUES (?, ?, ?, ?, ?) ON CONFLICT (device, query_id, person) DO UPDATE SET "
            "label = excluded.label, voted_at = excluded.voted_at",
            (device, query_id, person, label, now),
        )

    def _correct(
        self, device: str, query_id: str, label: int, who: str, now: float, delivered_at: float | None
    ) -> Correction:
        """Notes a correction of a sent answer (its revision one past the query's last), undelivered unless its
        device made it (`delivered_at`)."""
        revision = 1 + self._one(
            "SELECT COALESCE(MAX(revision), 0) FROM corrections WHERE device = ? AND query_id = ?", device, query_id
        )
        self._conn.execute(
            "INSERT OR REPLACE INTO corrections VALUES (?, ?, ?, ?, ?, ?, ?)",
            (device, query_id, label, revision, who, now, delivered_at),
        )
        return Correction(device, query_id, label, revision, who, now)

    def undo(self, person: str) -> tuple[QueuedQuery, Undone] | None:
        """Takes back this person's latest answer while it is not sent (held for an undo, or a vote that decided
        nothing yet): the query is open again. An answer sent already is returned as it is (`SENT`: it can only be
        corrected now); None when the person has no answer left."""
        with self._transaction():
            found = self._undo(person)
        if found is None:
            return None
        query = self.get(*found[:2])
        return None if query is None else (query, found[2])

    def _undo(self, person: str) -> tuple[str, str, Undone] | None:
        """undo's reads and writes inside its transaction."""
        row = self._conn.execute(
            "SELECT v.device, v.query_id, q.label IS NULL, EXISTS (SELECT 1 FROM held h WHERE h.device = v.device "
            "AND h.query_id = v.query_id) FROM votes v JOIN queries q ON q.device = v.device AND q.query_id = "
            "v.query_id WHERE v.person = ? ORDER BY v.voted_at DESC, v.rowid DESC LIMIT 1",
            (person,),
        ).fetchone()
        if row is None:
            return None
        device, query_id, still_open, held = str(row[0]), str(row[1]), bool(row[2]), bool(row[3])
        if not (still_open or held):
            return device, query_id, Undone.SENT
        key = (device, query_id)
        self._conn.execute("DELETE FROM votes WHERE device = ? AND query_id = ? AND person = ?", (*key, person))
        self._conn.execute("DELETE FROM held WHERE device = ? AND query_id = ?", key)
        self._conn.execute(
            "UPDATE queries SET label = NULL, answered_by = NULL, answered_at = NULL WHERE device = ? AND query_id = ?",
            key,
        )
        return device, query_id, Undone.WITHDRAWN

    def release(self, now: float) -> list[Decided]:
        """Lets held answers go to their devices once their hold is over (its time passed, or the person gave
        `undo_window.answers` newer ones); the answers let go (a look that finds none writes nothing)."""
        with self._lock:
            due = self._conn.execute(f"SELECT 1 FROM ({DUE_HELD}) LIMIT 1", self._due_parameters(now)).fetchone()
        if due is None:
            return []
        with self._transaction():
            return self._release(now)

    def _release(self, now: float) -> list[Decided]:
        """release's reads and writes inside a transaction."""
        due = self._conn.execute(
            "SELECT q.device, q.query_id, q.label, q.answered_by, q.answered_at, q.kind FROM queries q JOIN "
            f"({DUE_HELD}) h ON q.device = h.device AND q.query_id = h.query_id",
            self._due_parameters(now),
        ).fetchall()
        self._conn.executemany("DELETE FROM held WHERE device = ? AND query_id = ?", [(row[0], row[1]) for row in due])
        return [Decided(*row[:5]) for row in due if row[5] == LABEL]

    def _due_parameters(self, now: float) -> dict[str, float]:
        """The parameters of DUE_HELD."""
        return {"now": now, "answers": self.undo_window.answers}

    def history(self, person: str, limit: int) -> list[Given]:
        """This person's latest `limit` answers, newest first, with where each stands."""
        with self._lock:
            rows = self._conn.execute(
                "SELECT v.device, v.query_id, v.label, q.label, v.voted_at, CASE WHEN q.label IS NULL THEN 'waiting' "
                "WHEN h.until IS NOT NULL THEN 'held' WHEN c.revision IS NOT NULL AND c.delivered_at IS NULL THEN "
                "'correction sent' WHEN c.revision IS NOT NULL THEN 'corrected' WHEN q.delivered_at IS NULL THEN "
                "'sent' ELSE 'delivered' END FROM votes v JOIN queries q ON q.device = v.device AND q.query_id = "
                "v.query_id LEFT JOIN held h ON h.device = v.device AND h.query_id = v.query_id LEFT JOIN corrections "
                "c ON c.device = v.device AND c.query_id = v.query_id WHERE v.person = ? "
                "ORDER BY v.voted_at DESC, v.rowid DESC LIMIT ?",
                (person, limit),
            ).fetchall()
        return [
            Given(str(device), str(query_id), int(given), None if label is None else int(label), str(state), float(at))
            for device, query_id, given, label, at, state in rows
        ]

    def skip(self, device: str, query_id: str, person: str) -> None:
        """Notes that a person skipped a query (it is not shown to them again); AnswerError(404) if unknown."""
        if self.get(device, query_id) is None:
            raise AnswerError(404, f"no query {wire.shown(query_id)} of device {wire.shown(device)}")
        with self._lock, transaction(self._conn):
            self._conn.execute("INSERT OR IGNORE INTO skips VALUES (?, ?, ?)", (device, query_id, person))

    def answered_on_device(self, device: str, query_id: str, label: int, road: str) -> bool:
        """Takes an answer its device got by another road (delivered already: it is the device's own word): an open
        query is closed with it, a decided one corrected to it; False for no such query, a label outside the spec or
        the label the query holds."""
        if not (0 <= label < len(self.class_names) or label == NONE_OF_THESE):
            return False
        who = f"{device}:{road if road in DEVICE_ROADS else 'device'}"
        now = time.time()
        with self._transaction():
            taken = self._device_word(device, query_id, label, who, now)
            self._prune()
        return taken

    def _device_word(self, device: str, query_id: str, label: int, who: str, now: float) -> bool:
        """answered_on_device's writes inside its transaction (the query noted as labelled by its device)."""
        row = self._conn.execute(
            "SELECT label FROM queries WHERE device = ? AND query_id = ?", (device, query_id)
        ).fetchone()
        if row is None or row[0] == label:
            return False
        self._conn.execute(
            "UPDATE queries SET label = ?, answered_by = COALESCE(answered_by, ?), answered_at = COALESCE(answered_at, "
            "?), delivered_at = COALESCE(delivered_at, ?), device_word = 1 WHERE device = ? AND query_id = ?",
            (label, who, now, now, device, query_id),
        )
        self._conn.execute("DELETE FROM held WHERE device = ? AND query_id = ?", (device, query_id))
        if row[0] is not None:
            self._correct(device, query_id, label, who, now, now)
        return True

    def undelivered(self) -> list[Decided]:
        """Decided answers of label queries (a field test query's is never sent), no longer held for an undo, that
        the device has not confirmed storing yet, oldest first."""
        with self._lock:
            rows = self._conn.execute(
                "SELECT device, query_id, label, answered_by, answered_at FROM queries q WHERE label IS NOT NULL "
                f"AND delivered_at IS NULL AND kind = '{LABEL}' AND {NOT_HELD} ORDER BY answered_at"
            ).fetchall()
        return [Decided(*row) for row in rows]

    def undelivered_corrections(self) -> list[Correction]:
        """Corrections whose devices have not confirmed storing them yet, oldest first."""
        with self._lock:
            rows = self._conn.execute(
                "SELECT device, query_id, label, revision, corrected_by, corrected_at FROM corrections "
                "WHERE delivered_at IS NULL ORDER BY corrected_at"
            ).fetchall()
        return [Correction(*row) for row in rows]

    def delivered(self, device: str, query_id: str) -> bool:
        """Notes a device's receipt of an answer; False when there was no such undelivered answer."""
        with self._lock, transaction(self._conn):
            cursor = self._conn.execute(
                "UPDATE queries SET delivered_at = ? WHERE device = ? AND query_id = ? AND label IS NOT NULL "
                "AND delivered_at IS NULL",
                (time.time(), device, query_id),
            )
            self._prune()
        return cursor.rowcount > 0

    def correction_delivered(self, device: str, query_id: str, revision: int) -> bool:
        """Notes a device's receipt of a correction's revision; False when it is not the query's undelivered one (an
        older revision's receipt does not settle a newer one)."""
        with self._lock:
            cursor = self._conn.execute(
                "UPDATE corrections SET delivered_at = ? WHERE device = ? AND query_id = ? AND revision = ? "
                "AND delivered_at IS NULL",
                (time.time(), device, query_id, revision),
            )
            self._prune()
        return cursor.rowcount > 0

    def _prune(self) -> None:
        """Removes the answered, delivered (and corrections delivered) queries and the answered field test queries
        out of their hold beyond the newest `kept_answered`: rows, votes, skips, corrections, images."""
        old = self._conn.execute(
            f"SELECT device, query_id, media_type FROM queries q WHERE (delivered_at IS NOT NULL OR (kind = "
            f"'{FIELD_TEST}' AND label IS NOT NULL AND {NOT_HELD})) AND NOT EXISTS (SELECT 1 FROM corrections c "
            "WHERE c.device = q.device AND c.query_id = q.query_id AND c.delivered_at IS NULL) "
            "ORDER BY answered_at DESC, rowid DESC LIMIT -1 OFFSET ?",
            (self.limits.kept_answered,),
        ).fetchall()
        for device, query_id, media_type in old:
            self.image_path(device, query_id, media_type).unlink(missing_ok=True)
            for table in ("queries", "votes", "skips", "corrections"):
                self._conn.execute(f"DELETE FROM {table} WHERE device = ? AND query_id = ?", (device, query_id))

    def depth(self) -> dict[str, int]:
        """Open queries per device."""
        with self._lock:
            rows = self._conn.execute("SELECT device, COUNT(*) FROM queries WHERE label IS NULL GROUP BY device")
            return {str(device): int(count) for device, count in rows}

    def tally(self, person: str, now: float) -> Tally:
        """A person's answers since `now`'s local midnight, and the corrections made in all (the page's counts)."""
        with self._lock:
            today = self._one("SELECT COUNT(*) FROM votes WHERE person = ? AND voted_at > ?", person, midnight(now))
            corrections = self._one("SELECT COALESCE(SUM(revision), 0) FROM corrections")
        return Tally(today, corrections)

    def status(self, now: float) -> QueueStatus:
        """Open queries and the oldest one's age per device, answers per person in the hour before `now` and since
        that day's local midnight, the answers held for an undo, and the corrections made (and undelivered)."""
        with self._lock:
            open_rows = self._conn.execute(
                "SELECT device, COUNT(*), MIN(received_at) FROM queries WHERE label IS NULL GROUP BY device"
            ).fetchall()
            hour, today = (
                self._conn.execute(
                    "SELECT person, COUNT(*) FROM votes WHERE voted_at > ? GROUP BY person", (since,)
                ).fetchall()
                for since in (now - 3600.0, midnight(now))
            )
            corrections, undelivered = self._conn.execute(
                "SELECT COALESCE(SUM(revision), 0), COUNT(*) - COUNT(delivered_at) FROM corrections"
            ).fetchone()
            held = self._one("SELECT COUNT(*) FROM held")
        return QueueStatus(
            {str(device): (int(count), max(0.0, now - float(oldest))) for device, count, oldest in open_rows},
            {str(person): int(count) for person, count in hour},
            {str(person): int(count) for person, count in today},
            held,
            int(corrections),
            int(undelivered),
        )

    def close(self) -> None:
        """Closes the database."""
        with self._lock:
            self._conn.close()

    def _one(self, sql: str, *parameters: object) -> int:
        """The single integer a query returns."""
        return int(self._conn.execute(sql, parameters).fetchone()[0])
