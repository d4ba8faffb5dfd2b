# The labelling desk: its own MQTT session takes devices' queries into the queue (stored before the broker is acked
# and the device gets its receipt) and sends each decided answer (once its undo hold is over) and each correction to
# its device until the device's receipt says it is stored; a supervised part (protocol.supervision).
from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Mapping

from coordinator.labelling.queue import LabelQueue
from coordinator.labelling.queue_records import Correction, Decided, QueueRefusal
from protocol import label_messages, topics, wire
from protocol.label_signing import sign, signature_valid
from protocol.mqtt import IncomingMessage, MqttSession
from protocol.resend import ResendSchedule
from protocol.supervision import SET_ASIDE, Health, MessageGuard, SupervisedThread, bounded_name

log = logging.getLogger(__name__)

RESEND_SECONDS = 30.0
PART = "labelling-desk"
OTHER_TOPIC = "(topic)"  # the sender of a message on a topic that names no device
FROM_DEVICE = (label_messages.AnswerReceipt, label_messages.CorrectionReceipt, label_messages.LocalAnswer)
ToDevice = label_messages.LabelAnswer | label_messages.LabelCorrection | label_messages.QueryReceipt


class LabellingDesk:
    """Runs on a background thread: queries in (each acknowledged to the broker only once queued or refused),
    receipts in, answers and corrections out (QoS 1). An undelivered answer is sent when decided (a page's answer
    once its undo hold is over), at every start (so a coordinator killed before a receipt sends it again) and again
    after `resend_seconds`, doubling up to an hour, for as long as its device stays away; the device stores an answer
    once however often it comes. A correction goes the same way, settled by the receipt of its revision. With `keys`
    (a secured fleet: each device's labelling key, protocol.label_signing) answers, corrections and query receipts go
    out signed, and a receipt or local answer that is not signed with its device's key is refused (`bad_signature`,
    naming the sender)."""

    def __init__(
        self,
        fleet: str,
        session: MqttSession,
        queue: LabelQueue,
        resend_seconds: float = RESEND_SECONDS,
        health: Health | None = None,
        keys: Mapping[str, bytes] | None = None,
    ) -> None:
        self.fleet = fleet
        self.keys = None if keys is None else dict(keys)
        self.session = session
        self.queue = queue
        self.health = health or Health()
        self.refusals: Counter[tuple[str, str]] = Counter()
        self.resends: ResendSchedule[tuple[str, str]] = ResendSchedule(resend_seconds)
        self.correction_resends: ResendSchedule[tuple[str, str, int]] = ResendSchedule(resend_seconds)
        self.guard = MessageGuard(PART, self.health, queue.folder / SET_ASIDE)
        self._lock = threading.Lock()
        self._pending: IncomingMessage | None = None
        self._thread = SupervisedThread(PART, self._serve, self.health)
        self.router: topics.Router = topics.Router()
        self.router.add(topics.LABEL_QUERIES.bind(fleet=fleet), self.on_query)
        self.router.add(topics.LABELLING_UP.bind(fleet=fleet), self.on_receipt)

    def start(self) -> LabellingDesk:
        """Subscribes and starts the thread."""
        for topic_filter in self.router.filters():
            self.session.subscribe(topic_filter)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stops the thread (the session is its owner's to close)."""
        self._thread.stop()

    def send(self, decided: Decided) -> None:
        """Publishes a decided answer to its device (QoS 1) and schedules its resend; a field test query's answer
        is never sent (the device was told at queueing that it closes without a label)."""
        if decided.field_test:
            return
        answer = label_messages.LabelAnswer(decided.query_id, decided.label, decided.answered_by, decided.answered_at)
        key = (decided.device, decided.query_id)
        with self._lock:
            self.resends.sent(key)
        self._publish(decided.device, answer)
        log.info("answer sent device=%s query=%s label=%d", decided.device, decided.query_id, decided.label)

    def send_correction(self, correction: Correction) -> None:
        """Publishes a correction to its device (QoS 1) and schedules its resend."""
        message = label_messages.LabelCorrection(
            correction.query_id, correction.label, correction.revision, correction.corrected_by, correction.corrected_at
        )
        with self._lock:
            self.correction_resends.settle((correction.device, correction.query_id, correction.revision - 1))
            self.correction_resends.sent((correction.device, correction.query_id, correction.revision))
        self._publish(correction.device, message)
        log.info(
            "correction sent device=%s query=%s label=%d revision=%d",
            *(correction.device, correction.query_id, correction.label, correction.revision),
        )

    def on_query(self, message: IncomingMessage, device: str) -> None:
        """Queues one device's query (a refused or malformed one is counted and logged, never raised)."""
        if message.dropped or not message.payload:
            self._refuse(device, "transfer_dropped", message.dropped.kind if message.dropped else "empty")
            return
        try:
            query = wire.decode(message.payload, label_messages.LabelQuery)
        except wire.WireError as error:
            self._refuse(device, "bad_message", str(error))
            return
        known = self.keys is None or device in self.keys
        refusal = self.queue.add(query, device) if known else QueueRefusal.UNKNOWN_DEVICE
        if refusal is not None:
            self._refuse(device, refusal.value, wire.shown(query.query_id))
        else:
            log.info("query queued device=%s query=%s bytes=%d", device, query.query_id, len(query.image))
        if wire.IDENTIFIER.fullmatch(query.query_id):
            field_test = refusal is None and self.queue.is_field_test(device, query.query_id)
            receipt = label_messages.QueryReceipt(
                query.query_id, refusal is None, "" if refusal is None else refusal.value, field_test=field_test
            )
            self._publish(device, receipt)

    def on_receipt(self, message: IncomingMessage, device: str) -> None:
        """Settles an answer or correction the device says it stored (or refused), or takes a query's answer or
        correction the device got by another road."""
        try:
            receipt = wire.decode_any(message.payload, FROM_DEVICE)
        except wire.WireError as error:
            self._refuse(device, "bad_message", str(error))
            return
        if self.keys is not None and not signature_valid(receipt, self.keys.get(device, b""), self.fleet, device):
            self._refuse(device, "bad_signature", f"{receipt.KIND} of query {wire.shown(receipt.query_id)}")
            return
        if receipt.device_id != device:
            return
        if isinstance(receipt, label_messages.LocalAnswer):
            if self.queue.answered_on_device(device, receipt.query_id, receipt.label, receipt.road):
                log.info("query answered on its device device=%s query=%s", device, receipt.query_id)
        elif isinstance(receipt, label_messages.CorrectionReceipt):
            if self.queue.correction_delivered(device, receipt.query_id, receipt.revision):
                with self._lock:
                    self.correction_resends.settle((device, receipt.query_id, receipt.revision))
                log.info("correction stored on device=%s query=%s", device, receipt.query_id)
        elif self.queue.delivered(device, receipt.query_id):
            with self._lock:
                self.resends.settle((device, receipt.query_id))
            log.info("answer stored on device=%s query=%s stored=%s", device, receipt.query_id, receipt.stored)

    def _publish(self, device: str, message: ToDevice) -> None:
        """Publishes an answer, a correction or a query receipt on the device's answers topic, signed with the
        device's labelling key in a secured fleet (a device the desk holds no key of gets it unsigned, and ignores
        it)."""
        key = None if self.keys is None else self.keys.get(device)
        signed = message if key is None else sign(message, key, self.fleet, device)
        self.session.publish(topics.LABELLING_DOWN.build(fleet=self.fleet, device=device), wire.encode(signed))

    def resend_due(self) -> None:
        """Sends every undelivered answer and correction whose time has come (all of them at the first call, and an
        answer whose hold just ended at once)."""
        now = time.monotonic()
        for decided in self.queue.undelivered():
            with self._lock:
                due = self.resends.due((decided.device, decided.query_id), now)
            if due:
                self.send(decided)
        for correction in self.queue.undelivered_corrections():
            with self._lock:
                due = self.correction_resends.due((correction.device, correction.query_id, correction.revision), now)
            if due:
                self.send_correction(correction)

    def release_due(self) -> None:
        """Sends the answers whose undo hold is over, each at once."""
        for decided in self.queue.release(time.time()):
            self.send(decided)

    def _serve(self, stop: threading.Event) -> None:
        """The desk's loop: messages as they come (a message whose handler failed first, when the loop restarts),
        answers whose hold ended as they end, resends once a second."""
        next_resend = 0.0
        while not stop.is_set():
            message = self._pending or self.session.next_message(timeout=0.2)
            if message is not None:
                self._pending = message
                self._handle(message)
                self._pending = None
            self.release_due()
            if time.monotonic() >= next_resend:
                next_resend = time.monotonic() + 1.0
                self.resend_due()

    def _handle(self, message: IncomingMessage) -> None:
        """Routes one message under the desk's guard, then acknowledges it to the broker (the queue has stored what
        it keeps, or the message was set aside); a topic that names no device of this fleet is refused."""
        found = self.router.route(message.topic)
        if found is None:
            self._refuse(OTHER_TOPIC, "bad_topic", message.topic)
        else:
            handler, values = found
            device = values["device"]
            self.guard.handle(message.topic, message.payload, device, lambda: handler(message, device))
        self.session.acknowledge(message)

    def _refuse(self, device: str, kind: str, detail: str) -> None:
        """Counts (by sender, bounded like the health's) and logs one refused message (its detail cut short)."""
        self.refusals[(bounded_name({who for who, _ in self.refusals}, device), kind)] += 1
        log.warning("labelling message refused device=%s kind=%s detail=%s", device, kind, detail[:200])
