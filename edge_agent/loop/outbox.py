# The durable outbox: an update is on disk before it is published and stays there until the coordinator answers it.
from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass
from pathlib import Path

from edge_agent.loop.agent_settings import AgentSettings
from protocol import messages, topics, wire
from protocol.files import atomic_write_bytes
from protocol.messages import RejectionKind
from protocol.mqtt import MqttSession
from protocol.resend import ResendSchedule, doubled_wait

log = logging.getLogger(__name__)

OUTBOX_FOLDER = "outbox"
ENTRY_NAME = re.compile(r"round_(\d{6})_([A-Za-z0-9_.-]{1,64})\.msgpack")
RESEND_SECONDS = 60.0
MAX_RESEND_SECONDS = 3600.0
PUBLISH_WAIT_SECONDS = 30.0
UNSETTLED_KINDS = frozenset({RejectionKind.NO_ROUND.value})


@dataclass(frozen=True)
class OutboxEntry:
    """One update waiting for the coordinator's answer: its round, its id and the file with the exact bytes sent."""

    round_id: int
    update_id: str
    path: Path

    def payload(self) -> bytes:
        """The update's bytes as first published."""
        return self.path.read_bytes()


class Outbox:
    """outbox/round_NNNNNN_<update id>.msgpack: every update published and not yet answered, written atomically."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def path(self, round_id: int, update_id: str) -> Path:
        """Where an update waits (the update id must be a wire identifier, as the agent's uuid hex is)."""
        return self.folder / f"round_{round_id:06d}_{wire.check_identifier('update id', update_id)}.msgpack"

    def put(self, round_id: int, update_id: str, payload: bytes) -> OutboxEntry:
        """Persists the update's bytes (durable before the first publish)."""
        path = self.path(round_id, update_id)
        atomic_write_bytes(path, payload)
        return OutboxEntry(round_id, update_id, path)

    def pending(self) -> list[OutboxEntry]:
        """Every unanswered update, oldest round first (names only: the bytes are read when sent)."""
        if not self.folder.is_dir():
            return []
        matches = ((ENTRY_NAME.fullmatch(path.name), path) for path in sorted(self.folder.iterdir()))
        return [OutboxEntry(int(match.group(1)), match.group(2), path) for match, path in matches if match]

    def settle(self, update_id: str) -> bool:
        """Drops an answered update; False when the outbox held no such update."""
        if not self.folder.is_dir() or not wire.IDENTIFIER.fullmatch(update_id):
            return False
        removed = False
        for path in self.folder.glob(f"round_*_{update_id}.msgpack"):
            path.unlink(missing_ok=True)
            removed = True
        return removed

    def last_round(self) -> int:
        """The newest round with an update in the outbox (0 if none): that round's work is done."""
        return max((entry.round_id for entry in self.pending()), default=0)


def next_resend_wait(previous: float | None) -> float:
    """Seconds until an unanswered update goes out again: RESEND_SECONDS after the first send, then twice the
    previous wait, at most MAX_RESEND_SECONDS."""
    return doubled_wait(previous, RESEND_SECONDS, MAX_RESEND_SECONDS)


class UpdateSender:
    """Delivers updates at least once: each is signed, persisted, then published; re-sent after a restart and, while
    unanswered, after RESEND_SECONDS, then twice as long each time up to MAX_RESEND_SECONDS (a coordinator away for
    hours finds a few copies queued, not one a minute), until an ack for its id settles it (the coordinator applies
    an identical redelivery once)."""

    def __init__(self, settings: AgentSettings, session: MqttSession, folder: Path) -> None:
        self.settings = settings
        self.session = session
        self.outbox = Outbox(folder)
        self.resends: ResendSchedule[str] = ResendSchedule(RESEND_SECONDS, MAX_RESEND_SECONDS)

    @property
    def topic(self) -> str:
        """The device's update topic."""
        return topics.UPDATE.build(fleet=self.settings.fleet, device=self.settings.device_id)

    def send(self, update: messages.Update, compression: str = "none") -> None:
        """Encodes the update (deflated if the recipe says so) and signs those bytes (with a provisioned key), refuses
        it if too large (PayloadTooLargeError, before anything is kept), persists it, then publishes it at QoS 1."""
        payload = wire.encode(update)
        payload = wire.deflated(payload) if compression == wire.DEFLATE else payload
        payload = wire.signed(payload, self.settings.signing_key) if self.settings.signing_key else payload
        self.session.check_size(self.topic, payload)
        entry = self.outbox.put(update.round_id, update.update_id, payload)
        self.publish(entry, payload, wait=PUBLISH_WAIT_SECONDS)

    def publish(self, entry: OutboxEntry, payload: bytes, wait: float | None = None) -> None:
        """Publishes one outbox entry's bytes and schedules its next resend (the wait doubling each time)."""
        self.resends.sent(entry.update_id)
        fields = (self.settings.device_id, entry.round_id, entry.update_id)
        if self.session.publish(self.topic, payload, wait=wait):
            log.info("update published device=%s round=%d update=%s bytes=%d", *fields, len(payload))
        else:
            log.warning("update queued until the broker is back device=%s round=%d update=%s", *fields)

    def resend_due(self) -> None:
        """Publishes again every unanswered update whose resend time has come (all of them after a start)."""
        now = time.monotonic()
        for entry in self.outbox.pending():
            if self.resends.due(entry.update_id, now):
                log.info("update re-sent from the outbox round=%d update=%s", entry.round_id, entry.update_id)
                self.publish(entry, entry.payload())

    def on_ack(self, ack: messages.Ack) -> None:
        """Logs the coordinator's verdict and settles the update, unless the verdict was 'no round open yet'."""
        if ack.accepted:
            log.info("update accepted round=%d update=%s", ack.round_id, ack.update_id)
        else:
            rejected = (ack.round_id, ack.update_id[:64], ack.rejection[:32], ack.reason[:300])
            log.warning("update rejected round=%d update=%s kind=%s reason=%s", *rejected)
            if ack.rejection in UNSETTLED_KINDS:
                return
        if self.outbox.settle(ack.update_id):
            self.resends.settle(ack.update_id)
