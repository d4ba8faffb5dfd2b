# The upgrade from release 0.1.0: the run folder, label queue and device states written by the code of commit c613278
# (tests/fixtures/upgrade/make_fixtures.py) open under this code with nothing lost, a second open changes nothing, a
# store stamped by a newer release is refused in one line, and a migration killed half way leaves the store it began.
from __future__ import annotations

import hashlib
import json
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from contextlib import closing
from pathlib import Path

import pytest

from coordinator.labelling.queue import LabelQueue
from coordinator.labelling.queue_schema import QUEUE_SCHEMA
from coordinator.storage.database import RUN_SCHEMA
from coordinator.storage.store import RunStore
from edge_agent.data.device_data import STATE_FILE
from edge_agent.data.journal import Journal
from edge_agent.data.labelled_record import LabelledRecord
from edge_agent.data.query_schema import QUERY_SCHEMA
from edge_agent.field.folder_oracle import QueryBook
from protocol.model_spec import CLASS_NAMES
from protocol.sqlite_store import StoreVersionError, schema_version
from protocol.tensors import weights_hash

WRITTEN_AT = "c613278"  # the commit whose code (release 0.1.0) wrote the fixtures
FIXTURES = Path(__file__).parent / "fixtures" / "upgrade"
ROOT = Path(__file__).resolve().parent.parent
FIELD_DEVICES = ("cam-a", "cam-b")
STORES = {
    "run database": "run/run.sqlite",
    "label queue": "run/labelling/queue.sqlite",
    **{f"query store of {name}": f"devices/{name}/state/labelling/answers.sqlite" for name in FIELD_DEVICES},
}
EXPECTED = json.loads((FIXTURES / "expected.json").read_text())


@pytest.fixture()
def old(tmp_path: Path) -> Path:
    """A copy of the fixtures as release 0.1.0 left them."""
    return Path(shutil.copytree(FIXTURES, tmp_path / "old"))


def open_every_store(root: Path) -> None:
    """Each store opened and closed as its part opens it (the run's coordinator, the desk, each device's oracle)."""
    RunStore(root / "run").close()
    LabelQueue(root / "run", CLASS_NAMES).close()
    for name in FIELD_DEVICES:
        QueryBook(root / "devices" / name / "state" / "labelling").store.close()


def version(path: Path) -> int:
    """A store's schema version as a plain connection reads it."""
    with closing(sqlite3.connect(path)) as connection:
        return schema_version(connection)


def tables(path: Path) -> dict[str, list[tuple]]:
    """Every table of a store with its columns (name, type, not null, default, key)."""
    with closing(sqlite3.connect(path)) as connection:
        names = [row[0] for row in connection.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        return {name: connection.execute(f"PRAGMA table_info({name})").fetchall() for name in sorted(names)}


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def run_reads(root: Path) -> dict:
    """The run's rounds, devices, rejections, serving decisions and checkpoints as this code reads them."""
    with RunStore(root / "run") as store:
        for record in store.rounds():  # a checkpoint holds exactly the model its round committed
            assert weights_hash(store.checkpoints.load(record.round_id)) == record.model_hash
        return {
            "rounds": [
                [r.round_id, r.model_hash, r.accuracy, r.labels, r.accepted, r.rejected] for r in store.rounds()
            ],
            "device_rounds": [[d.round_id, d.device_id, d.accepted, d.num_samples] for d in store.device_rounds()],
            "rejections": [list(r[:3]) for r in store.rejections()],
            "rejection_kinds": store.rejection_kinds(),
            "serving": [[e.round_id, e.decision, e.serving, e.who] for e in store.serving.events()],
            "serving_version": store.serving.serving_version(),
            "checkpoints": [round_id for (round_id,) in store.database.read("SELECT round_id FROM checkpoints")],
        }


def queue_reads(root: Path) -> dict:
    """The queue's queries with their answers, open ones per device, and every person's votes (a status taken at
    time 0 counts every vote as within its hour); each query's image still on disk."""
    queue = LabelQueue(root / "run", CLASS_NAMES)
    try:
        queries = queue.all()
        assert all(queue.image_path(q.device, q.query_id, q.media_type).is_file() for q in queries)
        return {
            "queries": [[q.device, q.query_id, q.guess, q.label, q.answered_by] for q in queries],
            "depth": queue.depth(),
            "answers_last_hour": queue.status(0.0).answers_last_hour,
        }
    finally:
        queue.close()


def device_reads(state: Path, pool: int) -> dict:
    """A device's journal and labelled store, and its answers, the link's bookkeeping and its queries if it has them."""
    journal = Journal(state / STATE_FILE)
    record = LabelledRecord.load(state / "labels.npz", pool)
    reads: dict = {
        "pool": pool,
        "journal": {key: journal.get(key) for key in json.loads((state / STATE_FILE).read_text())},
        "labelled": {str(i): label for i, label in zip(record.indices.tolist(), record.labels.tolist(), strict=True)},
    }
    if (state / "labelling").is_dir():
        book = QueryBook(state / "labelling")
        reads["answers"] = [[a.query_id, a.label, a.road, a.answered_by] for a in book.store.answers()]
        reads["queued"], reads["reported"] = sorted(book.store.queued()), sorted(book.store.reported())
        reads["queries"] = [q.query_id for q in book.queries()]
        book.store.close()
    return reads


def test_the_fixtures_are_the_ones_release_0_1_0_wrote(old: Path) -> None:
    assert EXPECTED["commit"] == WRITTEN_AT
    assert (old / f"{STORES['query store of cam-b']}-wal").stat().st_size > 0, "a store whose pages are in its WAL"
    assert {name: version(old / path) for name, path in STORES.items()} == dict.fromkeys(STORES, 0)


def test_every_store_of_0_1_0_opens_with_nothing_lost(old: Path) -> None:
    open_every_store(old)
    now = {"run database": RUN_SCHEMA.version, "label queue": QUEUE_SCHEMA.version}
    now |= {name: QUERY_SCHEMA.version for name in STORES if name.startswith("query store")}
    assert {name: version(old / path) for name, path in STORES.items()} == now
    assert QUEUE_SCHEMA.version == 3, "undo holds and corrections came as migration 2, query kinds as 3"
    assert QUERY_SCHEMA.version == 4, (
        "a device's corrections came as migration 2, its queries' records as 3, closing as 4"
    )
    assert run_reads(old) == EXPECTED["run"]
    assert queue_reads(old) == EXPECTED["labelling"]
    queue = LabelQueue(old / "run", CLASS_NAMES)
    skipped = next(q for q in queue.all() if q.device == "cam-a" and q.label is None)
    assert queue.next_for("ben") is None and queue.next_for("ana") == skipped, "a person's skip is kept"
    queue.close()
    for name, expected in EXPECTED["devices"].items():
        assert device_reads(old / "devices" / name / "state", expected["pool"]) == expected, name


def test_an_adopted_0_1_0_store_has_exactly_the_tables_of_a_new_one(old: Path, tmp_path: Path) -> None:
    open_every_store(old)
    new = tmp_path / "new"
    for name in FIELD_DEVICES:
        (new / "devices" / name / "state").mkdir(parents=True)
    open_every_store(new)
    assert {name: tables(old / path) for name, path in STORES.items()} == {
        name: tables(new / path) for name, path in STORES.items()
    }


def test_a_second_open_changes_no_byte(old: Path) -> None:
    open_every_store(old)
    migrated = {name: digest(old / path) for name, path in STORES.items()}
    open_every_store(old)
    assert {name: digest(old / path) for name, path in STORES.items()} == migrated


# Each store stamped by a "newer release", and a command line that opens it.
REFUSING_COMMANDS = {
    "run database": ["coordinator", "rollback", "{root}/run"],
    "label queue": ["coordinator", "labelling", "export", "{root}/run", "--out", "{root}/tasks"],
    "query store of cam-a": [
        *("edge_agent", "run", "--broker", "mqtt://127.0.0.1:9", "--fleet", "f", "--device-id", "cam-a"),
        *("--pool-dir", "{root}/devices/cam-a/camera", "--state-dir", "{root}/devices/cam-a/state"),
        *("--labelling", "central"),
    ],
}


@pytest.mark.parametrize("store", sorted(REFUSING_COMMANDS))
def test_a_store_of_a_newer_release_is_refused_in_one_line_and_left_as_it_is(old: Path, store: str) -> None:
    path = old / STORES[store]
    with closing(sqlite3.connect(path)) as connection:
        connection.execute("PRAGMA user_version = 7")
    before = digest(path)
    command = [sys.executable, "-m", *(part.format(root=old) for part in REFUSING_COMMANDS[store])]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert f"this {store.split(' of ')[0]} has schema version 7" in done.stderr
    known = {"run database": RUN_SCHEMA, "label queue": QUEUE_SCHEMA}.get(store, QUERY_SCHEMA).version
    assert f"knows versions up to {known}); a downgrade is refused" in done.stderr
    with pytest.raises(StoreVersionError):
        open_every_store(old)
    assert digest(path) == before and version(path) == 7


# A subprocess that migrates the run database with a step injected through the helper's API, which halts half way:
# argv: the database, the file it touches once the step has changed the store, and where the step goes ("first":
# inside migration 1, after its own work; "later": a step after every migration committed).
HALTED_MIGRATION = """
import sys, time
from pathlib import Path
from coordinator.storage.database import RUN_SCHEMA
from protocol.sqlite_store import Migration, Schema, open_store

def halted(connection):
    if sys.argv[3] == "first":
        RUN_SCHEMA.migrations[0].apply(connection)
    connection.execute("DELETE FROM device_rounds")
    connection.execute("ALTER TABLE rounds ADD COLUMN note TEXT")
    Path(sys.argv[2]).touch()
    time.sleep(120)

steps = () if sys.argv[3] == "first" else RUN_SCHEMA.migrations
open_store(Path(sys.argv[1]), Schema(RUN_SCHEMA.store, (*steps, Migration("halted", halted))))
"""


@pytest.mark.parametrize(("position", "version_left"), [("first", 0), ("later", RUN_SCHEMA.version)])
def test_a_migration_killed_half_way_leaves_the_store_it_began_with(
    old: Path, tmp_path: Path, position: str, version_left: int
) -> None:
    path, marker = old / STORES["run database"], tmp_path / "halted"
    if position == "later":
        RunStore(old / "run").close()
    began = tables(path)
    command = [sys.executable, "-c", HALTED_MIGRATION, str(path), str(marker), position]
    process = subprocess.Popen(command, cwd=ROOT)
    try:
        deadline = time.monotonic() + 60
        while not marker.exists() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists(), "the migration reached its halt"
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
    assert version(path) == version_left and tables(path) == began, "the store as it was before the migration"
    with closing(sqlite3.connect(path)) as connection:
        kept = connection.execute("SELECT COUNT(*) FROM device_rounds").fetchone()[0]
    assert kept == len(EXPECTED["run"]["device_rounds"]), "the step's deletion went with it"
    assert run_reads(old) == EXPECTED["run"], "reopened, the migration runs again and nothing is lost"
    assert version(path) == RUN_SCHEMA.version
