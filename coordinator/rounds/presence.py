# Who is there: device presence from retained status messages and last wills, and how many updates close a round.
from __future__ import annotations

import logging
from collections.abc import Callable, Collection

from coordinator.intake.observer import PEAK_RSS, RoundObserver
from protocol import messages, wire

log = logging.getLogger(__name__)


class Presence:
    """The fleet as the broker shows it: each device's last status, and the devices known to be gone for good."""

    def __init__(self, observer: RoundObserver, dead_devices: Callable[[], set[str]] = set) -> None:
        self.observer = observer
        self.dead_devices = dead_devices
        self.statuses: dict[str, messages.Status] = {}

    def on_status(self, device_id: str, payload: bytes) -> None:
        """Tracks presence from a retained status message or last will (an empty payload clears it)."""
        if not payload:
            self.statuses.pop(device_id, None)
            self.observer.device_status(device_id, None)
            return
        try:
            status = wire.decode(payload, messages.Status)
        except wire.WireError as error:
            log.warning("bad status device=%s error=%s", device_id, error)
            return
        previous = self.statuses.get(device_id)
        if previous is None or previous.state != status.state:
            log.info("device status device=%s state=%s", device_id, status.state)
        self.statuses[device_id] = status
        self.observer.device_status(device_id, status)

    def online(self) -> set[str]:
        """Devices whose last status is anything but 'offline'."""
        return {device for device, status in self.statuses.items() if status.state != "offline"}

    def stragglers(self, accepted: Collection[str]) -> list[str]:
        """Online devices with no accepted update in this round."""
        return sorted(self.online() - set(accepted))

    def missing(self, accepted: Collection[str]) -> list[str]:
        """Devices known offline (last will, or dead) that sent nothing this round."""
        offline = {device for device, status in self.statuses.items() if status.state == "offline"}
        return sorted((offline | self.dead_devices()) - set(accepted))

    def round_metrics(self, quorum: int, accepted: Collection[str]) -> dict:
        """A round's quorum, who was missing (online devices that sent nothing, devices known offline) and each
        device's peak RSS as its last status reported it (devices that report one)."""
        return {
            "quorum": quorum,
            "stragglers": self.stragglers(accepted),
            "offline": self.missing(accepted),
            PEAK_RSS: {
                device: status.peak_rss_mb for device, status in sorted(self.statuses.items()) if status.peak_rss_mb
            },
        }

    def needed(self, quorum: int | None, min_devices: int, participants: list[str], accepted: Collection[str]) -> int:
        """How many accepted updates close the round early: the quorum less the devices known dead (a bench's
        crashed agents), else every online device; never fewer than the minimum. With a participant list, never
        more than its length (only participants may send)."""
        if participants:
            return min(quorum or len(participants), len(participants))
        if quorum is not None:
            lost = len(self.dead_devices() - set(accepted))
            return max(min_devices, quorum - lost)
        return max(min_devices, len(self.online() | set(accepted)))
