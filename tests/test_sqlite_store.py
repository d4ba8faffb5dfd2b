# The storage helper on real SQLite files: a transaction commits or rolls back, migrations run once each in order with
# their version stamp, a failed step leaves the version before, and a store of a newer schema is refused untouched.
from __future__ import annotations

import sqlite3
from contextlib import closing
from pathlib import Path

import pytest

from protocol.errors import UsageError
from protocol.sqlite_store import (
    Migration,
    Schema,
    StoreVersionError,
    open_store,
    schema_version,
    statements,
    transaction,
)

NOTES = statements("notes", "CREATE TABLE IF NOT EXISTS notes (id INTEGER PRIMARY KEY, body TEXT NOT NULL)")
TAGS = statements("tags", "ALTER TABLE notes ADD COLUMN tag TEXT NOT NULL DEFAULT ''")


def rows(path: Path) -> list[tuple]:
    """The notes as a separate connection reads them."""
    with closing(sqlite3.connect(path)) as connection:
        return connection.execute("SELECT * FROM notes ORDER BY id").fetchall()


def test_a_transaction_commits_at_the_end_and_rolls_back_what_raised(tmp_path: Path) -> None:
    connection = open_store(tmp_path / "s.sqlite", Schema("notebook", (NOTES,)))
    with transaction(connection):
        connection.execute("INSERT INTO notes VALUES (1, 'kept')")
    with pytest.raises(KeyError), transaction(connection):
        connection.execute("INSERT INTO notes VALUES (2, 'gone')")
        raise KeyError("a bug half way")
    with pytest.raises(sqlite3.IntegrityError), transaction(connection):
        connection.execute("INSERT INTO notes VALUES (3, 'gone too')")
        connection.execute("INSERT INTO notes VALUES (1, 'a duplicate key')")
    assert not connection.in_transaction
    assert rows(tmp_path / "s.sqlite") == [(1, "kept")]
    pragmas = [connection.execute(f"PRAGMA {name}").fetchone()[0] for name in ("journal_mode", "foreign_keys")]
    assert pragmas == ["wal", 1]
    connection.close()


def test_migrations_run_once_each_in_order_and_stamp_their_version(tmp_path: Path) -> None:
    path = tmp_path / "s.sqlite"
    ran: list[str] = []

    def counted(step: Migration) -> Migration:
        def apply(connection: sqlite3.Connection) -> None:
            ran.append(step.name)
            step.apply(connection)

        return Migration(step.name, apply)

    connection = open_store(path, Schema("notebook", (counted(NOTES),)))
    assert schema_version(connection) == 1 and ran == ["notes"]
    connection.execute("INSERT INTO notes VALUES (1, 'before')")
    connection.close()
    connection = open_store(path, Schema("notebook", (counted(NOTES), counted(TAGS))))
    assert schema_version(connection) == 2 and ran == ["notes", "tags"]
    connection.close()
    connection = open_store(path, Schema("notebook", (counted(NOTES), counted(TAGS))))
    assert ran == ["notes", "tags"], "a store at the schema's version runs no step"
    connection.close()
    assert rows(path) == [(1, "before", "")]


def test_a_failed_step_leaves_the_version_before_and_the_next_open_runs_it_again(tmp_path: Path) -> None:
    path = tmp_path / "s.sqlite"
    open_store(path, Schema("notebook", (NOTES,))).close()

    def broken(connection: sqlite3.Connection) -> None:
        TAGS.apply(connection)
        raise RuntimeError("the step's bug")

    with pytest.raises(RuntimeError, match="the step's bug"):
        open_store(path, Schema("notebook", (NOTES, Migration("tags", broken))))
    with closing(sqlite3.connect(path)) as connection:
        assert schema_version(connection) == 1
        assert [row[1] for row in connection.execute("PRAGMA table_info(notes)")] == ["id", "body"]
    connection = open_store(path, Schema("notebook", (NOTES, TAGS)))
    assert schema_version(connection) == 2
    connection.close()


def test_a_store_of_a_newer_schema_is_refused_untouched_by_writers_and_readers(tmp_path: Path) -> None:
    path = tmp_path / "s.sqlite"
    open_store(path, Schema("notebook", (NOTES, TAGS))).close()
    before = path.read_bytes()
    for read_only in (False, True):
        with pytest.raises(StoreVersionError) as refused:
            open_store(path, Schema("notebook", (NOTES,)), read_only)
        message = str(refused.value)
        assert "\n" not in message and isinstance(refused.value, UsageError)
        assert "notebook has schema version 2" in message and "knows versions up to 1" in message
        assert "a downgrade is refused" in message
    assert path.read_bytes() == before


def test_a_reader_creates_nothing(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no notebook at"):
        open_store(tmp_path / "missing.sqlite", Schema("notebook", (NOTES,)), read_only=True)
    assert not (tmp_path / "missing.sqlite").exists()
