# Every SQLite store's one habit: its pragmas, a transaction that commits or rolls back, a versioned schema's migrations.
from __future__ import annotations

import logging
import sqlite3
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from protocol.errors import UsageError
from protocol.release import VERSION

log = logging.getLogger(__name__)

BUSY_SECONDS = 30.0  # how long a connection waits for another connection's write lock before it fails
# Every writer's pragmas: WAL (readers beside the writer), a commit durable when it returns, foreign keys checked.
PRAGMAS = ("PRAGMA journal_mode=WAL", "PRAGMA synchronous=FULL", "PRAGMA foreign_keys=ON")


class StoreVersionError(UsageError):
    """A store written by a newer schema than this code knows (a downgrade): refused before anything is written,
    in one line."""


@dataclass(frozen=True)
class Migration:
    """One step of a store's schema: its name (for the log) and what it does, run inside the one transaction that
    also stamps the store with the step's version."""

    name: str
    apply: Callable[[sqlite3.Connection], None]


def execute_all(connection: sqlite3.Connection, sql: Iterable[str]) -> None:
    """Runs SQL statements in order, one `execute` each (`executescript` would commit a step's transaction half
    way)."""
    for statement in sql:
        connection.execute(statement)


def statements(name: str, *sql: str) -> Migration:
    """A migration that runs SQL statements in order."""
    return Migration(name, lambda connection: execute_all(connection, sql))


@dataclass(frozen=True)
class Schema:
    """A store's schema as its ordered migrations: version n is the store after the first n steps. Version 0 is a
    file no step ran on: a new one, or one written by release 0.1.0, before stores had versions; each store's first
    step creates its tables only where they are missing, so it adopts a 0.1.0 file as it is."""

    store: str  # what the store is called in a refusal and the log, e.g. "run store"
    migrations: tuple[Migration, ...]

    @property
    def version(self) -> int:
        """The version this code writes and reads: how many steps it knows."""
        return len(self.migrations)


def schema_version(connection: sqlite3.Connection) -> int:
    """The version the store is stamped with (0: never stamped)."""
    return int(connection.execute("PRAGMA user_version").fetchone()[0])


@contextmanager
def transaction(connection: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """One write transaction on an autocommit connection: BEGIN IMMEDIATE (the write lock from the start, so what
    it reads no other writer changes before it writes), committed when the block ends, rolled back when it raises
    (the error goes on). The store's own lock, if threads share the connection, is the caller's."""
    connection.execute("BEGIN IMMEDIATE")
    try:
        yield connection
    except BaseException:
        if connection.in_transaction:  # (SQLite ends some failed transactions itself)
            connection.execute("ROLLBACK")
        raise
    connection.execute("COMMIT")


def open_store(path: Path, schema: Schema, read_only: bool = False) -> sqlite3.Connection:
    """A connection to the store at `path` in autocommit (writes go through `transaction`), which threads may share
    under the store's lock. A writer's connection sets PRAGMAS and brings the schema up to date first, each missing
    step in its own transaction with its version stamp (a process killed during one leaves the store at the
    version before, and the next open runs the step again). A reader's (`read_only`, beside a writer: nothing is
    created or changed; FileNotFoundError when the file is missing) reads the store as it is. Either refuses a
    store of a newer schema with a StoreVersionError."""
    if read_only:
        if not path.is_file():
            raise FileNotFoundError(f"no {schema.store} at {path}")
        connection = _connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
    else:
        connection = _connect(str(path), uri=False)
    try:
        _refuse_newer(connection, schema, path)
        if not read_only:
            for pragma in PRAGMAS:
                connection.execute(pragma)
            fresh = connection.execute("SELECT count(*) FROM sqlite_master WHERE type = 'table'").fetchone()[0] == 0
            for version in range(schema_version(connection) + 1, schema.version + 1):
                _migrate(connection, schema, version, path, fresh)
    except BaseException:
        connection.close()
        raise
    return connection


def _connect(database: str, uri: bool) -> sqlite3.Connection:
    """An autocommit connection any thread may use, waiting BUSY_SECONDS for another writer's lock."""
    return sqlite3.connect(database, uri=uri, check_same_thread=False, isolation_level=None, timeout=BUSY_SECONDS)


def _refuse_newer(connection: sqlite3.Connection, schema: Schema, path: Path) -> None:
    """A StoreVersionError when the store's version is beyond the schema's (written by a newer release)."""
    found = schema_version(connection)
    if found > schema.version:
        raise StoreVersionError(
            f"{path}: this {schema.store} has schema version {found}, written by a newer edge-fal than this one "
            f"({VERSION}, which knows versions up to {schema.version}); a downgrade is refused: run the newer "
            "release, or restore the copy taken before the upgrade"
        )


def _migrate(connection: sqlite3.Connection, schema: Schema, version: int, path: Path, fresh: bool) -> None:
    """Runs the step that makes the store `version` and stamps it, in one transaction; nothing when another
    process ran it first (the version is read again under the write lock). A `fresh` store's steps are its creation,
    logged at debug; an existing store's, its upgrade, at info."""
    step = schema.migrations[version - 1]
    with transaction(connection):
        if schema_version(connection) >= version:
            return
        step.apply(connection)
        connection.execute(f"PRAGMA user_version = {version:d}")
    level = logging.DEBUG if fresh else logging.INFO
    log.log(level, "store migrated store=%s version=%d step=%r path=%s", schema.store, version, step.name, path)
