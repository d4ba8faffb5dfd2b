# The labelling page's HTTP API on a real dashboard server with a real desk and broker: a person's answer is stored
# before it goes to its device (QoS 1), and every bad request gets its own bounded status.
from __future__ import annotations

import io
import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from browser import ARTIFACTS, WebDriver, headless_chromium, needs_chromium, wait_for
from PIL import Image

from coordinator.dashboard.server import Dashboard, ListenAddress
from coordinator.labelling.desk import LabellingDesk
from coordinator.labelling.queue import LabelQueue
from coordinator.labelling.queue_records import UndoWindow
from protocol import topics, wire
from protocol.label_messages import LabelAnswer, LabelCorrection, LabelQuery, QueryReceipt
from protocol.mqtt import MqttSession

FLEET = "lab"
TOKEN = "a-token-of-sixteen-chars"
CLASSES = ("cat", "dog", "bird")


def png(value: int = 0) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(np.full((8, 8), value, dtype=np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture()
def served(tmp_path: Path, broker, sessions) -> Iterator[tuple[str, LabelQueue, object]]:
    """A dashboard with the token and a labelling desk on a real broker; a device session listening for answers."""
    queue = LabelQueue(tmp_path / "run", CLASSES)
    for query_id in ("q1", "q2"):
        queue.add(LabelQuery("cam-1", query_id, png(), "image/png", 1.0, 1, 0.7, 0.3, 0.5), "cam-1")
    device = sessions(broker.address, "cam-1")
    device.subscribe(topics.LABELLING_DOWN.build(fleet=FLEET, device="cam-1"))
    desk = LabellingDesk(FLEET, sessions(broker.address, "desk", manual_ack=True), queue).start()
    with Dashboard(ListenAddress("127.0.0.1", 0), tmp_path / "run", None, TOKEN, desk) as dashboard:
        yield dashboard.url, queue, device
    desk.stop()


def call(
    url: str, method: str = "GET", body: object = None, headers: dict[str, str] | None = None
) -> tuple[int, bytes]:
    """(status, body) of one request."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def authorised(extra: dict[str, str] | None = None) -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json", **(extra or {})}


def answer(device: str = "cam-1", query_id: str = "q1", label: object = 2, person: str = "ana") -> dict:
    return {"device": device, "query_id": query_id, "label": label, "person": person}


def test_an_answer_is_stored_then_sent_to_its_device(served) -> None:
    url, queue, device = served
    status, body = call(url + "api/label/next?person=ana", headers=authorised())
    shown = json.loads(body)
    assert status == 200 and shown["query"]["query_id"] == "q1" and shown["classes"] == list(CLASSES)
    assert shown["query"]["guess_name"] == "dog" and shown["open"] == 2
    image = call(url + shown["query"]["image"].lstrip("/"), headers=authorised())
    assert image == (200, png())
    status, body = call(url + "api/label/answer", "POST", answer(), authorised())
    reply = json.loads(body)
    assert status == 200 and reply["decided"] and reply["query"]["query_id"] == "q2"
    assert queue.get("cam-1", "q1").label == 2 and queue.get("cam-1", "q1").answered_by == "ana"
    message = device.next_message(timeout=10)
    sent = wire.decode(message.payload, LabelAnswer)
    assert (sent.query_id, sent.label, sent.answered_by) == ("q1", 2, "ana")


def test_bad_requests_get_their_own_bounded_status(served) -> None:
    url, queue, _ = served
    assert call(url + "api/label/answer", "POST", answer(), authorised())[0] == 200
    cases = [
        (answer(), {"Content-Type": "application/json"}, 401),  # no token
        (answer(), authorised({"Authorization": "Bearer forged-token-of-16-chars"}), 401),
        (answer(), authorised({"Origin": "http://evil.example"}), 403),
        (answer(), {"Authorization": f"Bearer {TOKEN}", "Content-Type": "text/plain"}, 415),
        (answer(query_id="nope"), authorised(), 404),
        (answer(query_id="q1"), authorised(), 409),  # answered already
        (answer(query_id="q2", label=3), authorised(), 400),  # not a class of the spec
        (answer(query_id="q2", label="dog"), authorised(), 400),
        (answer(query_id="q2", person="a b"), authorised(), 400),
        (b"{not json", authorised(), 400),
        (b"x" * 5000, authorised(), 413),
    ]
    for body, headers, expected in cases:
        status, reply = call(url + "api/label/answer", "POST", body, headers)
        assert status == expected, (body, headers, reply)
        assert len(reply) < 500 and "error" in json.loads(reply)
    assert call(url + "api/label/next?person=ana")[0] == 401
    assert call(url + "api/label/image/cam-1/q9", headers=authorised())[0] == 404
    queue.image_path("cam-1", "q2", "image/png").unlink()
    assert call(url + "api/label/image/cam-1/q2", headers=authorised())[0] == 410
    assert queue.get("cam-1", "q2").label is None, "nothing refused was stored"
    assert call(url + "label")[0] == 200, "the page itself is public; its data is not"


def test_corrections_grids_and_undos_refuse_bad_input_in_one_bounded_line_and_lose_nothing(served) -> None:
    url, queue, _ = served
    assert call(url + "api/label/answer", "POST", answer(), authorised())[0] == 200
    pair = ["cam-1", "q2"]
    cases = [
        ("correct", answer(query_id="nope"), 404),  # a correction for a query the queue never held
        ("correct", answer(label=3), 400),  # not a class of the spec
        ("correct", answer(label=True), 400),
        ("correct", {**answer(), "hold": True}, 400),
        ("grid", {"person": "ana", "label": 1, "queries": "q2"}, 400),
        ("grid", {"person": "ana", "label": 1, "queries": [pair] * 49}, 400),
        ("grid", {"person": "ana", "label": 1, "queries": [["cam-1", "../q2"]]}, 400),
        ("grid", {"person": "ana", "label": 1, "queries": [pair], "hold": "yes"}, 400),
        ("grid", {"person": "ana", "label": 7, "queries": [pair]}, 400),
        ("grid", {"person": "ana", "label": 1, "queries": [pair, ["cam-1", "gone"]]}, 404),  # all or nothing
        ("grid", {"person": "ana", "label": 1, "queries": [pair], "extra": 1}, 400),
        ("grid", b"[" * 20000, 413),
        ("undo", {"person": "bo"}, 404),  # nothing to undo
        ("undo", {"person": "bo b"}, 400),
    ]
    for path, body, expected in cases:
        status, reply = call(url + f"api/label/{path}", "POST", body, authorised())
        assert status == expected, (path, body if isinstance(body, dict) else body[:20], reply)
        assert len(reply) < 500 and "error" in json.loads(reply)
    for query in ("size=0", "size=49", "class=3", "class=x", "size=" + "9" * 400):
        status, reply = call(url + f"api/label/grid?person=ana&{query}", headers=authorised())
        assert status == 400 and len(reply) < 500, (query, reply)
    assert [(q.query_id, q.label) for q in queue.all()] == [("q1", 2), ("q2", None)], "nothing refused was stored"
    assert queue.undelivered_corrections() == [] and queue.history("ana", 5)[0].query_id == "q1"


def test_an_open_loopback_dashboard_takes_posts_only_with_the_same_origin_header(
    tmp_path: Path, broker, sessions
) -> None:
    queue = LabelQueue(tmp_path / "run", CLASSES)
    queue.add(LabelQuery("cam-1", "q1", png(), "image/png", 1.0), "cam-1")
    desk = LabellingDesk(FLEET, sessions(broker.address, "desk", manual_ack=True), queue).start()
    try:
        with Dashboard(ListenAddress("127.0.0.1", 0), tmp_path / "run", None, None, desk) as dashboard:
            plain = {"Content-Type": "application/json"}
            assert call(dashboard.url + "api/label/answer", "POST", answer(), plain)[0] == 403
            status, _ = call(
                dashboard.url + "api/label/answer", "POST", answer(), {**plain, "X-Requested-With": "edge-fal"}
            )
            assert status == 200
    finally:
        desk.stop()


def test_a_run_serves_the_labelling_page_on_its_dashboard_beside_its_rounds(tmp_path: Path, broker, sessions) -> None:
    from coordinator.commands.labelling import with_labelling
    from coordinator.setup.settings import ServerSettings

    settings = ServerSettings(run_dir=tmp_path / "run", fleet=FLEET)
    device = sessions(broker.address, "cam-1")
    device.subscribe(topics.LABELLING_DOWN.build(fleet=FLEET, device="cam-1"))
    heard: list[tuple[str, object]] = []

    def rounds(address) -> None:
        """Stands in for the run's rounds: meanwhile a device asks and a person answers on the dashboard's page."""
        query = LabelQuery("cam-1", "q1", png(), "image/png", 1.0, 2, 0.5, 0.5, 0.5)
        receipt = None
        for _ in range(10):  # as a device does: sent again until the queue's receipt (the desk's first SUBSCRIBE
            # may reach the broker after this publish)
            device.publish(topics.LABEL_QUERIES.build(fleet=FLEET, device="cam-1"), wire.encode(query))
            receipt = device.next_message(timeout=2)
            if receipt is not None:
                break
        assert receipt is not None
        heard.append(("receipt", wire.decode(receipt.payload, QueryReceipt).queued))
        status, _ = call(dashboard.url + "api/label/answer", "POST", answer(query_id="q1", label=1), authorised())
        heard.append(("answer", status))
        sent = wire.decode_any(device.next_message(timeout=10).payload, (QueryReceipt, LabelAnswer))
        while isinstance(sent, QueryReceipt):  # the receipt of a query sent twice
            sent = wire.decode_any(device.next_message(timeout=10).payload, (QueryReceipt, LabelAnswer))
        heard.append(("sent", sent.label))

    with Dashboard(ListenAddress("127.0.0.1", 0), settings.run_dir, None, TOKEN) as dashboard:
        with_labelling(rounds, settings, dashboard, 0.0)(broker.address)
        # the rounds are over and the queue closed: the page still answers (it once met the closed database)
        status, body = call(dashboard.url + "api/devices", headers=authorised())
        assert status == 200 and json.loads(body)["labelling"] is None
        assert call(dashboard.url + "api/label/next", headers=authorised())[0] == 404
    assert heard == [("receipt", True), ("answer", 200), ("sent", 1)]


def test_the_dashboard_and_metrics_show_the_queue_per_device_and_the_people(served) -> None:
    url, _, _ = served
    assert call(url + "api/label/answer", "POST", answer(), authorised())[0] == 200
    status, body = call(url + "api/devices", headers=authorised())
    view = json.loads(body)
    row = next(row for row in view["devices"] if row["device_id"] == "cam-1")
    assert status == 200 and row["label_queue"]["open"] == 1 and row["label_queue"]["oldest_age_seconds"] >= 0
    people = [{"person": "ana", "answers_last_hour": 1, "answers_today": 1}]
    assert view["labelling"] == {"open": 1, "people": people, "corrections": 0}
    status, body = call(url + "metrics", headers=authorised())
    text = body.decode()
    assert 'fl_labelling_open_queries{device="cam-1"} 1' in text
    assert 'fl_labelling_oldest_open_seconds{device="cam-1"} ' in text
    assert 'fl_labelling_answers_last_hour{person="ana"} 1' in text


def press(page: WebDriver, key: str) -> None:
    """A key pressed on the page (not in a field)."""
    page.evaluate(f"document.dispatchEvent(new KeyboardEvent('keydown', {{key: {json.dumps(key)}}})); return 1;")


def after(page: WebDriver, action) -> str:
    """Runs `action` and waits until the page has shown what came of it; the query (or grid) then shown."""
    before = page.evaluate("return document.body.dataset.shown || '0'")
    action()
    wait_for(lambda: page.evaluate("return document.body.dataset.shown || '0'") != before, 20, "the page's next view")
    return page.evaluate("return document.body.dataset.query")


def sent_to(device: MqttSession, count: int) -> list[LabelAnswer | LabelCorrection]:
    """The next `count` answers and corrections a device's session receives (query receipts passed over)."""
    heard: list[LabelAnswer | LabelCorrection] = []
    while len(heard) < count:
        message = device.next_message(timeout=20)
        assert message is not None, f"only {heard} reached the device"
        received = wire.decode_any(message.payload, (QueryReceipt, LabelAnswer, LabelCorrection))
        if not isinstance(received, QueryReceipt):
            heard.append(received)
    return heard


@needs_chromium
def test_a_person_labels_by_enter_undo_search_grid_and_correction_on_the_page(tmp_path: Path, broker, sessions) -> None:
    """One person in headless chromium: Enter takes the guess, a slip is undone before it is sent (the device never
    hears of it), a class is found by search among more classes than keys, a grid of one guessed class is accepted
    but for its marked exceptions (answered one by one after it), and an answer sent already is corrected from the
    history: the device gets the correction."""
    classes = tuple(f"class-{number:02d}" for number in range(39)) + ("zebra",)
    queue = LabelQueue(tmp_path / "run", classes, undo=UndoWindow(seconds=3.0, answers=10))
    for number in range(8):
        queue.add(LabelQuery("cam-1", f"g{number}", png(number * 20), "image/png", 1.0, 7, 0.9, 0.1, 0.1), "cam-1")
    queue.add(LabelQuery("cam-2", "h1", png(7), "image/png", 1.0, 2, 0.8, 0.2, 0.9), "cam-2")
    queue.add(LabelQuery("cam-2", "h2", png(9), "image/png", 1.0, 4, 0.8, 0.2, 0.8), "cam-2")
    devices = {}
    for name in ("cam-1", "cam-2"):
        devices[name] = sessions(broker.address, name)
        devices[name].subscribe(topics.LABELLING_DOWN.build(fleet=FLEET, device=name))
    desk = LabellingDesk(FLEET, sessions(broker.address, "desk", manual_ack=True), queue).start()
    try:
        with (
            Dashboard(ListenAddress("127.0.0.1", 0), tmp_path / "run", None, TOKEN, desk) as dashboard,
            headless_chromium(tmp_path / "chromium") as page,
        ):
            page.open(dashboard.url + f"label#token={TOKEN}")
            wait_for(lambda: page.evaluate("return document.body.dataset.shown"), 20, "the first query")
            after(
                page,
                lambda: page.evaluate(
                    "const f = document.getElementById('person'); f.value = 'ana';"
                    "f.dispatchEvent(new Event('change')); return 1;"
                ),
            )
            assert not page.evaluate("return document.getElementById('search-box').hidden"), "40 classes, 34 keys"
            first = page.evaluate("return document.body.dataset.query").split("/")
            guess = queue.get(*first).guess
            second = after(page, lambda: press(page, "Enter")).split("/")
            assert queue.get(*first).label == guess, "Enter took the model's guess"

            after(page, lambda: press(page, "1"))  # a slip
            assert queue.get(*second).label == 0, "key 1 is the first class"
            assert after(page, lambda: press(page, "Backspace")) == "/".join(second), "the slip's query again"
            assert queue.get(*second).label is None, "taken back before it was sent"
            after(
                page,
                lambda: page.evaluate(
                    "const f = document.getElementById('class-search'); f.focus(); f.value = 'zeb';"
                    "f.dispatchEvent(new Event('input'));"
                    "f.dispatchEvent(new KeyboardEvent('keydown', {key: 'Enter', bubbles: true})); return 1;"
                ),
            )
            assert queue.get(*second).label == classes.index("zebra")
            page.screenshot(ARTIFACTS / "labelling-undo.png")

            grid = after(page, lambda: press(page, "G"))
            shown = grid.removeprefix("grid:").split(",")
            assert shown == [f"cam-1/g{number}" for number in range(1, 8)], "the class with the most open queries"
            press(page, "2")  # marks the grid's second and fifth thumbnails as exceptions
            press(page, "5")
            assert page.evaluate("return document.querySelectorAll('.thumb.exception').length") == 2
            page.screenshot(ARTIFACTS / "labelling-grid.png")
            assert after(page, lambda: press(page, "Enter")) == "cam-1/g2", "the first exception, after the rest"
            accepted = [f"cam-1/g{number}" for number in (1, 3, 4, 6, 7)]
            assert [queue.get("cam-1", f"g{n}").label for n in range(1, 8)] == [7, None, 7, 7, None, 7, 7]
            assert after(page, lambda: press(page, "3")) == "cam-1/g5"
            assert after(page, lambda: press(page, "s")) == "grid:cam-2/h2", "the exceptions done, the next grid"
            assert (queue.get("cam-1", "g2").label, queue.get("cam-1", "g5").label) == (2, None), "key 3: class 2"

            heard = sent_to(devices["cam-1"], 1 + len(accepted) + 1)
            expected = {(first[1], guess), ("g2", 2)} | {(key.split("/")[1], 7) for key in accepted}
            assert {(m.query_id, m.label) for m in heard} == expected, "once held out their undo window"
            assert [(m.query_id, m.label) for m in sent_to(devices["cam-2"], 1)] == [("h1", classes.index("zebra"))]
            corrected = accepted[0]
            item = f'#history button.given[data-query="{corrected}"]'
            wait_for(lambda: page.evaluate(f"return document.querySelector('{item}') !== null"), 20, "the history")
            after(page, lambda: page.evaluate(f"document.querySelector('{item}').click(); return 1;"))
            after(page, lambda: press(page, "5"))
            correction = sent_to(devices["cam-1"], 1)[0]
            assert isinstance(correction, LabelCorrection)
            assert (correction.query_id, correction.label, correction.revision) == (corrected.split("/")[1], 4, 1)
            assert queue.status(time.time()).corrections == 1
            before = page.evaluate("return document.getElementById('query-image').getBoundingClientRect().width")
            press(page, "+")
            assert (
                page.evaluate("return document.getElementById('query-image').getBoundingClientRect().width")
                == 2 * before
            )
            assert page.evaluate("return document.getElementById('today-count').textContent") == str(
                queue.status(time.time()).answers_today["ana"]
            )
    finally:
        desk.stop()
