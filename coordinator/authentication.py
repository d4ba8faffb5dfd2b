# Who sent an update: a provisioned device's HMAC over the payload, bound to device, round and a never-reused nonce.
from __future__ import annotations

from collections.abc import Mapping

from coordinator.validation import Rejection
from edge_agent import wire
from edge_agent.wire import RejectionKind


class UpdateAuthenticator:
    """Accepts only updates signed with their device's provisioned key, each nonce in one round only."""

    def __init__(self, device_keys: Mapping[str, bytes]) -> None:
        self.device_keys = dict(device_keys)
        self._nonce_rounds: dict[tuple[str, bytes], int] = {}

    def check(self, update: wire.Update, current_round: int) -> None:
        """Raises Rejection for an unknown device, a missing or wrong signature, or a nonce first seen while an
        earlier round was open (a replay, whatever round it claims).

        The same signed update arriving again in the round it was sent for (a QoS 1 redelivery) passes; the round
        collector applies it once.
        """
        key = self.device_keys.get(update.device_id)
        if key is None:
            raise Rejection(
                RejectionKind.UNKNOWN_DEVICE, f"unknown device: {update.device_id!r} has no provisioned key"
            )
        if not update.nonce or not update.signature:
            raise Rejection(
                RejectionKind.BAD_SIGNATURE, "bad signature: the update is not signed (no nonce or no signature)"
            )
        if not wire.signature_valid(update, key):
            raise Rejection(
                RejectionKind.BAD_SIGNATURE, f"bad signature: the HMAC does not match {update.device_id!r}'s key"
            )
        first_round = self._nonce_rounds.setdefault((update.device_id, update.nonce), current_round)
        if first_round != current_round:
            raise Rejection(
                RejectionKind.REPLAY, f"replay: nonce {update.nonce.hex()[:16]} was already used in round {first_round}"
            )
