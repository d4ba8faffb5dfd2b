# Who sent an update: a provisioned device's HMAC over the signed bytes, bound to device, round and a never-reused nonce.
from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from coordinator.intake.validation import Rejection
from protocol import messages, wire
from protocol.messages import RejectionKind


class NonceLedger(Protocol):
    """Where the nonces already seen are kept (the run's store, so that they outlive a restart)."""

    def first_round_of_nonce(self, device_id: str, nonce: bytes, round_id: int) -> int:
        """The round a device's nonce was first seen in, recording round_id if the nonce is new."""


class MemoryNonces:
    """A nonce ledger in memory, for a process that keeps no run store (tests, one-off checks)."""

    def __init__(self) -> None:
        self._rounds: dict[tuple[str, bytes], int] = {}

    def first_round_of_nonce(self, device_id: str, nonce: bytes, round_id: int) -> int:
        """The round a device's nonce was first seen in, recording round_id if the nonce is new."""
        return self._rounds.setdefault((device_id, nonce), round_id)


class UpdateAuthenticator:
    """Accepts only updates signed with their device's provisioned key, each nonce in one round only."""

    def __init__(self, device_keys: Mapping[str, bytes], nonces: NonceLedger | None = None) -> None:
        self.device_keys = dict(device_keys)
        self.nonces = nonces if nonces is not None else MemoryNonces()

    def check(self, update: messages.Update, signed: bytes, current_round: int) -> None:
        """Raises Rejection for an unknown device, a missing or wrong signature (over `signed`, the bytes the update's
        signed envelope holds), or a nonce first seen while an earlier round was open (a replay, whatever round it
        claims).

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
        if not wire.signature_valid(signed, update.signature, key):
            raise Rejection(
                RejectionKind.BAD_SIGNATURE, f"bad signature: the HMAC does not match {update.device_id!r}'s key"
            )
        first_round = self.nonces.first_round_of_nonce(update.device_id, update.nonce, current_round)
        if first_round != current_round:
            raise Rejection(
                RejectionKind.REPLAY, f"replay: nonce {update.nonce.hex()[:16]} was already used in round {first_round}"
            )
