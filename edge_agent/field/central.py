# --labelling central: a field device sends each query's image and the model's guess to its fleet's labelling queue
# and takes the people's answers and corrections back into its query store (the one answer path), acknowledging each
# once stored.
from __future__ import annotations

import functools
import io
import logging
import queue
import threading
import time
from pathlib import Path

from PIL import Image, ImageOps

from edge_agent.data.device_data import DeviceData
from edge_agent.data.oracle import Guess
from edge_agent.data.query_records import Delivery, LabelKind, Query, Road
from edge_agent.field.folder_oracle import FolderOracle
from protocol import label_messages, topics, wire
from protocol.bounds import SCORE_RANGE, UNIT_RANGE, clamped
from protocol.label_signing import sign, signature_valid
from protocol.mqtt import IncomingMessage, MqttSession, PayloadTooLargeError
from protocol.resend import ResendSchedule
from protocol.supervision import Health, MessageGuard, SupervisedThread

log = logging.getLogger(__name__)

LABELS_CSV_SECONDS = 1.0  # how often labels.csv's size and time are looked at (it is read when they change)
GUESS_UNKNOWN = Guess(label_messages.NO_GUESS, 0.0, 0.0, 0.0)  # what a query asked without the model's guess carries
RESEND_SECONDS = 30.0
MEDIA_TYPES = {".png": "image/png", ".jpg": "image/jpeg", ".jpeg": "image/jpeg"}
PART = "labelling-link"
FROM_DESK = (label_messages.LabelAnswer, label_messages.LabelCorrection, label_messages.QueryReceipt)
DeskMessage = label_messages.LabelAnswer | label_messages.LabelCorrection | label_messages.QueryReceipt
QUEUE = "labelling-queue"  # who the link's messages come from, as its set-aside counts name them


def query_image(path: Path, max_side: int | None) -> tuple[bytes, str]:
    """A query's image as sent: the file as captured, or (with `max_side`, or a type the queue does not take) a PNG
    no larger than max_side on either side, turned upright by its EXIF orientation."""
    media_type = MEDIA_TYPES.get(path.suffix.lower())
    if max_side is None and media_type is not None:
        return path.read_bytes(), media_type
    with Image.open(path) as opened:
        image = ImageOps.exif_transpose(opened)  # upright, as the file shows (the PNG carries no orientation)
        if max_side is not None:
            image.thumbnail((max_side, max_side))
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
    return buffer.getvalue(), "image/png"


class CentralLabelling:
    """The device's side of the fleet's labelling queue, on its own thread over the agent's session (one login, one
    session), so a round's queries go out and their answers reach the query store while the agent's loop waits in
    the round.

    Each query the queue has not confirmed (its record in the query store says) is published on the device's
    queries topic at QoS 1, chunked by the session like an update, and again after `resend_seconds`
    (RESEND_SECONDS), doubling up to an hour, until the queue's receipt comes (a queue that was not listening yet
    gets it later). The link looks at the store when the store says something new was stored (a query asked, an
    answer or correction given on any road) and when a resend falls due, never on a timer. An answer from the
    queue is delivered to the query store (durable) before its receipt goes back, so the queue sends it again until
    the device has stored it (a device killed in between gets it again), and a repeated one changes nothing; a
    correction the same way (its revision receipted), replacing the label held unless a newer one came first.

    With `key` (a secured fleet: the device's labelling key, protocol.label_signing) an answer, correction or query
    receipt counts only with the desk's signature (the others are logged and ignored), and the device signs what it
    sends back."""

    def __init__(
        self,
        fleet: str,
        device_id: str,
        oracle: FolderOracle,
        max_side: int | None,
        resend_seconds: float = RESEND_SECONDS,
        health: Health | None = None,
        key: bytes | None = None,
    ) -> None:
        self.fleet = fleet
        self.device_id = device_id
        self.session: MqttSession | None = None
        self.oracle = oracle
        self.max_side = max_side
        self.resends: ResendSchedule[str] = ResendSchedule(resend_seconds)
        self.key = key
        self.health = health or Health()
        self.guard = MessageGuard(PART, self.health, None)
        self._inbox: queue.Queue[IncomingMessage] = queue.Queue()
        self._pending: IncomingMessage | None = None
        self._news = threading.Event()  # the link's: something was stored since it last looked
        self._untaken = threading.Event()  # the agent's: an answer or correction may wait for the labelled store
        self._untaken.set()
        oracle.book.store.listen(self._news.set)
        oracle.book.store.listen(self._untaken.set)
        self._thread = SupervisedThread(PART, self._serve, self.health)
        oracle.keeps_guesses = True

    @property
    def data(self) -> DeviceData:
        """The device's data (its labelled store)."""
        return self.oracle.data

    def open(self, session: MqttSession) -> None:
        """Reads the device's answers topic of the agent's session (diverted to this link's thread, before the
        session connects) and starts the thread."""
        self.session = session
        session.divert(topics.LABELLING_DOWN.build(fleet=self.fleet, device=self.device_id), self._inbox.put)
        self._thread.start()

    def close(self) -> None:
        """Stops the thread (the session is the agent's)."""
        self._thread.stop()

    def tick(self) -> None:
        """On the agent's thread: moves the answers and corrections stored since into the labelled store (nothing to
        read when the store has no news)."""
        if not self._untaken.is_set():
            return
        self._untaken.clear()
        self.oracle.correct()
        indices, labels = self.oracle.collect()
        if len(indices):
            self.data.add_labels(indices, labels)
            log.info("answers applied device=%s labels=%d", self.device_id, len(indices))

    def send_due(self, session: MqttSession) -> None:
        """Sends each query the queue has not confirmed and nobody answered, when its time has come; tells the
        queue of its queries answered or corrected on the device (its page, labels.csv), so nobody labels them twice
        and the queue holds the label the device does."""
        store = self.oracle.book.store
        for stored in store.unreported_local_answers():
            local = label_messages.LocalAnswer(self.device_id, stored.query_id, stored.label, stored.road)
            self._publish_receipt(session, local)
            store.note_reported(stored.query_id)
        corrections = store.unreported_corrections()
        queued = store.queued() if corrections else set()
        for fixed in corrections:
            if fixed.query_id in queued:
                local = label_messages.LocalAnswer(self.device_id, fixed.query_id, fixed.label, fixed.road)
                self._publish_receipt(session, local)
            store.note_correction_reported(fixed.query_id, fixed.label)
        now = time.monotonic()
        for query in store.to_send():
            if self.resends.due(query.query_id, now):
                self.send(session, query)

    def send(self, session: MqttSession, query: Query) -> None:
        """Publishes one query and schedules its resend; a query that cannot be sent (its copy gone or unreadable,
        its image beyond the queue's bound) is logged and settled: it stays answerable on the device's own roads."""
        self.resends.sent(query.query_id)
        self.oracle.book.store.note_sent(query.query_id)
        guess = query.guess or GUESS_UNKNOWN
        try:
            image, media_type = query_image(self.oracle.book.image_path(query), self.max_side)
            if len(image) > label_messages.DEFAULT_MAX_IMAGE_BYTES:
                raise ValueError(
                    f"its image of {len(image)} bytes is over {label_messages.DEFAULT_MAX_IMAGE_BYTES} (--query-image-side)"
                )
            message = label_messages.LabelQuery(
                self.device_id, query.query_id, image, media_type, query.asked_at, *_guess_fields(guess)
            )
            session.publish(topics.LABEL_QUERIES.build(fleet=self.fleet, device=self.device_id), wire.encode(message))
        # a copy gone or unreadable (OSError; PIL's errors are OSError or ValueError), an image over the bound, a
        # message over the session's limit
        except (OSError, ValueError, PayloadTooLargeError) as error:
            log.warning("query not sent to the queue query=%s error=%s", query.query_id, str(error)[:200])
            self.oracle.book.store.note_queued(query.query_id)

    def handle(self, session: MqttSession, message: IncomingMessage) -> None:
        """One message from the queue: a query's receipt settles the query (unless the queue was full: its resends
        go on; a field test query's closes it without a label); an answer or a correction is stored, then receipted. A malformed message is logged (bounded) and
        dropped."""
        try:
            received = wire.decode_any(message.payload, FROM_DESK)
        except wire.WireError as error:
            log.warning("ignored bad labelling message topic=%s error=%s", message.topic[:200], error)
            received = None
        if received is not None and self.key is not None and not self._from_desk(received):
            received = None
        if isinstance(received, label_messages.QueryReceipt) and received.refusal in label_messages.RETRIED_REFUSALS:
            log.info("query waits for room in the queue query=%s", wire.shown(received.query_id))
        elif isinstance(received, label_messages.QueryReceipt) and received.field_test:
            self.oracle.book.store.note_closed(received.query_id)
            self.resends.settle(received.query_id)
            log.info("query closed without a label (field test) query=%s", wire.shown(received.query_id))
        elif isinstance(received, label_messages.QueryReceipt):
            self.oracle.book.store.note_queued(received.query_id)
            self.resends.settle(received.query_id)
            if not received.queued:
                log.warning(
                    "query refused by the queue query=%s kind=%s", wire.shown(received.query_id), received.refusal[:32]
                )
        elif received is not None:
            self.store(session, received)

    def store(self, session: MqttSession, word: label_messages.LabelAnswer | label_messages.LabelCorrection) -> None:
        """Stores one answer or correction from the queue in the query store, then sends its receipt."""
        try:
            delivery: Delivery | None = self.oracle.book.record_answer(
                word.query_id, word.label, Road.CENTRAL, *recorded_fields(word)
            )
        # record_answer's refusals (no such query here, a label outside the spec): settled as refused, not stored
        except ValueError as error:
            log.warning("central %s refused query=%s error=%s", word.KIND, wire.shown(word.query_id), error)
            delivery = None
        if delivery is Delivery.CONFLICT:
            log.warning("central answer differs from the one stored first query=%s", word.query_id)
        elif delivery is Delivery.CORRECTED:
            log.info("answer corrected device=%s query=%s label=%d", self.device_id, word.query_id, word.label)
        self._publish_receipt(session, receipt_of(self.device_id, word, delivery is not None))

    def _from_desk(self, message: DeskMessage) -> bool:
        """Whether an answer or query receipt carries the desk's signature under this device's labelling key (a
        secured fleet's); one that does not is logged (bounded) and ignored: it did not come from the desk."""
        if signature_valid(message, self.key or b"", self.fleet, self.device_id):
            return True
        log.warning(
            "labelling message without the desk's signature ignored kind=%s query=%s",
            message.KIND,
            wire.shown(message.query_id),
        )
        return False

    def _publish_receipt(
        self,
        session: MqttSession,
        message: label_messages.AnswerReceipt | label_messages.CorrectionReceipt | label_messages.LocalAnswer,
    ) -> None:
        """Publishes a receipt or local answer to the desk, signed with this device's labelling key when it has one."""
        signed = message if self.key is None else sign(message, self.key, self.fleet, self.device_id)
        session.publish(topics.LABELLING_UP.build(fleet=self.fleet, device=self.device_id), wire.encode(signed))

    def _serve(self, stop: threading.Event) -> None:
        """The link's thread: messages from the queue as they come (one whose handling failed first, when the loop
        restarts; the broker redelivers nothing while the session lives), the store's news (new queries, answers
        given on the device) and due resends as they come (so a round that waits for its answers has its queries
        out and its answers in meanwhile), labels.csv looked at once a second."""
        session, next_look = self.session, 0.0
        self._news.set()  # (a start sends whatever waits)
        while session is not None and not stop.is_set():
            message = self._pending or self._next_message()
            if message is not None:
                self._pending = message
                self.guard.handle(
                    message.topic, message.payload, QUEUE, functools.partial(self.handle, session, message)
                )
                self._pending = None
            if time.monotonic() >= next_look:
                next_look = time.monotonic() + LABELS_CSV_SECONDS
                self.oracle.book.read_labels_csv()
            if self._news.is_set() or time.monotonic() >= self.resends.next_due():
                self._news.clear()
                self.send_due(session)

    def _next_message(self) -> IncomingMessage | None:
        """The next message from the queue, or None after a short wait."""
        try:
            return self._inbox.get(timeout=0.2)
        except queue.Empty:
            return None


def recorded_fields(
    word: label_messages.LabelAnswer | label_messages.LabelCorrection,
) -> tuple[str, float, LabelKind, int]:
    """(who, when, kind, revision) of an answer or correction from the queue, as the query store records them."""
    if isinstance(word, label_messages.LabelCorrection):
        return word.corrected_by, word.corrected_at, LabelKind.CORRECTION, word.revision
    return word.answered_by, word.answered_at, LabelKind.ANSWER, 0


def receipt_of(
    device: str, word: label_messages.LabelAnswer | label_messages.LabelCorrection, stored: bool
) -> label_messages.AnswerReceipt | label_messages.CorrectionReceipt:
    """The receipt that settles an answer (or a correction's revision) at the desk."""
    if isinstance(word, label_messages.LabelCorrection):
        return label_messages.CorrectionReceipt(device, word.query_id, word.revision, stored)
    return label_messages.AnswerReceipt(device, word.query_id, stored)


def _guess_fields(guess: Guess) -> tuple[int, float, float, float]:
    """A guess as the query message's fields, each inside the range the queue's wire check takes."""
    unit = (clamped(guess.probability, UNIT_RANGE), clamped(guess.uncertainty, UNIT_RANGE))
    return guess.label, *unit, clamped(guess.score, SCORE_RANGE)
