# The labelling page's HTTP API on a real dashboard server with a real desk and broker: a person's answer is stored
# before it goes to its device (QoS 1), and every bad request gets its own bounded status.
from __future__ import annotations

import io
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from coordinator.dashboard.server import Dashboard, ListenAddress
from coordinator.labelling.desk import LabellingDesk
from coordinator.labelling.queue import LabelQueue
from protocol import topics, wire
from protocol.label_messages import LabelAnswer, LabelQuery, QueryReceipt

FLEET = "lab"
TOKEN = "a-token-of-sixteen-chars"
CLASSES = ("cat", "dog", "bird")


def png() -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(np.zeros((8, 8), dtype=np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture()
def served(tmp_path: Path, broker, sessions) -> Iterator[tuple[str, LabelQueue, object]]:
    """A dashboard with the token and a labelling desk on a real broker; a device session listening for answers."""
    queue = LabelQueue(tmp_path / "run", CLASSES)
    for query_id in ("q1", "q2"):
        queue.add(LabelQuery("cam-1", query_id, png(), "image/png", 1.0, 1, 0.7, 0.3, 0.5), "cam-1")
    device = sessions(broker.address, "cam-1")
    device.subscribe(topics.LABEL_ANSWERS.build(fleet=FLEET, device="cam-1"))
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
    device.subscribe(topics.LABEL_ANSWERS.build(fleet=FLEET, device="cam-1"))
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
        with_labelling(rounds, settings, dashboard)(broker.address)
    assert heard == [("receipt", True), ("answer", 200), ("sent", 1)]


def test_the_dashboard_and_metrics_show_the_queue_per_device_and_the_people(served) -> None:
    url, _, _ = served
    assert call(url + "api/label/answer", "POST", answer(), authorised())[0] == 200
    status, body = call(url + "api/devices", headers=authorised())
    view = json.loads(body)
    row = next(row for row in view["devices"] if row["device_id"] == "cam-1")
    assert status == 200 and row["label_queue"]["open"] == 1 and row["label_queue"]["oldest_age_seconds"] >= 0
    assert view["labelling"] == {"open": 1, "people": [{"person": "ana", "answers_last_hour": 1}]}
    status, body = call(url + "metrics", headers=authorised())
    text = body.decode()
    assert 'fl_labelling_open_queries{device="cam-1"} 1' in text
    assert 'fl_labelling_oldest_open_seconds{device="cam-1"} ' in text
    assert 'fl_labelling_answers_last_hour{person="ana"} 1' in text
