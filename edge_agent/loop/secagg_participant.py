# A device's secure rounds over MQTT: the coordinator's stage messages in, the device's answers out, its state saved
# atomically in the state directory after every step, and its masked update sent in place of the plain one.
from __future__ import annotations

import logging
from pathlib import Path

from edge_agent.data.journal import Journal
from edge_agent.loop.secagg_device import PARTNERED, SecAggDevice
from protocol import messages, topics, wire
from protocol.credentials import DeviceIdentity
from protocol.files import atomic_write_bytes, load_arrays, save_arrays
from protocol.messages import (
    DeliveryAck,
    KeyRoster,
    MaskRequest,
    RecordKeyRequest,
    RecordKeyReveal,
    ShareBundle,
    ShareDelivery,
    SurvivorView,
    UnmaskRequest,
    UnmaskResponse,
    ViewConfirmation,
)
from protocol.model_spec import ModelSpec
from protocol.mqtt import IncomingMessage, MqttSession
from protocol.secagg.errors import SecAggRefusal
from protocol.secagg.fixed_point import FixedPoint
from protocol.secagg.weighting import LABELS, device_weight, in_fixed_units, weighted_delta
from protocol.tensors import Weights
from protocol.trained_set import update_base

log = logging.getLogger(__name__)

STATE_FILE = "secagg_round.rec"  # the device's secure-round state (its secrets included)
PENDING_FILE = "secagg_pending.npz"  # the weighted delta waiting for the share delivery before it is masked
INBOUND = (KeyRoster, ShareDelivery, RecordKeyRequest, MaskRequest, SurvivorView, UnmaskRequest)
Inbound = KeyRoster | ShareDelivery | RecordKeyRequest | MaskRequest | SurvivorView | UnmaskRequest
Answer = ShareBundle | DeliveryAck | RecordKeyReveal | ViewConfirmation | UnmaskResponse
ADVERTISED_KEY = "secagg_advertised_round"  # the journal's note of the last round whose keys this device sent
REPORTED_KEY = "secagg_reported_labels"  # the journal's count of the labels this device's masked inputs carried


class SecAggParticipant:
    """One device's part in the secure rounds of its fleet: `begin` a round (keys advertised, signed by its identity
    key on a provisioned fleet), `on_message` for each stage message, `send_update` for the round's trained update
    (masked once the shares have arrived)."""

    def __init__(
        self,
        fleet: str,
        device_id: str,
        session: MqttSession,
        state_dir: Path,
        journal: Journal,
        identity: DeviceIdentity | None = None,
    ) -> None:
        self.device_id = device_id
        self.session = session
        self.journal = journal
        self.identity = identity or DeviceIdentity()
        self.path, self.pending_path = state_dir / STATE_FILE, state_dir / PENDING_FILE
        self.topic = topics.SECAGG_UP.build(fleet=fleet, device=device_id)
        self.device = SecAggDevice.restored(self.path.read_bytes(), self.identity) if self.path.exists() else None

    def begin(self, announcement: messages.RoundAnnouncement) -> None:
        """Stage 1: fresh keys for a new round (the saved ones for the round a restart interrupted), advertised once
        per round (the journal says which round's keys went out: a retained announcement seen again sends nothing)."""
        round_id, recipe = announcement.round_id, announcement.recipe
        if self.device is None or self.device.state.round_id != round_id:
            self.device = SecAggDevice.start(
                self.device_id,
                round_id,
                recipe.secagg_clip,
                recipe.secagg_dropout,
                run_id=announcement.run_id,
                identity=self.identity,
            )
            self.pending_path.unlink(missing_ok=True)
            self.save()
        if self.journal.get(ADVERTISED_KEY) == round_id:
            log.debug("secure-round keys already advertised round=%d", round_id)
            return
        self.publish(self.device.advert())
        self.journal.set(ADVERTISED_KEY, round_id)

    def on_message(self, message: IncomingMessage) -> bool:
        """A stage message from the coordinator: answered, or refused with a log line (the state unchanged)."""
        incoming = wire.decode_any(message.payload, INBOUND)
        device = self.device
        if device is None:
            log.warning("secure-round message with no round begun kind=%s", incoming.KIND)
            return False
        try:
            answer = self.answer(device, incoming)
        except SecAggRefusal as refusal:
            log.warning("secure-round message refused kind=%s reason=%s", refusal.kind, refusal.reason)
            return False
        self.save()
        if answer is not None:
            self.publish(answer)
        self.mask_pending()
        return False

    def answer(self, device: SecAggDevice, incoming: Inbound) -> Answer | None:
        """The device's answer to one stage message (None for a mask request, which it keeps)."""
        if isinstance(incoming, KeyRoster):
            return device.on_roster(incoming)
        if isinstance(incoming, ShareDelivery):
            return device.on_delivery(incoming)
        if isinstance(incoming, RecordKeyRequest):
            return device.on_key_request(incoming)
        if isinstance(incoming, MaskRequest):
            device.on_mask_request(incoming)
            return None
        if isinstance(incoming, SurvivorView):
            return device.on_view(incoming)
        return device.on_unmask(incoming)

    def send_update(self, update: messages.Update, base: Weights, spec: ModelSpec, recipe: messages.Recipe) -> None:
        """The round's update as its weighted delta of the trainable tensors (or statistics) and the labels acquired since the last
        masked input, kept (atomically) until it is masked; masked at once if its partners are already known. The
        plain update never leaves the device."""
        base = update_base(spec, base, recipe.local_rule)
        weight = device_weight(update.num_samples, recipe.secagg_sample_cap)
        labels = update.acquired_labels - int(self.journal.get(REPORTED_KEY, 0))
        pending = weighted_delta(update.tensors, base, list(base), weight, recipe.secagg_clip, labels)
        save_arrays(self.pending_path, pending)
        self.mask_pending()

    def mask_pending(self) -> None:
        """Masks and sends the kept delta once the device knows its mask partners; its labels are journalled as
        reported (a round abandoned later does not count them)."""
        device = self.device
        if device is None or device.state.stage != PARTNERED or not self.pending_path.exists():
            return
        pending = load_arrays(self.pending_path)
        fixed = FixedPoint(device.state.clip, device.state.max_summands)
        masked = device.masked_input(in_fixed_units(pending, fixed))
        self.save()
        reported = int(self.journal.get(REPORTED_KEY, 0)) + int(pending[LABELS][0])
        self.journal.set(REPORTED_KEY, reported)
        self.pending_path.unlink()
        self.publish(masked)

    def save(self) -> None:
        """The state, written atomically (a restart answers the round's next stage from it)."""
        if self.device is not None:
            atomic_write_bytes(self.path, self.device.snapshot())

    def publish(self, message: messages.SecAggMessage) -> None:
        """One stage message to the coordinator (QoS 1, chunked if large)."""
        self.session.publish(self.topic, wire.encode(message))
