# Update intake: validate each update once, hand it to the round's aggregator, spool it, and ack or reject it.
from __future__ import annotations

import dataclasses
import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from coordinator.intake.observer import RoundObserver
from coordinator.intake.validation import Expectation, Incoming, Rejection, contributing_devices, decoded, validated
from coordinator.storage.store import RunStore
from coordinator.strategies.aggregate import ClientUpdate, OutOfRange
from protocol import messages, topics, wire
from protocol.messages import RejectionKind
from protocol.mqtt import MqttSession
from protocol.reassembly import Dropped

log = logging.getLogger(__name__)


def client_update(update: messages.Update) -> ClientUpdate:
    """The strategy's view of a validated update."""
    return ClientUpdate(
        update.device_id, update.tensors, update.num_samples, dict(update.metrics), contributing_devices(update)
    )


@dataclass
class RoundCollector:
    """The updates of one round as they arrive: accepted once per device, duplicates answered idempotently.

    Each accepted update's tensors go into `absorb` (the round's aggregator; by default nowhere, for a collector
    that only validates) and only its metadata stays here.
    """

    expectation: Expectation
    absorb: Callable[[ClientUpdate], None] = field(default=lambda update: None)
    accepted: dict[str, messages.Update] = field(default_factory=dict)
    digests: dict[str, str] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)
    rejected: dict[str, str] = field(default_factory=dict)
    rejection_count: int = 0

    @property
    def round_id(self) -> int:
        """The round being collected."""
        return self.expectation.round_id

    def reject(self, device_id: str, reason: str) -> None:
        """Notes a rejected update: the device's latest reason, and one more in the round's count."""
        self.rejected[device_id] = reason
        self.rejection_count += 1

    def offer(self, incoming: Incoming) -> tuple[messages.Update, bool]:
        """(update, is_new): a valid first update is new; a byte-identical redelivery of the accepted one is not;
        anything else from a device that already has an accepted update is a duplicate Rejection. Values the
        aggregator cannot take (its OutOfRange) are the device's out_of_range Rejection; any other exception the
        aggregator raises is a bug and propagates: the coordinator stops with its traceback, and the update is
        neither acked nor stored as the device's fault (the broker redelivers it to the restarted process)."""
        update = validated(incoming, self.expectation)
        device_id, digest = incoming.device_id, hashlib.sha256(incoming.payload).hexdigest()
        previous = self.accepted.get(device_id)
        if previous is not None:
            if previous.update_id == update.update_id and self.digests[device_id] == digest:
                return previous, False
            raise Rejection(RejectionKind.DUPLICATE, duplicate_reason(device_id, previous, update, self.round_id))
        try:
            self.absorb(client_update(update))
        except OutOfRange as error:
            raise Rejection(error.kind, f"out of range: {error}") from None
        update = dataclasses.replace(update, tensors={})
        self.accepted[device_id] = update
        self.digests[device_id] = digest
        self.sizes[device_id] = len(incoming.payload)
        return update, True


def duplicate_reason(device_id: str, previous: messages.Update, update: messages.Update, round_id: int) -> str:
    """Why a second update of a device is refused: a reused id with other content, or a second id."""
    if previous.update_id == update.update_id:
        return f"duplicate: update {update.update_id[:64]!r} was already accepted with different content"
    return f"duplicate: {device_id} already has an accepted update for round {round_id}"


class UpdateIntake:
    """Answers every update message: validated, absorbed and spooled before its ack, or rejected with a reason.

    Accepted updates are staged in the spool and every ack waits in `pending` until `commit` has made the batch
    durable (one fsync for the batch): no device hears "accepted" of an update a crash could still lose."""

    def __init__(self, fleet: str, session: MqttSession, store: RunStore, observer: RoundObserver) -> None:
        self.fleet = fleet
        self.session = session
        self.store = store
        self.observer = observer
        self.pending: list[messages.Ack] = []

    def on_update(
        self,
        device_id: str,
        payload: bytes,
        collector: RoundCollector | None,
        participants: list[str],
        dropped: Dropped | None = None,
    ) -> None:
        """Decodes an update once, validates, spools and acks it; a rejection is acked with its reason (quoting the
        decoded update's id), logged and counted. `dropped`: the update came in chunks that did not make a whole one
        (see on_dropped)."""
        if dropped is not None:
            self.on_dropped(device_id, dropped, collector)
            return
        if collector is None:
            self.reject(device_id, 0, Rejection(RejectionKind.NO_ROUND, "no round is open"), payload)
            return
        incoming = None
        try:
            if participants and device_id not in participants:
                reason = f"not selected: {device_id} is not a participant of round {collector.round_id}"
                raise Rejection(RejectionKind.NOT_SELECTED, reason)
            incoming = decoded(device_id, payload, collector.expectation)
            update, is_new = collector.offer(incoming)
        except Rejection as rejection:
            collector.reject(device_id, rejection.reason)
            self.reject(device_id, collector.round_id, rejection, payload, incoming)
            return
        if is_new:
            self.store.spool.stage(update.round_id, device_id, payload)
            self.observer.update_answered(device_id, update.round_id, len(payload), None)
            log.info("update accepted device=%s round=%d samples=%d", device_id, update.round_id, update.num_samples)
        self.ack(messages.Ack(device_id, update.round_id, update.update_id, True))

    def on_dropped(self, device_id: str, dropped: Dropped, collector: RoundCollector | None) -> None:
        """Answers a chunked update the session refused or abandoned (its chunks never made a whole update): a
        rejection of the transfer's kind, acked with no update id (it could not be read; the device's outbox keeps
        the update and sends it again)."""
        rejection = Rejection(dropped.kind, dropped.reason)
        if collector is not None:
            collector.reject(device_id, rejection.reason)
        self.reject(device_id, collector.round_id if collector else 0, rejection, b"", size=dropped.total_bytes)

    def resume_spooled(self, collector: RoundCollector) -> None:
        """Takes back the updates a previous coordinator process accepted for this round before it died (decoding
        each spooled payload again: recovery, the one path where an accepted update is decoded twice)."""
        for device_id, payload in self.store.spool.items(collector.round_id):
            try:
                collector.offer(decoded(device_id, payload, collector.expectation))
                log.info("resumed spooled update device=%s round=%d", device_id, collector.round_id)
            except Rejection as rejection:
                log.warning("spooled update no longer valid device=%s reason=%s", device_id, rejection.reason)

    def reject(
        self,
        device_id: str,
        round_id: int,
        rejection: Rejection,
        payload: bytes,
        incoming: Incoming | None = None,
        size: int | None = None,
    ) -> None:
        """Acks a rejection with its reason, kind and the update's id (from its decoded form when it got that far),
        counts it in the store and logs it once (`size`: the bytes the update had, when not the payload's)."""
        size = len(payload) if size is None else size
        log.warning(
            "update rejected device=%s round=%d kind=%s reason=%s",
            device_id,
            round_id,
            rejection.kind,
            rejection.reason,
        )
        self.record(device_id, round_id, rejection, size)
        update_id = incoming.update.update_id[:128] if incoming else update_id_of(payload)
        self.ack(messages.Ack(device_id, round_id, update_id, False, rejection.reason, rejection.kind))

    def record(self, device_id: str, round_id: int, rejection: Rejection, size: int) -> None:
        """Counts a refused message of `size` bytes at once: in the store (named by its device) and to the observer
        (the dashboard, and /metrics by kind). Updates and secure-round messages alike."""
        self.store.record_rejection(round_id, device_id, rejection.reason, size, rejection.kind)
        self.observer.update_answered(device_id, round_id, size, rejection)

    def ack(self, ack: messages.Ack) -> None:
        """Queues an ack for the device, published by the next commit."""
        self.pending.append(ack)

    def commit(self) -> None:
        """Makes the staged updates durable (one fsync), then publishes the queued acks on their devices' topics."""
        self.store.spool.commit()
        pending, self.pending = self.pending, []
        for ack in pending:
            self.session.publish(topics.ACK.build(fleet=self.fleet, device=ack.device_id), wire.encode(ack))


def update_id_of(payload: bytes) -> str:
    """The update id of a payload that was not decoded (no round, not selected, too large or undecodable within the
    round's limit) if it can be read at all, cut to 128 characters, for the rejection ack; "" if it cannot."""
    try:
        return wire.decode(payload, messages.Update).update_id[:128]
    except wire.WireError:
        return ""
