# The labelling queue on disk: queries (SQLite rows, image files), people's votes and answers, and what was delivered.
from __future__ import annotations

import io
import sqlite3
import threading
import time
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from PIL import Image

from protocol import wire
from protocol.errors import FalError
from protocol.files import atomic_write_bytes
from protocol.label_messages import DEFAULT_MAX_IMAGE_BYTES, NONE_OF_THESE, QUERY_MEDIA_TYPES, LabelQuery
from protocol.sqlite_store import Schema, open_store, statements, transaction

QUEUE_FOLDER = "labelling"
DATABASE = "queue.sqlite"
IMAGES = "images"
FORMATS = {"image/png": "PNG", "image/jpeg": "JPEG"}
SUFFIXES = {"image/png": ".png", "image/jpeg": ".jpg"}
MAX_PIXELS = 4096 * 4096
DEVICE_ROADS = ("page", "labels.csv")  # the roads a device answers by besides the queue (edge_agent.data.answers)
SCHEMA = (
    "CREATE TABLE IF NOT EXISTS queries (device TEXT NOT NULL, query_id TEXT NOT NULL, media_type TEXT NOT NULL, "
    "image_bytes INTEGER NOT NULL, guess INTEGER NOT NULL, probability REAL NOT NULL, uncertainty REAL NOT NULL, "
    "score REAL NOT NULL, asked_at REAL NOT NULL, received_at REAL NOT NULL, label INTEGER, answered_by TEXT, "
    "answered_at REAL, delivered_at REAL, PRIMARY KEY (device, query_id))",
    "CREATE INDEX IF NOT EXISTS open_queries ON queries (label, guess)",
    "CREATE TABLE IF NOT EXISTS votes (device TEXT NOT NULL, query_id TEXT NOT NULL, person TEXT NOT NULL, "
    "label INTEGER NOT NULL, voted_at REAL NOT NULL, PRIMARY KEY (device, query_id, person))",
    "CREATE TABLE IF NOT EXISTS skips (device TEXT NOT NULL, query_id TEXT NOT NULL, person TEXT NOT NULL, "
    "PRIMARY KEY (device, query_id, person))",
)
QUEUE_SCHEMA = Schema("label queue", (statements("the tables of release 0.1.0", *SCHEMA),))
QUERY_COLUMNS = (
    "device, query_id, media_type, image_bytes, guess, probability, uncertainty, score, asked_at, label, answered_by"
)


class QueueRefusal(StrEnum):
    """Why a device's query was not queued (a stable label for logs and counters)."""

    TOO_LARGE = "too_large"
    UNDECODABLE = "undecodable"
    BAD_QUERY = "bad_query"
    UNKNOWN_DEVICE = "unknown_device"  # a secured fleet's desk holds no key of the device
    DEVICE_FULL = "device_full"
    QUEUE_FULL = "queue_full"


class AnswerError(FalError):
    """A person's answer the queue refuses, with the HTTP status that says why (404 unknown query, 409 answered
    already or voted already, 400 a label not in the spec)."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


@dataclass(frozen=True)
class QueueLimits:
    """How much the queue keeps: open queries per device and in all, the largest image accepted, and how many
    answered queries its devices have stored stay on disk (the newest; older ones' rows and images are removed)."""

    per_device: int = 500
    total: int = 10000
    image_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    kept_answered: int = 10000


@dataclass(frozen=True)
class QueuedQuery:
    """One query as the labelling page shows it."""

    device: str
    query_id: str
    media_type: str
    image_bytes: int
    guess: int
    probability: float
    uncertainty: float
    score: float
    asked_at: float
    label: int | None
    answered_by: str | None


@dataclass(frozen=True)
class Decided:
    """An answer decided by a vote: the query, its label and who gave it (the majority's voters)."""

    device: str
    query_id: str
    label: int
    answered_by: str
    answered_at: float


def image_refusal(image: bytes, media_type: str, limits: QueueLimits) -> QueueRefusal | None:
    """Why an image cannot be queued (too large, or not a decodable image of its declared type), or None."""
    if len(image) > limits.image_bytes:
        return QueueRefusal.TOO_LARGE
    if media_type not in QUERY_MEDIA_TYPES:
        return QueueRefusal.UNDECODABLE
    try:
        with Image.open(io.BytesIO(image)) as opened:
            width, height = opened.size
            if opened.format != FORMATS[media_type] or width * height > MAX_PIXELS:
                return QueueRefusal.UNDECODABLE
            opened.load()
    # PIL raises OSError (and ValueError, DecompressionBombError) for bytes it cannot decode: the sender's image
    except (OSError, ValueError, Image.DecompressionBombError):
        return QueueRefusal.UNDECODABLE
    return None


@dataclass(frozen=True)
class QueueStatus:
    """The queue at a glance: per device its open queries and the oldest one's age (seconds since the queue received
    it), and per person the answers they gave in the last hour (the fleet's labelling rate)."""

    open_by_device: dict[str, tuple[int, float]]
    answers_last_hour: dict[str, int]


class LabelQueue:
    """RUN_DIR/labelling/: queue.sqlite (queries, votes, skips; every write one durable transaction) and
    images/<device>/<query id>.<ext>. A query is decided when one label holds a majority of `voters` votes (1: the
    first answer decides); the decision is committed before anyone may send it to the device."""

    def __init__(
        self, run_dir: Path, class_names: tuple[str, ...], limits: QueueLimits | None = None, voters: int = 1
    ) -> None:
        if voters < 1:
            raise ValueError(f"voters must be at least 1, got {voters}")
        self.folder = Path(run_dir) / QUEUE_FOLDER
        self.folder.mkdir(parents=True, exist_ok=True)
        self.class_names = class_names
        self.limits = limits or QueueLimits()
        self.voters = voters
        self._lock = threading.Lock()
        self._conn = open_store(self.folder / DATABASE, QUEUE_SCHEMA)

    def image_path(self, device: str, query_id: str, media_type: str) -> Path:
        """Where a query's image is kept."""
        return self.folder / IMAGES / device / f"{query_id}{SUFFIXES[media_type]}"

    def add(self, query: LabelQuery, device: str) -> QueueRefusal | None:
        """Queues a device's query (its image written first, then its row); None when queued or already there."""
        valid_ids = wire.IDENTIFIER.fullmatch(query.query_id) and query.device_id == device
        if not valid_ids or not -1 <= query.guess < len(self.class_names):
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
            self._conn.execute(
                "INSERT INTO queries VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, NULL, NULL, NULL, NULL)",
                (
                    *(device, query.query_id, query.media_type, len(query.image), query.guess),
                    *(query.probability, query.uncertainty, query.score, query.asked_at, time.time()),
                ),
            )
        return None

    def next_for(self, person: str) -> QueuedQuery | None:
        """The open query worth most to the fleet that this person has neither answered nor skipped, each device
        taking its turn: a device's queries are ranked among themselves (rarest predicted class first, by the fewest
        answers of that class so far, then the device's score, then age) after the ones already answered, and every
        device's n-th comes before any device's (n+1)-th (ties: rarest class, then age). So what a device claims (its
        guesses, its scores) orders only its own queries: one device's hundred queries take one place in each turn,
        never the page."""
        with self._lock:
            row = self._conn.execute(
                f"SELECT {QUERY_COLUMNS} FROM (SELECT q.*, COALESCE(c.answered, 0) AS rarity, COALESCE(d.answered, 0) "
                "+ ROW_NUMBER() OVER (PARTITION BY q.device ORDER BY COALESCE(c.answered, 0), q.score DESC, "
                "q.received_at) AS turn FROM queries q LEFT JOIN (SELECT label AS class, COUNT(*) AS answered "
                "FROM queries WHERE label IS NOT NULL GROUP BY label) c ON c.class = q.guess LEFT JOIN (SELECT "
                "device AS asker, COUNT(*) AS answered FROM queries WHERE label IS NOT NULL GROUP BY device) d "
                "ON d.asker = q.device "
                "WHERE q.label IS NULL AND NOT EXISTS (SELECT 1 FROM votes v WHERE v.device = q.device AND "
                "v.query_id = q.query_id AND v.person = ?) AND NOT EXISTS (SELECT 1 FROM skips s WHERE "
                "s.device = q.device AND s.query_id = q.query_id AND s.person = ?)) "
                "ORDER BY turn, rarity, received_at LIMIT 1",
                (person, person),
            ).fetchone()
        return None if row is None else QueuedQuery(*row)

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

    def answer(self, device: str, query_id: str, label: int, person: str) -> Decided | None:
        """Records one person's vote; returns the decision when it decided the query (None: more votes needed).
        AnswerError for an unknown query, one decided already, a second vote of the same person, a bad label."""
        if not (0 <= label < len(self.class_names) or label == NONE_OF_THESE):
            raise AnswerError(
                400,
                f"label {wire.shown(label)} is not a class of the spec (0..{len(self.class_names) - 1}, or -1: none)",
            )
        now = time.time()
        with self._lock, transaction(self._conn):
            return self._vote(device, query_id, label, person, now)

    def _vote(self, device: str, query_id: str, label: int, person: str, now: float) -> Decided | None:
        """The vote inside answer's transaction."""
        row = self._conn.execute(
            "SELECT label FROM queries WHERE device = ? AND query_id = ?", (device, query_id)
        ).fetchone()
        if row is None:
            raise AnswerError(404, f"no query {wire.shown(query_id)} of device {wire.shown(device)}")
        if row[0] is not None:
            raise AnswerError(409, f"query {wire.shown(query_id)} is answered already")
        try:
            self._conn.execute("INSERT INTO votes VALUES (?, ?, ?, ?, ?)", (device, query_id, person, label, now))
        except sqlite3.IntegrityError:
            raise AnswerError(409, f"{wire.shown(person)} answered query {wire.shown(query_id)} already") from None
        voters = [
            str(voter)
            for (voter,) in self._conn.execute(
                "SELECT person FROM votes WHERE device = ? AND query_id = ? AND label = ? ORDER BY voted_at",
                (device, query_id, label),
            )
        ]
        if len(voters) < self.voters // 2 + 1:
            return None
        answered_by = ",".join(voters)[:200]
        self._conn.execute(
            "UPDATE queries SET label = ?, answered_by = ?, answered_at = ? WHERE device = ? AND query_id = ?",
            (label, answered_by, now, device, query_id),
        )
        return Decided(device, query_id, label, answered_by, now)

    def skip(self, device: str, query_id: str, person: str) -> None:
        """Notes that a person skipped a query (it is not shown to them again); AnswerError(404) if unknown."""
        if self.get(device, query_id) is None:
            raise AnswerError(404, f"no query {wire.shown(query_id)} of device {wire.shown(device)}")
        with self._lock, transaction(self._conn):
            self._conn.execute("INSERT OR IGNORE INTO skips VALUES (?, ?, ?)", (device, query_id, person))

    def answered_on_device(self, device: str, query_id: str, label: int, road: str) -> bool:
        """Closes an open query its device answered by another road (delivered already: it is the device's own
        answer); False for no such open query or a label outside the spec."""
        if not (0 <= label < len(self.class_names) or label == NONE_OF_THESE):
            return False
        who = f"{device}:{road if road in DEVICE_ROADS else 'device'}"
        now = time.time()
        with self._lock, transaction(self._conn):
            cursor = self._conn.execute(
                "UPDATE queries SET label = ?, answered_by = ?, answered_at = ?, delivered_at = ? "
                "WHERE device = ? AND query_id = ? AND label IS NULL",
                (label, who, now, now, device, query_id),
            )
            self._prune()
        return cursor.rowcount > 0

    def undelivered(self) -> list[Decided]:
        """Decided answers the device has not confirmed storing yet, oldest first."""
        with self._lock:
            rows = self._conn.execute(
                "SELECT device, query_id, label, answered_by, answered_at FROM queries "
                "WHERE label IS NOT NULL AND delivered_at IS NULL ORDER BY answered_at"
            ).fetchall()
        return [Decided(*row) for row in rows]

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

    def _prune(self) -> None:
        """Removes the answered, delivered queries beyond the newest `kept_answered`: rows, votes, skips, images."""
        old = self._conn.execute(
            "SELECT device, query_id, media_type FROM queries WHERE delivered_at IS NOT NULL "
            "ORDER BY answered_at DESC, rowid DESC LIMIT -1 OFFSET ?",
            (self.limits.kept_answered,),
        ).fetchall()
        for device, query_id, media_type in old:
            self.image_path(device, query_id, media_type).unlink(missing_ok=True)
            for table in ("queries", "votes", "skips"):
                self._conn.execute(f"DELETE FROM {table} WHERE device = ? AND query_id = ?", (device, query_id))

    def depth(self) -> dict[str, int]:
        """Open queries per device."""
        with self._lock:
            rows = self._conn.execute("SELECT device, COUNT(*) FROM queries WHERE label IS NULL GROUP BY device")
            return {str(device): int(count) for device, count in rows}

    def status(self, now: float) -> QueueStatus:
        """Open queries and the oldest one's age per device, and answers per person in the hour before `now`."""
        with self._lock:
            open_rows = self._conn.execute(
                "SELECT device, COUNT(*), MIN(received_at) FROM queries WHERE label IS NULL GROUP BY device"
            ).fetchall()
            people = self._conn.execute(
                "SELECT person, COUNT(*) FROM votes WHERE voted_at > ? GROUP BY person", (now - 3600.0,)
            ).fetchall()
        return QueueStatus(
            {str(device): (int(count), max(0.0, now - float(oldest))) for device, count, oldest in open_rows},
            {str(person): int(count) for person, count in people},
        )

    def close(self) -> None:
        """Closes the database."""
        with self._lock:
            self._conn.close()

    def _one(self, sql: str, *parameters: object) -> int:
        """The single integer a query returns."""
        return int(self._conn.execute(sql, parameters).fetchone()[0])
