# The agent's door to secure rounds: which announcements ask for one, and the participant made only when first
# needed, so a device without the `cryptography` package runs plain rounds and refuses secure ones.
from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from edge_agent.data.journal import Journal
from edge_agent.loop.artefacts import RoundArtefacts
from protocol import messages
from protocol.credentials import DeviceIdentity
from protocol.mqtt import IncomingMessage, MqttSession

if TYPE_CHECKING:
    from edge_agent.loop.secagg_participant import SecAggParticipant

log = logging.getLogger(__name__)


def takes_part(announcement: messages.RoundAnnouncement, device_id: str) -> bool:
    """Whether a device is in a secure round: the recipe asks for one and the device was chosen (or all were)."""
    chosen = not announcement.participants or device_id in announcement.participants
    return announcement.recipe.secure_aggregation != "off" and chosen


class SecureRounds:
    """What the agent does differently in a secure round: advertise keys on its announcement, answer the stage
    messages, and hand the trained update to the participant to be masked (its plain form never leaves). `identity`
    is the device's identity key and its fleet's roster (from its credential file; empty on an open fleet)."""

    def __init__(
        self,
        fleet: str,
        device_id: str,
        session: MqttSession,
        state_dir: Path,
        journal: Journal,
        identity: DeviceIdentity | None = None,
    ) -> None:
        self.fleet, self.device_id, self.session = fleet, device_id, session
        self.state_dir, self.journal = state_dir, journal
        self.identity = identity or DeviceIdentity()
        self._participant: SecAggParticipant | None = None
        self.unable = False

    def participant(self) -> SecAggParticipant | None:
        """The participant, made when first needed; None (logged once) where `cryptography` is missing."""
        if self._participant is None and not self.unable:
            try:
                from edge_agent.loop.secagg_participant import SecAggParticipant
            except ImportError as error:
                log.error("this device refuses secure aggregation: %s", str(error)[:200])
                self.unable = True
                return None
            self._participant = SecAggParticipant(
                self.fleet, self.device_id, self.session, self.state_dir, self.journal, self.identity
            )
        return self._participant

    def on_announcement(self, announcement: messages.RoundAnnouncement) -> None:
        """Begins a secure round this device takes part in (stage 1: its keys)."""
        participant = self.participant() if takes_part(announcement, self.device_id) else None
        if participant is not None:
            participant.begin(announcement)

    def on_message(self, message: IncomingMessage) -> bool:
        """A stage message from the coordinator (ignored by a device that cannot take part)."""
        participant = self.participant()
        return participant.on_message(message) if participant is not None else False

    def took(
        self, announcement: messages.RoundAnnouncement, update: messages.Update, artefacts: RoundArtefacts
    ) -> bool:
        """Whether the round's update is the secure round's: then it is masked when its shares are in (or, on a
        device that cannot take part, dropped); False for a plain round, whose update the outbox sends."""
        if announcement.recipe.secure_aggregation == "off":
            return False
        participant = self.participant() if takes_part(announcement, self.device_id) else None
        if participant is not None:
            model_hash = announcement.model_hash
            base, spec = artefacts.models[model_hash], artefacts.specs[model_hash]
            participant.send_update(update, base, spec, announcement.recipe)
        return True
