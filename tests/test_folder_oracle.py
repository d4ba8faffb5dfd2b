# The folder oracle on real files: queries copied once, answers parsed forgivingly, pending carried, vanished originals.
from __future__ import annotations

import dataclasses
import logging
import threading
import time

import numpy as np
import pytest
from PIL import Image
from test_folder_pool import write_png

from edge_agent.data.fashion_mnist import load_fashion_mnist
from edge_agent.field.folder_oracle import FolderOracle, QueryBook, parse_label
from edge_agent.field.folder_pool import open_folder_data
from edge_agent.loop.round_runner import spec_problem
from protocol.model_spec import DEFAULT_SPEC


@pytest.fixture()
def oracle(tmp_path) -> FolderOracle:
    images = load_fashion_mnist().test_images
    for i in range(6):
        write_png(tmp_path / "camera" / f"{i}.png", images[i], age_seconds=30 - i)
    data = open_folder_data(tmp_path / "state", tmp_path / "camera", pool_cap=10, settle_seconds=0)
    oracle = FolderOracle(QueryBook(tmp_path / "labelling"), data, wait_seconds=0.5, poll_seconds=0.05)
    oracle.start_round(4)
    return oracle


def test_queries_are_copied_once_and_answers_are_collected_once(oracle):
    first = oracle.ask(np.array([0, 2]))
    assert [q.file for q in first] == [f"4/{i:06d}-{oracle.pool.item(i).sha256[:12]}.png" for i in (0, 2)]
    assert oracle.ask(np.array([2, 3])) and [q.index for q in oracle.book.queries()] == [0, 2, 3]
    assert oracle.pending().tolist() == [0, 2, 3]
    oracle.book.labels_path.write_text(f"file,label\n4/{first[0].name},Trouser\n{first[1].name},7\n")
    indices, labels = oracle.collect()
    assert indices.tolist() == [0, 2] and labels.tolist() == [1, 7]
    oracle.data.add_labels(indices, labels)
    assert oracle.collect()[0].size == 0 and oracle.pending().tolist() == [3]


def test_label_waits_for_its_queries_and_returns_early_once_answered(oracle):
    started = time.monotonic()
    indices, _ = oracle.label(np.array([1]))
    assert indices.size == 0 and time.monotonic() - started >= 0.5
    oracle.wait_seconds = 30

    def answer_all():
        return [oracle.book.record_answer(q.name, 5 + q.index) for q in oracle.book.pending()]

    threading.Timer(0.5, answer_all).start()
    started = time.monotonic()
    indices, labels = oracle.label(np.array([4]))
    assert time.monotonic() - started < 10, "label() returns once its query is answered, not at the timeout"
    assert indices.tolist() == [1, 4] and labels.tolist() == [6, 9], "an old query's answer comes in too"
    oracle.stop_event.set()
    started = time.monotonic()
    oracle.label(np.array([5]))
    assert time.monotonic() - started < 5, "a stop ends the wait"


def test_bad_label_rows_are_logged_once_and_skipped_and_the_last_row_wins(oracle, caplog):
    names = [q.name for q in oracle.ask(np.array([0, 1]))]
    oracle.book.labels_path.write_text(f"{names[0]},Coat\n{names[1]},Bagz\n{names[0]},ankle BOOT\nonly-one-column\n")
    with caplog.at_level(logging.WARNING, logger="edge_agent.field.folder_oracle"):
        assert oracle.book.answers() == {names[0]: 9}
        assert oracle.book.answers() == {names[0]: 9}
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2 and "line 2 skipped" in warnings[0] and "'Bagz'" in warnings[0]
    assert [q.name for q in oracle.book.pending()] == [names[1]]
    with pytest.raises(ValueError, match="no query named"):
        oracle.book.record_answer("other.png", 1)
    with pytest.raises(ValueError, match="neither a class number"):
        parse_label("10", ("a",) * 10)


def test_a_changed_or_vanished_original_is_shown_as_the_stored_image(oracle):
    original = oracle.pool.pool_dir / oracle.pool.item(3).path
    original.rename(original.with_suffix(".moved"))
    query = oracle.ask(np.array([3]))[0]
    assert query.file.endswith(".png")
    shown = np.asarray(Image.open(oracle.book.image_path(query)))
    assert np.array_equal(shown, oracle.data.images(np.array([3]))[0])


def test_a_spec_whose_class_names_are_not_the_persons_is_refused_in_one_line(oracle):
    spec = DEFAULT_SPEC
    assert oracle.class_names() == tuple(spec.class_names) and spec_problem(spec, oracle.data, oracle) is None
    renamed = dataclasses.replace(spec, class_names=["tee", *spec.class_names[1:]])
    problem = spec_problem(renamed, oracle.data, oracle)
    assert problem is not None and problem.startswith("the model's classes are ['tee', 'Trouser'")
    assert "\n" not in problem and len(problem) < 300
