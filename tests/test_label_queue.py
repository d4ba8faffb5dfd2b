# The coordinator's labelling queue on disk: bounded intake of devices' queries (refusals for images too large or not
# images), the order people see them in, answers and majorities, undo and corrections, grids, delivery, and Label
# Studio's task format both ways.
from __future__ import annotations

import io
import json
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from coordinator.labelling.label_studio import NONE_CHOICE, export_tasks, import_tasks, labelling_config
from coordinator.labelling.queue import LabelQueue
from coordinator.labelling.queue_records import AnswerError, Outcome, QueueLimits, QueueRefusal, Undone, UndoWindow
from protocol.label_messages import NONE_OF_THESE, QUERY_REFUSALS, LabelQuery
from protocol.model_spec import CLASS_NAMES

CLASSES = ("cat", "dog", "bird")
CLASS_NAMES_OF_SPEC = tuple(CLASS_NAMES)  # the default spec's, which the command reads without --model-spec


def png(value: int = 0, side: int = 8) -> bytes:
    """A small real PNG."""
    buffer = io.BytesIO()
    Image.fromarray(np.full((side, side), value, dtype=np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


def query(device: str, query_id: str, guess: int = 0, score: float = 0.5, image: bytes | None = None) -> LabelQuery:
    """A device's query of a small PNG."""
    return LabelQuery(device, query_id, image or png(), "image/png", 1.0, guess, 0.6, 0.4, score)


@pytest.fixture()
def queue(tmp_path: Path) -> LabelQueue:
    return LabelQueue(tmp_path, CLASSES, QueueLimits(per_device=3, total=5, image_bytes=4096))


def test_queries_are_kept_once_and_bounded_per_device_and_in_all(queue: LabelQueue) -> None:
    assert [queue.add(query("a", f"q{i}"), "a") for i in range(3)] == [None] * 3
    assert queue.add(query("a", "q0"), "a") is None, "a resent query is kept once"
    assert queue.add(query("a", "q3"), "a") is QueueRefusal.DEVICE_FULL
    assert [queue.add(query("b", f"q{i}"), "b") for i in range(3)] == [None, None, QueueRefusal.QUEUE_FULL]
    assert queue.depth() == {"a": 3, "b": 2}
    queue.record("a", "q0", 1, "ana")
    assert queue.add(query("a", "q3"), "a") is None, "an answered query frees its place"
    assert queue.image_path("a", "q3", "image/png").read_bytes() == png()


def test_bad_images_and_queries_are_refused_with_their_kind(queue: LabelQueue) -> None:
    big = png(side=200) + b"\0" * 5000
    cases = {
        QueueRefusal.TOO_LARGE: query("a", "big", image=big),
        QueueRefusal.UNDECODABLE: query("a", "junk", image=b"\x89PNG\r\n\x1a\n" + b"\0" * 100),
        QueueRefusal.BAD_QUERY: query("a", "../escape"),
    }
    for kind, bad in cases.items():
        assert queue.add(bad, "a") is kind
    jpeg_declared_png = query("a", "type", image=png())
    assert queue.add(LabelQuery(**{**jpeg_declared_png.__dict__, "media_type": "image/jpeg"}), "a") is (
        QueueRefusal.UNDECODABLE
    )
    assert queue.add(query("b", "other"), "a") is QueueRefusal.BAD_QUERY, "a device speaks for itself only"
    assert queue.add(query("a", "guess", guess=3), "a") is QueueRefusal.BAD_QUERY
    assert queue.all() == [] and not (queue.folder / "images").exists()


def test_the_rarest_predicted_class_comes_first_then_the_score(tmp_path: Path) -> None:
    queue = LabelQueue(tmp_path, CLASSES)
    for device, query_id, guess, score in (
        ("a", "q1", 0, 0.9),
        ("a", "q2", 1, 0.2),
        ("b", "q3", 1, 0.8),
        ("b", "q4", 0, 0.1),
    ):
        queue.add(query(device, query_id, guess, score), device)
    seen = []
    while (shown := queue.next_for("ana")) is not None:
        seen.append(shown.query_id)
        queue.record(shown.device, shown.query_id, shown.guess, "ana")
    assert seen == ["q1", "q3", "q2", "q4"], "after a cat, the dogs (now rarer) come first, by score"


def test_answers_are_refused_clearly_and_skips_are_per_person(queue: LabelQueue) -> None:
    queue.add(query("a", "q1"), "a")
    statuses = []
    for device, query_id, label in (("a", "nope", 1), ("x", "q1", 1), ("a", "q1", 3), ("a", "q1", -2)):
        with pytest.raises(AnswerError) as refused:
            queue.record(device, query_id, label, "ana")
        statuses.append(refused.value.status)
    assert statuses == [404, 404, 400, 400]
    queue.skip("a", "q1", "ana")
    assert queue.next_for("ana") is None and queue.next_for("bo") is not None
    decided = queue.record("a", "q1", NONE_OF_THESE, "bo").decided
    assert decided is not None and (decided.label, decided.answered_by) == (NONE_OF_THESE, "bo")
    with pytest.raises(AnswerError) as refused:
        queue.record("a", "q1", 1, "cy")
    assert refused.value.status == 409


def test_k_people_decide_by_majority_and_one_person_votes_once(tmp_path: Path) -> None:
    queue = LabelQueue(tmp_path, CLASSES, voters=3)
    queue.add(query("a", "q1"), "a")
    assert queue.record("a", "q1", 1, "ana").decided is None
    with pytest.raises(AnswerError) as refused:
        queue.record("a", "q1", 1, "ana")
    assert refused.value.status == 409
    assert queue.record("a", "q1", 2, "bo").decided is None
    assert queue.next_for("ana") is None and queue.next_for("cy") is not None
    decided = queue.record("a", "q1", 1, "cy").decided
    assert decided is not None and (decided.label, decided.answered_by) == (1, "ana,cy")


def test_a_device_closes_a_query_it_answered_itself_once_and_only_with_a_class(queue: LabelQueue) -> None:
    queue.add(query("a", "q1"), "a")
    assert not queue.answered_on_device("a", "q1", 3, "page"), "not a class of the spec"
    assert queue.answered_on_device("a", "q1", 2, "<script>")
    assert (queue.get("a", "q1").label, queue.get("a", "q1").answered_by) == (2, "a:device")
    assert not queue.answered_on_device("a", "q1", 2, "page") and queue.undelivered() == [], "the same label again"
    with pytest.raises(AnswerError):
        queue.record("a", "q1", 1, "ana")


def test_answered_queries_beyond_the_kept_number_leave_the_disk(tmp_path: Path) -> None:
    queue = LabelQueue(tmp_path, CLASSES, QueueLimits(kept_answered=2))
    for number in range(4):
        queue.add(query("a", f"q{number}"), "a")
        queue.record("a", f"q{number}", 1, "ana")
        queue.delivered("a", f"q{number}")
    assert [q.query_id for q in queue.all()] == ["q2", "q3"]
    assert sorted(path.name for path in (queue.folder / "images" / "a").iterdir()) == ["q2.png", "q3.png"]


def test_the_refusal_kinds_are_the_wires() -> None:
    assert tuple(QueueRefusal) == QUERY_REFUSALS


def test_an_answer_waits_for_its_device_across_a_reopen(tmp_path: Path) -> None:
    queue = LabelQueue(tmp_path, CLASSES)
    queue.add(query("a", "q1"), "a")
    queue.record("a", "q1", 2, "ana")
    queue.close()
    reopened = LabelQueue(tmp_path, CLASSES)
    assert [(d.device, d.query_id, d.label) for d in reopened.undelivered()] == [("a", "q1", 2)]
    assert reopened.delivered("a", "q1") and not reopened.delivered("a", "q1")
    assert reopened.undelivered() == []


def test_label_studio_tasks_go_out_and_their_annotations_come_back(tmp_path: Path) -> None:
    queue = LabelQueue(tmp_path / "run", CLASSES)
    for query_id in ("q1", "q2", "q3", "q4"):
        queue.add(query("a", query_id, guess=1), "a")
    queue.record("a", "q4", 0, "ana")
    tasks = export_tasks(queue, tmp_path / "out", "/data/local-files/?d=", only_open=False)
    assert len(tasks) == 4 and (tmp_path / "out" / "images" / "a" / "q1.png").read_bytes() == png()
    first = tasks[0]
    assert first["data"] == {"image": "/data/local-files/?d=images/a/q1.png", "device": "a", "query_id": "q1"}
    assert first["predictions"][0]["result"][0]["value"] == {"choices": ["dog"]}
    assert tasks[3]["annotations"][0]["result"][0]["value"] == {"choices": ["cat"]}
    assert '<Choice value="bird"/>' in labelling_config(CLASSES)
    annotated = json.loads(json.dumps(tasks[:3]))
    annotated[0]["annotations"] = [{"result": [{"type": "choices", "value": {"choices": ["bird"]}}], "completed_by": 7}]
    annotated[1]["annotations"] = [
        {"result": [{"type": "choices", "value": {"choices": ["horse"]}}], "completed_by": 7}
    ]
    annotated[2]["annotations"] = [
        {"result": [{"type": "choices", "value": {"choices": [NONE_CHOICE]}}], "completed_by": 7}
    ]
    counts = import_tasks(queue, [*annotated, {"data": {}}, {"data": {}, "annotations": []}])
    assert [(d.query_id, d.label, d.answered_by) for d in counts.decided] == [
        ("q1", 2, "label-studio:7"),
        ("q3", NONE_OF_THESE, "label-studio:7"),
    ]
    assert (counts.refused, counts.unanswered) == (1, 2)
    again = import_tasks(queue, annotated[:1])
    assert (again.unchanged, again.refused, again.decided, again.corrections) == (1, 0, [], [])


def test_the_labelling_command_exports_imports_and_refuses_bad_input_in_one_line(tmp_path: Path, capsys) -> None:
    from coordinator.cli import main

    queue = LabelQueue(tmp_path / "run", CLASS_NAMES_OF_SPEC, field_test_share=0.5)
    ids = [f"q{index}" for index in range(1, 20)]
    for query_id in ids:
        queue.add(query("a", query_id), "a")
    field = next(query_id for query_id in ids if queue.is_field_test("a", query_id))
    label = next(query_id for query_id in ids if not queue.is_field_test("a", query_id))
    assert main(["labelling", "export", str(tmp_path / "run"), "--out", str(tmp_path / "ls")]) == 0
    tasks = json.loads((tmp_path / "ls" / "tasks.json").read_text())
    for task in tasks:
        if task["data"]["query_id"] in (field, label):
            task["annotations"] = [{"result": [{"type": "choices", "value": {"choices": ["Bag"]}}], "completed_by": 3}]
    (tmp_path / "done.json").write_text(json.dumps(tasks))
    assert main(["labelling", "import", str(tmp_path / "run"), str(tmp_path / "done.json")]) == 0
    assert "1 answers decided, 1 field test answers kept, 0 corrected" in capsys.readouterr().out
    assert queue.get("a", label).label == queue.get("a", field).label == CLASS_NAMES_OF_SPEC.index("Bag")
    (tmp_path / "bad.json").write_text("{not json")
    bad = [
        ["import", str(tmp_path / "run"), str(tmp_path / "bad.json")],
        ["import", str(tmp_path / "run"), str(tmp_path / "ls" / "config.xml")],
        [
            "serve",
            str(tmp_path / "run"),
            "--broker",
            "mqtt://127.0.0.1:1",
            "--dashboard",
            "0",
            "--answers-per-query",
            "0",
        ],
        ["serve", str(tmp_path / "run"), "--broker", "mqtt://127.0.0.1:1", "--dashboard", "0", "--max-image-mb", "100"],
    ]
    for arguments in bad:
        assert main(["labelling", *arguments]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("fl-coordinator: "), lines


WRONG_SHAPES = [
    ({"annotations": 5}, "task 2 (id 2): annotations must be a list, got 5"),
    (
        {"annotations": [{"result": [{"value": "bird"}]}]},
        "annotations[0].result[0].value must be an object, got 'bird'",
    ),
    ({"annotations": ["x" * 500]}, "annotations[0] must be an object, got 'xxxx"),
    ({"annotations": [{"result": 7}]}, "annotations[0].result must be a list, got 7"),
    ({"annotations": [{"result": [{"value": {"choices": "bird"}}]}]}, ".value.choices must be a list, got 'bird'"),
    ({"annotations": [{"result": [{"value": {"choices": [3]}}]}]}, ".value.choices[0] must be a string, got 3"),
    ({"data": {"device": 7, "query_id": "q2"}}, "data.device must be a string, got 7"),
    ({"data": [1]}, "task 2 (id 2): data must be an object, got [1]"),
]


@pytest.mark.parametrize(("change", "message"), WRONG_SHAPES)
def test_label_studio_tasks_of_the_wrong_shape_refuse_the_file_in_one_line_and_import_nothing(
    tmp_path: Path, capsys, change: dict, message: str
) -> None:
    from coordinator.cli import main

    queue = LabelQueue(tmp_path / "run", CLASS_NAMES_OF_SPEC)
    for query_id in ("q1", "q2"):
        queue.add(query("a", query_id), "a")
    tasks = export_tasks(queue, tmp_path / "ls", "", only_open=False)
    vote = {"result": [{"type": "choices", "value": {"choices": ["Bag"]}}], "completed_by": 3}
    tasks[0]["annotations"] = [vote]
    tasks[1]["annotations"] = [vote]
    tasks[1].update(change)
    (tmp_path / "done.json").write_text(json.dumps(tasks))
    assert main(["labelling", "import", str(tmp_path / "run"), str(tmp_path / "done.json")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and lines[0].endswith("; nothing imported"), lines
    assert len(lines[0]) < 300 and "Traceback" not in lines[0]
    assert [q.label for q in queue.all()] == [None, None], "the task before the bad one is not imported either"


def test_the_status_counts_open_queries_their_age_and_each_persons_last_hour(queue: LabelQueue) -> None:
    for device, query_id in (("cam-1", "a"), ("cam-1", "b"), ("cam-2", "c")):
        queue.add(query(device, query_id), device)
    queue.record("cam-2", "c", 1, "ana")
    now = time.time()
    status = queue.status(now + 30)
    assert {device: count for device, (count, _) in status.open_by_device.items()} == {"cam-1": 2}
    assert 30 <= status.open_by_device["cam-1"][1] < 60
    assert status.answers_last_hour == {"ana": 1}
    assert queue.status(now + 3700).answers_last_hour == {}


def test_one_device_claims_cannot_starve_another(tmp_path: Path) -> None:
    """An insider queues 40 queries claiming the top score and a class nobody answered yet; an honest device's two
    low-scored queries are both among the first four: each device takes one place in each turn."""
    queue = LabelQueue(tmp_path, CLASSES)
    for number in range(40):
        queue.add(query("spam", f"s{number}", guess=2, score=1e9), "spam")
    queue.add(query("honest", "h1", guess=0, score=0.01), "honest")
    queue.add(query("honest", "h2", guess=1, score=0.0), "honest")
    seen = []
    for _ in range(6):
        shown = queue.next_for("ana")
        assert shown is not None
        seen.append(shown.device)
        queue.record(shown.device, shown.query_id, shown.guess, "ana")
    assert seen[:2] == ["spam", "honest"] and seen[:4].count("honest") == 2, seen
    assert seen[4:] == ["spam", "spam"], "once the honest device has nothing open, the insider's queries follow"


def test_an_undo_takes_back_a_held_answer_and_a_sent_one_is_corrected_with_a_revision(tmp_path: Path) -> None:
    queue = LabelQueue(tmp_path, CLASSES, undo=UndoWindow(seconds=60.0, answers=10))
    for query_id in ("q1", "q2"):
        queue.add(query("a", query_id), "a")
    assert queue.record("a", "q1", 1, "ana", hold=True).held
    assert queue.undelivered() == [], "held for an undo, not sent"
    taken, state = queue.undo("ana") or (None, None)
    assert taken is not None and (taken.query_id, taken.label, state) == ("q1", None, Undone.WITHDRAWN)
    assert queue.undo("ana") is None and queue.next_for("ana").query_id == "q1", "open again, nothing left"
    queue.record("a", "q1", 2, "ana")  # not held: sent at once
    sent, state = queue.undo("ana") or (None, None)
    assert sent is not None and (sent.label, state) == (2, Undone.SENT), "sent: it can only be corrected now"
    with pytest.raises(AnswerError) as refused:
        queue.record("a", "q1", 0, "bo")
    assert refused.value.status == 409, "a second answer is no correction"
    assert queue.record("a", "q1", 2, "bo", change=True).outcome is Outcome.UNCHANGED
    first = queue.record("a", "q1", 0, "bo", change=True).correction
    second = queue.record("a", "q1", NONE_OF_THESE, "ana", change=True).correction
    assert first is not None and second is not None and (first.revision, second.revision) == (1, 2)
    assert [(c.query_id, c.label, c.revision) for c in queue.undelivered_corrections()] == [("q1", NONE_OF_THESE, 2)]
    assert not queue.correction_delivered("a", "q1", 1), "an older revision's receipt settles nothing"
    assert queue.correction_delivered("a", "q1", 2) and queue.undelivered_corrections() == []
    assert queue.get("a", "q1").label == NONE_OF_THESE
    status = queue.status(time.time())
    assert (status.corrections, status.corrections_undelivered, status.answers_today) == (2, 0, {"ana": 1, "bo": 1})
    assert [(g.query_id, g.given, g.label, g.state) for g in queue.history("ana", 5)] == [
        ("q1", NONE_OF_THESE, NONE_OF_THESE, "corrected")
    ]


def test_a_held_answer_goes_when_its_time_is_over_or_its_person_has_answered_more(tmp_path: Path) -> None:
    queue = LabelQueue(tmp_path, CLASSES, undo=UndoWindow(seconds=60.0, answers=2))
    for number in range(4):
        queue.add(query("a", f"q{number}"), "a")
    for number in range(2):
        queue.record("a", f"q{number}", 1, "ana", hold=True)
    pushed = queue.record_all([("a", "q2")], 1, "ana", hold=True).released
    assert [d.query_id for d in pushed] == ["q0"], "ana's third answer lets her first go"
    queue.record("a", "q3", 2, "bo", hold=True)
    now = time.time()
    assert queue.release(now) == [], "the others are within their window"
    assert queue.record("a", "q1", 0, "ana", change=True).outcome is Outcome.REPLACED, "held: changed in place"
    assert queue.undelivered_corrections() == []
    assert sorted(d.query_id for d in queue.release(now + 61)) == ["q1", "q2", "q3"]
    assert [(d.query_id, d.label) for d in queue.undelivered()] == [("q0", 1), ("q1", 0), ("q2", 1), ("q3", 2)]


def test_a_grid_shows_one_guessed_class_and_is_recorded_all_or_nothing(tmp_path: Path) -> None:
    queue = LabelQueue(tmp_path, CLASSES)
    for number in range(5):
        queue.add(query("a" if number % 2 else "b", f"q{number}", guess=2), "a" if number % 2 else "b")
    queue.add(query("a", "other", guess=1), "a")
    grid = queue.grid_for("ana", 10)
    assert sorted(q.query_id for q in grid) == [f"q{n}" for n in range(5)] and {q.guess for q in grid} == {2}
    assert [q.query_id for q in queue.grid_for("ana", 10, guess=1)] == ["other"]
    keys = [(q.device, q.query_id) for q in grid]
    with pytest.raises(AnswerError) as refused:
        queue.record_all([*keys[:2], ("a", "nope")], 2, "ana")
    assert refused.value.status == 404 and all(q.label is None for q in queue.all()), "nothing recorded"
    recorded = queue.record_all(keys[:3], 2, "ana", hold=True).recorded
    assert [r.outcome for r in recorded] == [Outcome.DECIDED] * 3
    assert len(queue.grid_for("ana", 10)) == 2
