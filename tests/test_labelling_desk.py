# The queue's desk and a device's central labelling over a real broker, in one process: an acquisition's queries go
# out with the model's guess; bad queries get bounded refusals and nothing crashes; an answer waits for a device
# whose broker session has expired and reaches it by the desk's resends; an answer for a query the device never
# asked is refused by the device and settled; a correction replaces the device's label once, by any road.
from __future__ import annotations

import io
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from test_folder_pool import camera_oracle, write_png

from coordinator.labelling.desk import LabellingDesk
from coordinator.labelling.queue import LabelQueue
from coordinator.labelling.queue_records import QueueLimits
from edge_agent.data.fashion_mnist import load_fashion_mnist
from edge_agent.data.query_records import LabelKind
from edge_agent.field.central import CentralLabelling, query_image
from edge_agent.field.folder_oracle import FolderOracle, QueryBook
from edge_agent.field.folder_pool import open_folder_data
from edge_agent.field.parts import StreamAcquirer
from edge_agent.field.stream import BudgetSettings
from edge_agent.learning.learner_choice import make_learner
from edge_agent.learning.models import build_model, get_weights
from edge_agent.learning.predict import guesses_of
from edge_agent.learning.sampling import make_sampler
from edge_agent.loop.acquisition import Acquirer
from edge_agent.loop.agent import LatestModel, health_counts
from edge_agent.loop.agent_settings import AgentSettings
from edge_agent.loop.footprint import PhaseMeter
from edge_agent.loop.round_inputs import RoundModels
from protocol import label_messages, messages, topics, wire
from protocol.model_spec import CLASS_NAMES, DEFAULT_SPEC
from protocol.mqtt import MqttSession
from protocol.supervision import Health

FLEET = "lab"
DEVICE = "cam-1"


def wait_until(condition, what: str, timeout: float = 20.0, step=None) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        if step is not None:
            step()
        time.sleep(0.05)


class Device:
    """A field device's labelling parts on a real session: its folder oracle, its central link and router."""

    def __init__(self, root: Path, broker, session_expiry: int = 3600, resend_seconds: float = 30.0) -> None:
        images = load_fashion_mnist().test_images
        for i in range(6):
            write_png(root / "camera" / f"{i}.png", images[i], age_seconds=30 - i)
        self.data = open_folder_data(root / "state", root / "camera", pool_cap=10, settle_seconds=0)
        self.oracle = FolderOracle(QueryBook(root / "state" / "labelling"), self.data, wait_seconds=0)
        self.broker, self.session_expiry, self.resend_seconds = broker, session_expiry, resend_seconds
        self.connect()

    def connect(self) -> None:
        """Opens the link over a fresh session of the device (the agent's session, which the link shares)."""
        self.central = CentralLabelling(FLEET, DEVICE, self.oracle, None, self.resend_seconds)
        self.session = MqttSession(self.broker.address, client_id=DEVICE, session_expiry=self.session_expiry)
        self.central.open(self.session)
        self.session.connect()

    def close(self) -> None:
        self.central.close()
        self.session.close()

    def step(self) -> None:
        """What the agent's loop does between messages: the field work's tick."""
        self.central.tick()


@pytest.fixture()
def desk(tmp_path: Path, broker) -> Iterator[LabellingDesk]:
    queue = LabelQueue(tmp_path / "run", tuple(CLASS_NAMES), QueueLimits(image_bytes=4000))
    session = MqttSession(broker.address, client_id="desk", manual_ack=True)
    session.connect()
    running = LabellingDesk(FLEET, session, queue, resend_seconds=0.3).start()
    yield running
    running.stop()
    session.close()


def test_guesses_are_the_mean_class_its_probability_and_normalised_entropy() -> None:
    probs = np.array([[[0.9, 0.1], [0.5, 0.5]], [[0.7, 0.3], [0.5, 0.5]]])
    first, second = guesses_of(probs, None)
    assert (first.label, round(first.probability, 3)) == (0, 0.8) and 0 < first.uncertainty < 1
    assert second.uncertainty == pytest.approx(1.0) and second.score == second.uncertainty
    assert guesses_of(probs, np.array([3.0, 4.0]))[1].score == 4.0


def test_an_acquisition_sends_its_queries_with_the_model_guess(tmp_path: Path, broker, desk) -> None:
    device = Device(tmp_path, broker)
    settings = AgentSettings(FLEET, DEVICE)
    weights = get_weights(build_model(DEFAULT_SPEC, seed=0))
    learner = make_learner(settings.compute, device.data.state_dir, DEFAULT_SPEC, weights, None)
    recipe = messages.Recipe(sampler="entropy", labels_per_acquisition=2, mc_passes=3)
    Acquirer(settings, device.data, device.oracle, PhaseMeter()).acquire(
        RoundModels(learner, "", recipe), make_sampler("entropy"), 0, 1, 0
    )
    asked = device.oracle.book.queries()
    assert len(asked) == 2
    wait_until(lambda: len(device.oracle.book.store.queued()) == 2, "the queue's receipts", step=device.step)
    queued = {query.query_id: query for query in desk.queue.all()}
    assert set(queued) == {query.query_id for query in asked}
    for query in asked:
        shown = queued[query.query_id]
        guess = query.guess
        assert guess is not None, "the query's record holds the guess it went out with"
        assert (shown.guess, shown.probability, shown.score) == (guess.label, guess.probability, guess.score)
        assert 0 <= shown.guess < 10 and 0 < shown.probability <= 1 and 0 <= shown.uncertainty <= 1
    image = desk.queue.image_path(DEVICE, asked[0].query_id, "image/png").read_bytes()
    assert image == device.oracle.book.image_path(asked[0]).read_bytes(), "the file as captured"
    device.close()


def test_a_downscaled_query_image_is_a_png_within_its_side(tmp_path: Path) -> None:
    path = tmp_path / "big.jpg"
    Image.fromarray(np.zeros((300, 200, 3), dtype=np.uint8)).save(path, format="JPEG")
    data, media_type = query_image(path, 64)
    assert media_type == "image/png" and max(Image.open(io.BytesIO(data)).size) == 64
    assert query_image(path, None) == (path.read_bytes(), "image/jpeg")


def test_a_downscaled_query_image_is_upright_as_its_exif_orientation_says(tmp_path: Path) -> None:
    path = tmp_path / "rotated.jpg"
    exif = Image.Exif()
    exif[0x0112] = 6  # the camera was turned: the stored 300x200 picture shows as 200x300
    Image.fromarray(np.zeros((200, 300, 3), dtype=np.uint8)).save(path, format="JPEG", exif=exif)
    data, _ = query_image(path, 150)
    assert Image.open(io.BytesIO(data)).size == (100, 150)


def test_bad_queries_get_bounded_refusals_and_the_desk_goes_on(tmp_path: Path, broker, desk, sessions) -> None:
    attacker = sessions(broker.address, "cam-x")
    attacker.subscribe(topics.LABELLING_DOWN.build(fleet=FLEET, device="cam-x"))
    topic = topics.LABEL_QUERIES.build(fleet=FLEET, device="cam-x")
    good = io.BytesIO()
    Image.fromarray(np.zeros((8, 8), dtype=np.uint8)).save(good, format="PNG")
    cases = {
        "junk": b"\x89PNG\r\n\x1a\n" + b"A" * 200,
        "huge": good.getvalue() + b"\0" * 5000,
        "good": good.getvalue(),
    }
    attacker.publish(topic, b"not msgpack at all")
    for query_id, image in cases.items():
        query = label_messages.LabelQuery("cam-x", query_id, image, "image/png", 1.0)
        attacker.publish(topic, wire.encode(query))
    attacker.publish(topic, b"\0" * 300_000)  # no message at all, under the broker's limit
    receipts = {}
    while len(receipts) < 3:
        message = attacker.next_message(timeout=10)
        assert message is not None, receipts
        receipt = wire.decode(message.payload, label_messages.QueryReceipt)
        receipts[receipt.query_id] = (receipt.queued, receipt.refusal)
    assert receipts == {"junk": (False, "undecodable"), "huge": (False, "too_large"), "good": (True, "")}
    expected = {"bad_message": 2, "undecodable": 1, "too_large": 1}
    wait_until(
        lambda: desk.refusals == {("cam-x", kind): count for kind, count in expected.items()},
        "every refusal counted by its kind",
    )
    assert [query.query_id for query in desk.queue.all()] == ["good"]


def test_an_answer_waits_for_a_device_whose_session_expired_and_a_stray_one_is_settled(
    tmp_path: Path, broker, desk, sessions
) -> None:
    device = Device(tmp_path, broker, session_expiry=1)
    device.oracle.ask(np.array([0, 1]))
    wait_until(lambda: len(desk.queue.all()) == 2, "the queries queued", step=device.step)
    device.close()
    time.sleep(1.5)  # the broker forgets the device's session: only the desk's resends can reach it now
    first = desk.queue.all()[0]
    desk.send(desk.queue.record(DEVICE, first.query_id, 4, "ana").decided)
    time.sleep(1.0)
    device.connect()
    wait_until(lambda: desk.queue.undelivered() == [], "the answer's receipt", step=device.step)
    assert device.oracle.book.stored_answers() == {device.oracle.book.queries()[0].name: 4}
    device.step()  # the agent's next tick applies it
    assert device.data.labelled()[0].tolist() == [device.oracle.book.queries()[0].index]
    receipts = sessions(broker.address, "receipts")
    receipts.subscribe(topics.LABELLING_UP.build(fleet=FLEET, device=DEVICE))
    stray = label_messages.LabelAnswer("never-asked", 1, "ana", 1.0)
    receipts.publish(topics.LABELLING_DOWN.build(fleet=FLEET, device=DEVICE), wire.encode(stray))
    receipt = wire.decode(receipts.next_message(timeout=10).payload, label_messages.AnswerReceipt)
    assert (receipt.query_id, receipt.stored) == ("never-asked", False), "refused, and settled all the same"
    assert len(device.oracle.book.store.answers()) == 1
    device.close()


def test_a_stream_notes_the_guess_of_each_image_it_asks_for(tmp_path: Path) -> None:
    oracle = camera_oracle(tmp_path, 6)
    CentralLabelling(FLEET, DEVICE, oracle, None)  # it asks the oracle to keep guesses
    stream = StreamAcquirer(oracle.data, oracle, BudgetSettings(3600.0, 2.0), AgentSettings(FLEET, DEVICE), 2)
    weights = get_weights(build_model(DEFAULT_SPEC, seed=9))
    stream.score_new(LatestModel(DEFAULT_SPEC, weights, messages.Recipe(sampler="margin"), None, ""), round_id=1)
    asked = QueryBook(oracle.book.oracle_dir).queries()  # the store as another process reads it
    guesses = [query.guess for query in asked]
    assert asked and None not in guesses
    assert all(0 <= guess.label < 10 and 0 < guess.probability <= 1 for guess in guesses if guess is not None)


def test_an_idle_link_looks_at_nothing_and_wakes_when_a_query_is_stored(tmp_path: Path, broker, desk) -> None:
    device = Device(tmp_path, broker)
    device.oracle.ask(np.array([0, 1]))
    wait_until(lambda: len(device.oracle.book.store.queued()) == 2, "the queries queued", step=device.step)
    device.step()
    statements: list[str] = []
    device.oracle.book.store._conn.set_trace_callback(statements.append)
    time.sleep(2.5)  # two looks at labels.csv's size and time and about twelve empty waits for the queue's messages
    device.step()  # the agent's tick: no news, nothing read
    assert statements == [], "an idle link and tick read nothing from the store"
    device.oracle.ask(np.array([2]))
    wait_until(lambda: len(desk.queue.all()) == 3, "the new query in the queue")
    assert any("FROM queries" in statement for statement in statements), "the store's news woke the link"
    device.close()


def test_a_round_waiting_for_answers_gets_the_queues_answer_meanwhile(tmp_path: Path, broker, desk) -> None:
    device = Device(tmp_path, broker)
    device.oracle.wait_seconds = 30.0

    def person() -> None:
        wait_until(lambda: len(desk.queue.all()) == 1, "the round's query in the queue")
        desk.send(desk.queue.record(DEVICE, desk.queue.all()[0].query_id, 6, "ana").decided)

    answering = threading.Thread(target=person)
    answering.start()
    started = time.monotonic()
    waits: list[bool] = []
    device.oracle.notify_wait(waits.append)  # the round runner's: the device's status says it waits for answers
    indices, labels = device.oracle.label(np.array([2]))
    answering.join()
    assert (indices.tolist(), labels.tolist()) == ([2], [6]) and time.monotonic() - started < 20
    assert waits == [True, False]
    device.close()


def test_a_correction_reaches_the_device_store_once_and_its_receipt_settles_it(
    tmp_path: Path, broker, desk, sessions
) -> None:
    device = Device(tmp_path, broker)
    device.oracle.ask(np.array([0, 1]))
    wait_until(lambda: len(desk.queue.all()) == 2, "the queries queued", step=device.step)
    first, second = device.oracle.book.queries()
    for query, label in ((first, 4), (second, 1)):
        desk.send(desk.queue.record(DEVICE, query.query_id, label, "ana").decided)
    wait_until(lambda: desk.queue.undelivered() == [], "the answers' receipts", step=device.step)
    device.step()
    correction = desk.queue.record(DEVICE, first.query_id, 7, "bo", change=True).correction
    assert correction is not None and correction.revision == 1
    desk.send_correction(correction)
    wait_until(lambda: desk.queue.undelivered_corrections() == [], "the correction's receipt", step=device.step)
    device.step()
    labelled = dict(zip(*(array.tolist() for array in device.data.labelled())))
    assert labelled == {first.index: 7, second.index: 1} and device.data.count_labels("correction") == 1
    device.oracle.book.record_answer(second.name, 3, kind=LabelKind.CORRECTION)  # on the device's own page
    wait_until(lambda: desk.queue.get(DEVICE, second.query_id).label == 3, "the queue told of it")
    assert desk.queue.undelivered_corrections() == [] and desk.queue.status(time.time()).corrections == 2
    receipts = sessions(broker.address, "receipts")
    receipts.subscribe(topics.LABELLING_UP.build(fleet=FLEET, device=DEVICE))
    stray = label_messages.LabelCorrection("never-asked", 1, 3, "mallory", 1.0)
    receipts.publish(topics.LABELLING_DOWN.build(fleet=FLEET, device=DEVICE), wire.encode(stray))
    receipt = wire.decode(receipts.next_message(timeout=10).payload, label_messages.CorrectionReceipt)
    assert (receipt.query_id, receipt.revision, receipt.stored) == ("never-asked", 3, False), "refused, settled"
    assert not desk.queue.correction_delivered(DEVICE, "never-asked", 3), "the desk knows no such correction"
    device.step()
    assert dict(zip(*(array.tolist() for array in device.data.labelled()))) == {first.index: 7, second.index: 3}
    device.close()


def test_a_query_answered_on_the_device_leaves_the_queue(tmp_path: Path, broker, desk) -> None:
    device = Device(tmp_path, broker)
    device.oracle.ask(np.array([0, 1]))
    wait_until(lambda: len(device.oracle.book.store.queued()) == 2, "both queries in the queue")
    on_page = device.oracle.book.queries()[0]
    device.oracle.book.record_answer(on_page.name, 3)  # the device's own page
    wait_until(lambda: desk.queue.get(DEVICE, on_page.query_id).label == 3, "the queue told")
    closed = desk.queue.get(DEVICE, on_page.query_id)
    assert closed.answered_by == f"{DEVICE}:page" and desk.queue.undelivered() == []
    assert desk.queue.next_for("ana").query_id == device.oracle.book.queries()[1].query_id
    device.close()


def test_a_query_refused_for_a_full_queue_is_sent_again_when_there_is_room(tmp_path: Path, broker) -> None:
    queue = LabelQueue(tmp_path / "run", tuple(CLASS_NAMES), QueueLimits(per_device=1))
    session = MqttSession(broker.address, client_id="small-desk", manual_ack=True)
    session.connect()
    small = LabellingDesk(FLEET, session, queue, resend_seconds=0.3).start()
    device = Device(tmp_path, broker, resend_seconds=0.5)
    try:
        device.oracle.ask(np.array([0, 1]))
        wait_until(
            lambda: small.refusals[(DEVICE, "device_full")] >= 1 and len(queue.all()) == 1, "one queued, one refused"
        )
        wait_until(lambda: len(device.oracle.book.store.queued()) == 1, "the first query's receipt")
        time.sleep(0.3)
        assert len(device.oracle.book.store.queued()) == 1, "the refused one is not settled"
        small.send(queue.record(DEVICE, queue.all()[0].query_id, 2, "ana").decided)
        wait_until(lambda: len(queue.all()) == 2, "the second query queued once there is room", step=device.step)
        wait_until(lambda: len(device.oracle.book.store.queued()) == 2, "its receipt back at the device")
    finally:
        device.close()
        small.stop()
        session.close()


def test_a_query_far_over_the_bound_is_dropped_in_its_chunks(tmp_path: Path, broker, sessions) -> None:
    from coordinator.commands.labelling import desk_running

    queue = LabelQueue(tmp_path / "run", tuple(CLASS_NAMES), QueueLimits(image_bytes=100_000))
    sender = sessions(broker.address, "cam-big")
    huge = label_messages.LabelQuery("cam-big", "huge", b"\xff" * 3_000_000, "image/jpeg", 1.0)
    with desk_running(FLEET, broker.address, queue, Health(), None) as running:
        sender.publish(topics.LABEL_QUERIES.build(fleet=FLEET, device="cam-big"), wire.encode(huge), wait=30)
        wait_until(lambda: running.refusals[("cam-big", "transfer_dropped")] >= 1, "the transfer dropped")
        assert queue.all() == [] and not (queue.folder / "images").exists()
        small = io.BytesIO()
        Image.fromarray(np.zeros((8, 8), dtype=np.uint8)).save(small, format="PNG")
        fine = label_messages.LabelQuery("cam-big", "fine", small.getvalue(), "image/png", 1.0)
        sender.publish(topics.LABEL_QUERIES.build(fleet=FLEET, device="cam-big"), wire.encode(fine))
        wait_until(lambda: [q.query_id for q in queue.all()] == ["fine"], "the desk going on")


def test_a_link_whose_store_fails_restarts_sets_the_answer_aside_and_says_so(tmp_path: Path, broker, sessions) -> None:
    """The device's query store closed under the link (as a failed disk would leave it): storing an answer raises,
    the link logs it and restarts (after 1 s, then 2 s), sets the answer aside at the third failure and keeps
    running; its health counts both, which the device's status reports (its agent's `health_counts`)."""
    device = Device(tmp_path, broker)
    try:
        device.oracle.ask(np.array([0]))
        query_id = device.oracle.book.queries()[0].query_id
        device.oracle.book.store._conn.close()
        desk = sessions(broker.address, "labelling-desk")
        answer = label_messages.LabelAnswer(query_id, 3, "ana", 1.7e9)
        desk.publish(topics.LABELLING_DOWN.build(fleet=FLEET, device=DEVICE), wire.encode(answer))
        wait_until(lambda: health_counts(device.central.health)[1] == 1, "the answer set aside after three tries")
        assert health_counts(device.central.health)[0] >= 2, "each failure restarted the link (its scans fail too)"
        assert device.central._thread.alive, "the link goes on"
        [part], _ = device.central.health.snapshot()
        assert part.last_error.startswith("ProgrammingError: Cannot operate on a closed database")
    finally:
        device.close()


def test_a_one_class_spec_guesses_without_dividing_by_log_one() -> None:
    (guess,) = guesses_of(np.ones((3, 1, 1)), None)
    assert (guess.label, guess.probability, guess.uncertainty, guess.score) == (0, 1.0, 0.0, 0.0)
