# The one answer path on a device: the page, labels.csv and the central queue deliver to one query store, keyed by
# query; the labelled store takes each answer once, whichever roads brought it and however often, and a correction
# replaces the label it holds (a late older word changes nothing).
from __future__ import annotations

import os
import sqlite3
import time
from contextlib import closing
from pathlib import Path

import numpy as np
import pytest
from test_folder_pool import camera_oracle

from edge_agent.data.labelled_record import LABEL_SOURCES, LabelledRecord
from edge_agent.data.oracle import Guess
from edge_agent.data.query_records import DECLINED, Delivery, LabelKind, Road
from edge_agent.data.query_store import QueryStore
from edge_agent.field.folder_oracle import FolderOracle, QueryBook
from edge_agent.field.parts import FieldWork
from protocol.errors import UsageError
from protocol.sqlite_store import schema_version


@pytest.fixture()
def oracle(tmp_path: Path) -> FolderOracle:
    """Four real PNG queries in round 1, asked by the folder oracle itself."""
    oracle = camera_oracle(tmp_path, 4)
    oracle.start_round(1)
    oracle.ask(np.arange(4))
    return oracle


def apply(oracle: FolderOracle) -> int:
    """What the agent does with stored answers (its tick, an acquisition): into the labelled store."""
    indices, labels = oracle.collect()
    oracle.data.add_labels(indices, labels)
    return len(indices)


def test_one_answer_by_three_roads_enters_the_labelled_store_once(oracle: FolderOracle, tmp_path: Path) -> None:
    first, second = oracle.book.queries()[:2]
    assert oracle.book.record_answer(first.name, 3) is Delivery.STORED  # the device's page
    oracle.book.labels_path.write_text(f"file,label\n{first.name},Dress\n{second.name},1\n")  # labels.csv
    assert oracle.book.record_answer(first.query_id, 3, Road.CENTRAL, "ana") is Delivery.SAME  # the queue
    assert apply(oracle) == 2
    assert apply(oracle) == 0, "applying again adds nothing"
    assert oracle.book.record_answer(first.query_id, 3, Road.CENTRAL, "ana") is Delivery.SAME
    assert apply(oracle) == 0
    record = LabelledRecord.load(tmp_path / "state" / "labels.npz", oracle.data.num_samples)
    assert sorted(zip(record.indices.tolist(), record.labels.tolist())) == [(first.index, 3), (second.index, 1)]
    stored = {answer.query_id: (answer.label, answer.road) for answer in oracle.book.store.answers()}
    assert stored == {first.query_id: (3, "page"), second.query_id: (1, "labels.csv")}


def test_the_first_answer_stays_and_a_conflicting_one_changes_nothing(oracle: FolderOracle) -> None:
    query = oracle.book.queries()[0]
    assert oracle.book.record_answer(query.name, 2, Road.CENTRAL, "ana") is Delivery.STORED
    oracle.book.labels_path.write_text(f"{query.name},7\n")
    assert oracle.book.answers() == {query.name: 2}
    assert oracle.book.record_answer(query.name, 5) is Delivery.CONFLICT
    assert apply(oracle) == 1 and oracle.data.labels_at(np.array([query.index])).tolist() == [2]


def test_none_of_these_is_stored_never_labelled_and_never_pending(oracle: FolderOracle) -> None:
    query = oracle.book.queries()[0]
    oracle.book.record_answer(query.query_id, DECLINED, Road.CENTRAL, "ana")
    assert apply(oracle) == 0 and query.index not in oracle.pending().tolist()
    assert query.name not in {q.name for q in oracle.book.pending()} and len(oracle.book.pending()) == 3


def test_bad_answers_are_refused_and_store_nothing(oracle: FolderOracle) -> None:
    for name, label in (("no-such-query", 1), (oracle.book.queries()[0].name, 10), (oracle.book.queries()[0].name, -2)):
        with pytest.raises(ValueError):
            oracle.book.record_answer(name, label, Road.CENTRAL)
    assert oracle.book.store.answers() == []


def test_a_stored_answer_survives_reopening(tmp_path: Path) -> None:
    book = QueryStore(tmp_path / "answers.sqlite")
    assert book.deliver("q1", 4, Road.CENTRAL, "ana", 5.0) is Delivery.STORED
    book.close()
    again = QueryStore(tmp_path / "answers.sqlite")
    assert [(a.query_id, a.label, a.road, a.answered_by, a.answered_at) for a in again.answers()] == [
        ("q1", 4, "central", "ana", 5.0)
    ]
    assert again.deliver("q1", 4, Road.PAGE) is Delivery.SAME


def record_of(oracle: FolderOracle) -> dict[int, tuple[int, str]]:
    """The labelled store on disk: index -> (label, source)."""
    record = LabelledRecord.load(oracle.data.state_dir / "labels.npz", oracle.data.num_samples)
    assert len(set(record.indices.tolist())) == len(record.indices), "a sample labelled twice"
    assert set(record.replay.tolist()) <= set(record.indices.tolist()) and len(set(record.replay.tolist())) == len(
        record.replay
    )
    return {
        i: (label, LABEL_SOURCES[s])
        for i, label, s in zip(*(a.tolist() for a in (record.indices, record.labels, record.sources)))
    }


def test_a_correction_replaces_the_label_once_and_a_late_older_word_changes_nothing(oracle: FolderOracle) -> None:
    first, second = oracle.book.queries()[:2]
    book = oracle.book
    assert book.record_answer(first.query_id, 2, Road.CENTRAL, "ana") is Delivery.STORED
    assert book.record_answer(second.query_id, 4, Road.CENTRAL, "ana") is Delivery.STORED
    assert apply(oracle) == 2
    fix = LabelKind.CORRECTION
    assert book.record_answer(first.query_id, 5, Road.CENTRAL, "bo", 2.0, fix, 1) is Delivery.CORRECTED
    assert oracle.correct() == 1 and apply(oracle) == 0
    assert record_of(oracle) == {first.index: (5, "correction"), second.index: (4, "oracle")}
    assert oracle.data.num_labelled == 2 and oracle.data.class_counts().sum() == 2, "a corrected label counts once"
    assert book.record_answer(first.query_id, 2, Road.CENTRAL, "ana") is Delivery.STALE, "the answer resent late"
    assert book.record_answer(first.query_id, 5, Road.CENTRAL, "bo", 2.0, fix, 1) is Delivery.SAME
    assert book.record_answer(first.query_id, 7, Road.CENTRAL, "bo", 2.0, fix, 1) is Delivery.STALE
    assert book.record_answer(first.query_id, DECLINED, Road.CENTRAL, "cy", 3.0, fix, 2) is Delivery.CORRECTED
    assert oracle.correct() == 1 and record_of(oracle) == {second.index: (4, "oracle")}
    assert first.index in oracle.data.pool_indices() and first.index not in oracle.pending(), "none of these"
    assert [(a.query_id, a.label) for a in book.store.answers()] == [(first.query_id, 2), (second.query_id, 4)]
    assert oracle.correct() == 0, "applying again changes nothing"


def test_a_correction_that_comes_before_its_answer_stands_for_it(oracle: FolderOracle) -> None:
    query = oracle.book.queries()[0]
    fix = LabelKind.CORRECTION
    assert oracle.book.record_answer(query.query_id, 6, Road.CENTRAL, "bo", 2.0, fix, 1) is Delivery.STORED
    assert oracle.book.record_answer(query.query_id, 3, Road.CENTRAL, "ana") is Delivery.STALE
    assert apply(oracle) == 0 and oracle.correct() == 1
    assert record_of(oracle) == {query.index: (6, "correction")}


def test_labels_csv_and_the_device_page_correct_through_the_same_path(oracle: FolderOracle) -> None:
    first, second = oracle.book.queries()[:2]
    book = oracle.book
    book.labels_path.write_text(f"file,label\n{first.name},1\n")
    assert book.answers() == {first.name: 1}
    book.labels_path.write_text(f"file,label\n{first.name},Dress\n")  # the person edits the row
    assert book.answers() == {first.name: 3}
    assert [(c.query_id, c.label, c.road) for c in book.store.unreported_corrections()] == [
        (first.query_id, 3, "labels.csv")
    ]
    fix = LabelKind.CORRECTION
    assert book.record_answer(first.query_id, 4, Road.CENTRAL, "ana", 5.0, fix, 1) is Delivery.CORRECTED
    assert book.answers() == {first.name: 4}, "labels.csv's old row does not undo a later word"
    assert book.record_answer(second.name, 2) is Delivery.STORED  # the device's page
    assert book.record_answer(second.name, 8, Road.PAGE, kind=fix) is Delivery.CORRECTED
    assert book.record_answer(second.name, 1) is Delivery.STALE, "a plain answer never changes an answered query"
    book.store.note_correction_reported(second.query_id, 8)
    assert [c.query_id for c in book.store.unreported_corrections()] == []
    assert apply(oracle) == 0 and oracle.correct() == 2
    assert record_of(oracle) == {first.index: (4, "correction"), second.index: (8, "correction")}


def test_a_field_devices_scan_applies_its_own_pages_correction_before_the_next_acquisition(
    oracle: FolderOracle,
) -> None:
    query = oracle.book.queries()[0]
    oracle.book.record_answer(query.name, 2)
    assert apply(oracle) == 1
    oracle.book.record_answer(query.name, 6, kind=LabelKind.CORRECTION)
    FieldWork(oracle.data, 0.0, oracle=oracle).tick(None, 1, None)  # the agent's loop, between rounds
    assert record_of(oracle) == {query.index: (6, "correction")}


def test_a_query_keeps_its_guess_and_its_life_in_one_record_across_a_restart(tmp_path: Path) -> None:
    oracle = camera_oracle(tmp_path, 4)
    oracle.start_round(1)
    oracle.note_guesses(np.array([1]), [Guess(7, 0.625, 0.25, 0.5)])
    first, second = oracle.ask(np.array([0, 1]))
    oracle.book.store.note_sent(second.query_id)
    oracle.book.store.note_queued(second.query_id)
    oracle.book.record_answer(second.name, 7)
    oracle.data.add_labels(*oracle.collect())
    oracle.book.store.close()
    again = QueryBook(tmp_path / "labelling")  # the agent started again
    assert [query.guess for query in again.queries()] == [None, Guess(7, 0.625, 0.25, 0.5)]
    assert again.store.queued() == {second.query_id} and [q.name for q in again.pending()] == [first.name]
    with closing(sqlite3.connect(again.store.path)) as connection:
        sent, taken = connection.execute(
            "SELECT sent_at, taken_at FROM queries WHERE query_id = ?", (second.query_id,)
        ).fetchone()
    assert sent is not None and taken is not None, "sent and taken into the labelled store: on the same record"


def test_index_csv_lists_the_queries_for_people_and_is_never_read_back(tmp_path: Path) -> None:
    oracle = camera_oracle(tmp_path, 5)
    oracle.start_round(1)
    oracle.ask(np.arange(4))
    index = oracle.book.queries_dir / "index.csv"
    lines = index.read_text().splitlines()
    assert lines[0] == "file,round_id,index,sha256,source,asked_at" and len(lines) == 5
    oracle.start_round(2)
    oracle.ask(np.array([4]))
    assert index.read_text().splitlines()[:5] == lines and len(index.read_text().splitlines()) == 6, "appended"
    index.write_text("damaged\n")
    assert len(oracle.book.queries()) == 5 and oracle.pending().tolist() == [0, 1, 2, 3, 4]


def test_labels_csv_rewritten_within_one_clock_tick_is_read_again(oracle: FolderOracle) -> None:
    query = oracle.book.queries()[0]
    oracle.book.labels_path.write_text(f"{query.name},1\n")
    assert oracle.book.answers() == {query.name: 1}
    oracle.book.labels_path.write_text(f"{query.name},2\n")  # same size, likely the same mtime
    assert oracle.book.answers() == {query.name: 2}
    stamp = time.time() - 60
    os.utime(oracle.book.labels_path, (stamp, stamp))
    assert oracle.book.answers() == {query.name: 2}


def test_a_damaged_index_of_0_1_0_stops_the_upgrade_in_one_line_and_changes_nothing(tmp_path: Path) -> None:
    folder = tmp_path / "labelling"
    (folder / "queries").mkdir(parents=True)
    (folder / "queries" / "index.csv").write_text("file,round_id,index,sha256,source,asked_at\n1/a.png,x,0,s,a.png,1\n")
    with closing(sqlite3.connect(folder / "answers.sqlite")) as connection:  # a 0.1.0 store, stamped by nothing
        connection.execute(
            "CREATE TABLE answers (query_id TEXT PRIMARY KEY, label INTEGER NOT NULL, road TEXT NOT "
            "NULL, answered_by TEXT NOT NULL, answered_at REAL NOT NULL, stored_at REAL NOT NULL)"
        )
    with pytest.raises(UsageError, match=r"index.csv: not a query index .*was not upgraded") as refused:
        QueryBook(folder)
    assert len(str(refused.value).splitlines()) == 1
    with closing(sqlite3.connect(folder / "answers.sqlite")) as connection:
        assert schema_version(connection) == 2, "the steps before the damaged one stand; the queries step did not"
        names = {row[0] for row in connection.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert "queries" not in names and {"queued", "reported"} <= names
