# The field's test set: a share of queries marked when queued (stable, from their ids alone), whose answers the
# coordinator keeps to judge each round's model and never sends to a device, which stops waiting for them; the
# round's model scored on both test sets, with their sizes in the round line.
from __future__ import annotations

import io
import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from browser import headless_chromium, needs_chromium, wait_for
from PIL import Image
from test_labelling_desk import DEVICE, FLEET, Device, wait_until

from coordinator.cli import main
from coordinator.commands.round_console import RoundPrinter
from coordinator.dashboard.live import LiveState
from coordinator.dashboard.report import write_report
from coordinator.dashboard.server import Dashboard, ListenAddress
from coordinator.dashboard.views import load_snapshot, rounds_view
from coordinator.intake.observer import RoundResult
from coordinator.labelling.desk import LabellingDesk
from coordinator.labelling.field_set import read_field_set
from coordinator.labelling.queue import LabelQueue
from coordinator.labelling.queue_records import Outcome, query_kind
from coordinator.labelling.queue_schema import FIELD_TEST, LABEL
from coordinator.rounds.closing import FIELD_ACCURACY, FIELD_IMAGES, TEST_IMAGES
from coordinator.rounds.evaluation import Evaluator, LabelledSplit
from coordinator.setup.server_data import FieldSet
from coordinator.storage.store import RoundRecord, RunStore
from edge_agent.data.fashion_mnist import load_fashion_mnist
from edge_agent.data.image_arrays import model_input
from edge_agent.data.image_files import InputSpec
from edge_agent.learning.models import build_model, get_weights
from protocol import label_messages, topics, wire
from protocol.label_messages import NONE_OF_THESE, LabelQuery
from protocol.model_spec import CLASS_NAMES, DEFAULT_SPEC
from protocol.mqtt import MqttSession


def png(image: np.ndarray) -> bytes:
    """A real PNG of a uint8 image."""
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="PNG")
    return buffer.getvalue()


def query(device: str, query_id: str, image: np.ndarray) -> LabelQuery:
    """A device's query of one image."""
    return LabelQuery(device, query_id, png(image), "image/png", time.time())


def kinds(queue: LabelQueue) -> dict[str, bool]:
    """Each queued query's id -> whether it is a field test query."""
    return {each.query_id: queue.is_field_test(each.device, each.query_id) for each in queue.all()}


def test_a_query_s_kind_is_decided_from_its_ids_when_queued_and_kept(tmp_path: Path) -> None:
    drawn = [query_kind("cam", f"q{index}", 0.1) for index in range(4000)]
    assert drawn == [query_kind("cam", f"q{index}", 0.1) for index in range(4000)]
    assert abs(drawn.count(FIELD_TEST) / len(drawn) - 0.1) < 0.015 and set(drawn) == {FIELD_TEST, LABEL}
    assert query_kind("cam", "q1", 0.0) == LABEL
    images = load_fashion_mnist().test_images
    queue = LabelQueue(tmp_path, tuple(CLASS_NAMES), field_test_share=0.5)
    for index in range(8):
        assert queue.add(query("cam", f"q{index}", images[index]), "cam") is None
    marked = kinds(queue)
    assert marked == {f"q{index}": query_kind("cam", f"q{index}", 0.5) == FIELD_TEST for index in range(8)}
    assert 0 < sum(marked.values()) < 8
    for each in queue.all():  # people answer, one of them with a second thought: the kinds stand
        queue.record(each.device, each.query_id, 3, "ana")
        queue.record(each.device, each.query_id, 4, "ana", change=True)
    queue.close()
    reopened = LabelQueue(tmp_path, tuple(CLASS_NAMES), field_test_share=0.0)  # a later share changes no kind
    assert reopened.add(query("cam", "q0", images[0]), "cam") is None and kinds(reopened) == marked
    reopened.close()


def test_a_field_test_answer_stays_with_the_queue_and_forms_the_field_set(tmp_path: Path) -> None:
    images = load_fashion_mnist().test_images
    queue = LabelQueue(tmp_path, tuple(CLASS_NAMES), field_test_share=0.5)
    ids = [f"q{index}" for index in range(8)]
    for index, query_id in enumerate(ids):
        queue.add(query("cam", query_id, images[index]), "cam")
    field_ids = [query_id for query_id in ids if queue.is_field_test("cam", query_id)]
    label_id = next(query_id for query_id in ids if query_id not in field_ids)
    first, second, third, fourth = field_ids[:4]
    decided = queue.record("cam", first, 2, "ana").decided
    assert decided is not None and decided.field_test
    assert queue.record("cam", label_id, 5, "ana").decided is not None
    assert [each.query_id for each in queue.undelivered()] == [label_id], "a field test answer is never sent"
    changed = queue.record("cam", first, 7, "bo", change=True)
    assert changed.outcome is Outcome.REPLACED and changed.correction is None, "changed in place, nothing sent"
    held = queue.record("cam", second, 1, "ana", hold=True)
    assert held.held and queue.release(time.time() + 3600) == [], "its hold ends with nothing to send"
    queue.record("cam", third, NONE_OF_THESE, "ana")  # no class: not a test image
    queue.record("cam", fourth, 6, "ana")
    assert queue.answered_on_device("cam", fourth, 8, "page")  # its device labelled it: it trains
    field = queue.field_set()
    assert [(each.query_id, each.label) for each in field] == [(first, 7), (second, 1)]
    assert field[0].path.read_bytes() == png(images[ids.index(first)]) and field[0].key == f"cam/{first}"
    assert read_field_set(tmp_path) == field, "the coordinator reads the same set beside the desk"
    queue.close()
    assert read_field_set(tmp_path / "nothing") == []


def test_a_field_window_keeps_the_newest_answers_so_the_set_follows_the_field(tmp_path: Path) -> None:
    images = load_fashion_mnist().test_images
    queue = LabelQueue(tmp_path, tuple(CLASS_NAMES), field_test_share=0.5)
    for index in range(30):
        queue.add(query("cam", f"q{index}", images[index]), "cam")
    field = [index for index in range(30) if queue.is_field_test("cam", f"q{index}")][:5]
    order = [field[3], field[0], field[4], field[1], field[2]]
    for index in order:  # answered in this order
        queue.record("cam", f"q{index}", index % 10, "ana")
    spec = InputSpec(DEFAULT_SPEC.channels, DEFAULT_SPEC.height, DEFAULT_SPEC.width)
    keys, pixels, labels = FieldSet(tmp_path, spec, window=3)()
    assert keys == [f"cam/q{index}" for index in order[2:]] and len(pixels) == 3
    assert labels.tolist() == [index % 10 for index in order[2:]]
    assert FieldSet(tmp_path, spec)()[0] == [f"cam/q{index}" for index in order]
    queue.close()


def test_a_field_test_answer_never_reaches_the_device_which_stops_waiting(tmp_path: Path, broker, sessions) -> None:
    queue = LabelQueue(tmp_path / "run", tuple(CLASS_NAMES), field_test_share=0.5)
    session = MqttSession(broker.address, client_id="desk", manual_ack=True)
    session.connect()
    desk = LabellingDesk(FLEET, session, queue, resend_seconds=0.2).start()
    watcher = sessions(broker.address, "watcher")
    watcher.subscribe(topics.LABELLING_DOWN.build(fleet=FLEET, device=DEVICE))
    device = Device(tmp_path, broker)
    device.oracle.wait_seconds = 30.0

    def person() -> None:  # answers every query the page would show, as it comes
        wait_until(lambda: len(queue.all()) == 6, "the round's queries in the queue")
        for each in queue.all():
            desk.send(queue.record(DEVICE, each.query_id, 4, "ana").decided)

    answering = threading.Thread(target=person)
    answering.start()
    started = time.monotonic()
    indices, labels = device.oracle.label(np.arange(6))
    answering.join()
    asked = {query.query_id: query.index for query in device.oracle.book.queries()}
    field = {query_id for query_id in asked if queue.is_field_test(DEVICE, query_id)}
    assert 0 < len(field) < 6 and time.monotonic() - started < 20, "the round waited for the label queries only"
    assert sorted(indices.tolist()) == sorted(asked[q] for q in asked if q not in field) and set(labels) == {4}
    wait_until(lambda: queue.undelivered() == [], "the label answers' receipts", step=device.step)
    time.sleep(0.6)  # the desk's resends have come round
    store = device.oracle.book.store
    assert store.unanswered() == [] and store.to_send() == [], "nothing waits for a field test query"
    assert not set(store.labels()) & field and device.oracle.ask(np.arange(6)) == [], "never labelled, never asked"
    receipts, answers = {}, set()
    while (message := watcher.next_message(timeout=0.5)) is not None:
        said = wire.decode_any(message.payload, (label_messages.QueryReceipt, label_messages.LabelAnswer))
        if isinstance(said, label_messages.QueryReceipt):
            receipts[said.query_id] = said.field_test
        else:
            answers.add(said.query_id)
    assert receipts == {query_id: query_id in field for query_id in asked}
    assert answers == set(asked) - field, "no field test answer went to the device"
    assert {each.query_id for each in queue.field_set()} == field
    device.close()
    desk.stop()
    session.close()
    queue.close()


def test_each_round_is_scored_on_both_test_sets_and_its_line_says_their_sizes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fashion = load_fashion_mnist()
    queue = LabelQueue(tmp_path, tuple(CLASS_NAMES), field_test_share=0.5)
    for index in range(12):
        queue.add(query("cam", f"q{index}", fashion.test_images[index]), "cam")
    field_ids = [each.query_id for each in queue.all() if queue.is_field_test("cam", each.query_id)]
    for query_id in field_ids:
        queue.record("cam", query_id, int(fashion.test_labels[int(query_id[1:])]), "ana")
    queue.close()
    split = LabelledSplit.from_uint8(fashion.test_images[100:130], fashion.test_labels[100:130])
    source = FieldSet(tmp_path, InputSpec(1, 28, 28))
    evaluator = Evaluator(DEFAULT_SPEC, split, split, 1, 0, source)
    models = {version: get_weights(build_model(DEFAULT_SPEC, seed=version)) for version in (0, 1)}
    scores = evaluator.round_scores(1, models[1])
    assert (scores.test.images, scores.field.images) == (30, len(field_ids))
    positions = [int(query_id[1:]) for query_id in field_ids]
    direct = evaluator.classes(models[1], model_input(fashion.test_images[positions]))
    assert scores.field.accuracy == pytest.approx(float(np.mean(direct == fashion.test_labels[positions])))
    evidence = evaluator.evidence(1, 0, models.__getitem__)
    assert (evidence.test.images, evidence.field.images) == (30, len(field_ids))
    assert evidence.field.both.sum() + evidence.field.gained.sum() == round(scores.field.accuracy * len(field_ids))
    result = RoundResult(3, 0.8123, {}, 40, {}, 1.0, {}, {}, test_images=30, field_accuracy=0.5, field_images=4)
    RoundPrinter(False, 5)(result)
    assert "global acc 0.8123 (30 test images)  field acc 0.5000 (4 images)" in capsys.readouterr().out
    RoundPrinter(True, 5)(result)
    line = json.loads(capsys.readouterr().out)
    assert (line["accuracy"], line["test_images"], line["field_accuracy"], line["field_images"]) == (0.8123, 30, 0.5, 4)


def test_the_store_dashboard_and_report_keep_both_accuracies_with_their_sizes(tmp_path: Path) -> None:
    metrics = {"class_accuracy": [], TEST_IMAGES: 1000, FIELD_ACCURACY: 0.74, FIELD_IMAGES: 212}
    with RunStore(tmp_path) as store:
        store.set_config({"run_id": "r"})
        store.commit_round(RoundRecord(1, 1.0, 2.0, "ab" * 32, 0.802, 10, 1, 0, {}, metrics), [])
    row = rounds_view(load_snapshot(tmp_path))[0]
    assert (row["accuracy"], row["test_images"], row["field_accuracy"], row["field_images"]) == (0.802, 1000, 0.74, 212)
    page = write_report(tmp_path).read_text()
    assert "<th>test images</th><th>field accuracy</th><th>field images</th>" in page
    assert "<td>0.8020</td><td>1000</td><td>0.7400</td><td>212</td>" in page


@needs_chromium
def test_the_dashboard_and_report_say_which_rounds_the_pools_refined(tmp_path: Path) -> None:
    """A pooled head's round that the pools' posteriors refined carries their weight to the round timeline (the real
    page in headless chromium, and the report); one fitted from the labels alone does not."""
    reports = [{"pool_refined": False, "pool_weight": 0.0}, {"pool_refined": True, "pool_weight": 1.428571}]
    run_dir = tmp_path / "run"
    with RunStore(run_dir) as store:
        store.set_config({"run_id": "r"})
        for round_id, report in enumerate(reports, start=1):
            store.commit_round(RoundRecord(round_id, 1.0, 2.0, "ab" * 32, 0.8, 10, 1, 0, report, {}), [])
    assert [row["pool_weight"] for row in rounds_view(load_snapshot(run_dir))] == [None, 1.428571]
    page = write_report(run_dir).read_text()
    assert "<td>1</td>" in page and "<td>2 (refined by the pools, weight 1.429)</td>" in page
    script = "return [...document.querySelectorAll('#timeline tbody tr')].map(r => r.cells[0].textContent)"
    served = Dashboard(ListenAddress("127.0.0.1", 0), run_dir, LiveState(total_rounds=2), None)
    with served as dashboard, headless_chromium(tmp_path / "chromium-profile") as browser:
        browser.open(dashboard.url)
        cells = wait_for(lambda: browser.evaluate(script) or None, 60, "the round timeline")
    assert cells == ["1", "2 (refined by the pools, weight 1.429)"]


def test_a_field_test_share_out_of_range_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["labelling", "serve", str(tmp_path), "--broker", "mqtt://127.0.0.1:1", "--dashboard", "0"]
    assert main([*argv, "--field-test-share", "1.5"]) == 2
    shown = capsys.readouterr().err.strip()
    assert shown.endswith("--field-test-share must lie in [0, 1), got 1.5") and len(shown.splitlines()) == 1
