# The labelling queue's SQLite schema: its tables, their ordered migrations, and the queries the queue reads by.
from __future__ import annotations

from protocol.sqlite_store import Schema, statements

QUEUE_FOLDER = "labelling"
DATABASE = "queue.sqlite"
IMAGES = "images"
FORMATS = {"image/png": "PNG", "image/jpeg": "JPEG"}
SUFFIXES = {"image/png": ".png", "image/jpeg": ".jpg"}
MAX_PIXELS = 4096 * 4096
DEVICE_ROADS = ("page", "labels.csv")  # the roads a device answers by besides the queue (edge_agent.data.query_store)
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
UNDO_AND_CORRECTIONS = (
    "CREATE INDEX IF NOT EXISTS votes_by_person ON votes (person, voted_at)",  # a person's history and count today
    # a page's decided answer that is not sent yet, so its person may still undo it
    "CREATE TABLE IF NOT EXISTS held (device TEXT NOT NULL, query_id TEXT NOT NULL, person TEXT NOT NULL, "
    "until REAL NOT NULL, PRIMARY KEY (device, query_id))",
    # a query's latest correction after its answer was sent: its revision counts the corrections
    "CREATE TABLE IF NOT EXISTS corrections (device TEXT NOT NULL, query_id TEXT NOT NULL, label INTEGER NOT NULL, "
    "revision INTEGER NOT NULL, corrected_by TEXT NOT NULL, corrected_at REAL NOT NULL, delivered_at REAL, "
    "PRIMARY KEY (device, query_id))",
)
LABEL, FIELD_TEST = "label", "field_test"  # a query's kind: its answer trains its device, or judges models
KINDS = (
    # what a query's answer is for, decided when it is queued: a label sent to its device, or a field test label
    # kept by the coordinator (never sent, never trained on)
    f"ALTER TABLE queries ADD COLUMN kind TEXT NOT NULL DEFAULT '{LABEL}'",
    # whether its device labelled it by its own road (its page, labels.csv): that label trains there
    "ALTER TABLE queries ADD COLUMN device_word INTEGER NOT NULL DEFAULT 0",
)
QUEUE_SCHEMA = Schema(
    "label queue",
    (
        statements("the tables of release 0.1.0", *SCHEMA),
        statements("answers held for an undo, and corrections (0.5.0)", *UNDO_AND_CORRECTIONS),
        statements("each query's kind: field test queries (0.5.0)", *KINDS),
    ),
)
# The field's test set: field test queries answered with a class by the queue's people (not by their device's own
# road), whose answer is out of its undo hold.
FIELD_SET = (
    f"SELECT device, query_id, media_type, label FROM queries q WHERE kind = '{FIELD_TEST}' AND label >= 0 AND "
    "device_word = 0 AND NOT EXISTS (SELECT 1 FROM held h WHERE h.device = q.device AND h.query_id = q.query_id) "
    "ORDER BY answered_at, rowid"
)
QUERY_COLUMNS = (
    "device, query_id, media_type, image_bytes, guess, probability, uncertainty, score, asked_at, label, answered_by"
)
# The open queries a person has neither answered nor skipped, each with its place in the page's order: a device's
# queries ranked among themselves (rarest guessed class by answers so far, then score, then age) after its answered
# ones (`turn`), and the rarity of its guessed class.
RANKED = (
    "SELECT q.*, COALESCE(c.answered, 0) AS rarity, COALESCE(d.answered, 0) + ROW_NUMBER() OVER (PARTITION BY "
    "q.device ORDER BY COALESCE(c.answered, 0), q.score DESC, q.received_at) AS turn FROM queries q LEFT JOIN "
    "(SELECT label AS class, COUNT(*) AS answered FROM queries WHERE label IS NOT NULL GROUP BY label) c ON c.class "
    "= q.guess LEFT JOIN (SELECT device AS asker, COUNT(*) AS answered FROM queries WHERE label IS NOT NULL GROUP BY "
    "device) d ON d.asker = q.device WHERE q.label IS NULL AND NOT EXISTS (SELECT 1 FROM votes v WHERE v.device = "
    "q.device AND v.query_id = q.query_id AND v.person = :person) AND NOT EXISTS (SELECT 1 FROM skips s WHERE "
    "s.device = q.device AND s.query_id = q.query_id AND s.person = :person)"
)
# The held answers whose hold is over: their time passed, or their person gave `answers` newer held ones.
DUE_HELD = (
    "SELECT device, query_id FROM (SELECT device, query_id, until, ROW_NUMBER() OVER (PARTITION BY person ORDER BY "
    "until DESC, rowid DESC) AS newest FROM held) WHERE until <= :now OR newest > :answers"
)
NOT_HELD = "NOT EXISTS (SELECT 1 FROM held h WHERE h.device = q.device AND h.query_id = q.query_id)"
