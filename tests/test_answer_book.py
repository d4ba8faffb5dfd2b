# The one answer path on a device: the page, labels.csv and the central queue deliver to one answer book, keyed by
# query; the labelled store takes each answer once, whichever roads brought it and however often.
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from test_folder_pool import camera_oracle

from edge_agent.data.answers import DECLINED, AnswerBook, Delivery, Road
from edge_agent.data.labelled_record import LabelledRecord
from edge_agent.field.folder_oracle import FolderOracle


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
    book = AnswerBook(tmp_path / "answers.sqlite")
    assert book.deliver("q1", 4, Road.CENTRAL, "ana", 5.0) is Delivery.STORED
    book.close()
    again = AnswerBook(tmp_path / "answers.sqlite")
    assert [(a.query_id, a.label, a.road, a.answered_by, a.answered_at) for a in again.answers()] == [
        ("q1", 4, "central", "ana", 5.0)
    ]
    assert again.deliver("q1", 4, Road.PAGE) is Delivery.SAME
