# Secure aggregation's delivery check on the coordinator: who holds whose record, complaints about records that did
# not open settled by the accused sender's ephemeral key (the forger or the false accuser excluded), the maskers.
from __future__ import annotations

import hmac
from functools import cached_property

from coordinator.secure.secagg_round import CHECK, MASKED, RESOLVE, SecAggRound
from protocol import wire
from protocol.messages import DeliveryAck, MaskRequest, RecordKeyRequest, RecordKeyReveal, RejectionKind
from protocol.secagg import keys, shamir
from protocol.secagg.checks import check_pairs, check_stage, check_unique, check_within
from protocol.secagg.errors import SecAggRefusal


class ComplaintStage(SecAggRound):
    """Between the share delivery and the masked inputs: each device's acknowledgement (the records it holds, its
    complaints), the complaints settled, and the mask requests to the devices still in the round."""

    def on_ack(self, ack: DeliveryAck) -> None:
        """A device's acknowledgement of its delivery. Each complaint's pair key must check the record's MAC (else
        the accuser lied about the key: it is excluded at once)."""
        state = self.state
        device = ack.device_id
        self._check(device, ack.round_id, CHECK, "a delivery acknowledgement", state.sharers)
        self._once(device, state.ackers, "a delivery acknowledgement")
        check_pairs(ack.accused, ack.pair_keys, "the complaints")
        delivered = self._delivered_to(device)
        check_within(
            [*ack.held, *ack.accused], list(delivered), RejectionKind.WRONG_RECIPIENT, "records never delivered:"
        )
        check_unique([*ack.held, *ack.accused], "the acknowledgement")
        state.ackers.append(device)
        self.__dict__.pop("held_by", None)
        state.held_owners += ack.held
        state.held_holders += [device] * len(ack.held)
        for accused, pair_key in zip(ack.accused, ack.pair_keys):
            sealed = delivered[accused]
            if not keys.record_authentic(pair_key, sealed, keys.share_context(self.context, accused, device)):
                self._exclude(device, f"its complaint about {wire.shown(accused)} has a key that does not check")
                continue
            state.accusers.append(device)
            state.accused.append(accused)
            state.pair_keys.append(pair_key)

    def key_requests(self) -> list[RecordKeyRequest]:
        """Closes the delivery check: asks each accused sender for its records' ephemeral keys (none asked when
        nobody complained: the settling stage then closes at once)."""
        state = self.state
        check_stage(state.stage, CHECK, "the close of the delivery check")
        state.stage = RESOLVE
        requests = []
        for accused in sorted(set(state.accused)):
            pairs = [(a, k) for a, d, k in zip(state.accusers, state.accused, state.pair_keys) if d == accused]
            requests.append(RecordKeyRequest(accused, state.round_id, [a for a, _ in pairs], [k for _, k in pairs]))
        return requests

    def on_key_reveal(self, reveal: RecordKeyReveal) -> None:
        """The accused sender's ephemeral secrets: each must be its record's, then the record opens as one share (the
        accuser lied: excluded) or does not (the sender forged it: excluded)."""
        state = self.state
        device = reveal.device_id
        self._check(device, reveal.round_id, RESOLVE, "a record key reveal", sorted(set(state.accused)))
        self._once(device, state.revealers, "a record key reveal")
        check_pairs(reveal.accusers, reveal.ephemeral_secrets, "the revealed keys")
        asked = [a for a, d in zip(state.accusers, state.accused) if d == device]
        if sorted(reveal.accusers) != sorted(asked):
            raise SecAggRefusal(RejectionKind.WRONG_RECIPIENT, "revealed keys for other records than complained of")
        state.revealers.append(device)
        for accuser, secret in zip(reveal.accusers, reveal.ephemeral_secrets):
            if self._opens(device, accuser, secret):
                self._exclude(accuser, f"accused {wire.shown(device)} of a record that opens as a share")
            else:
                self._exclude(device, f"sent {wire.shown(accuser)} a record that does not open as a share")

    def mask_requests(self) -> list[MaskRequest]:
        """Closes the complaints: an accused sender that did not answer is excluded, then every device that acked
        and is not excluded masks, less any whose seed fewer than t of them hold (it could not be rebuilt); each is
        told its partners."""
        state = self.state
        check_stage(state.stage, RESOLVE, "the close of the complaints")
        for accused in sorted(set(state.accused) - set(state.revealers)):
            self._exclude(accused, "did not reveal the key of a record complained of")
        state.maskers = [d for d in state.ackers if d not in state.excluded]
        short = [d for d in state.maskers if len(self.holders(d, set(state.maskers))) < self.threshold]
        while short:
            state.maskers = [d for d in state.maskers if d not in short]
            short = [d for d in state.maskers if len(self.holders(d, set(state.maskers))) < self.threshold]
        self._enough(state.maskers, "are left to mask")
        state.stage = MASKED
        state.share_senders, state.share_recipients, state.share_ciphertexts = [], [], []
        self.__dict__.pop("inboxes", None)
        return [MaskRequest(d, state.round_id, self.partners(d)) for d in state.maskers]

    @cached_property
    def inboxes(self) -> dict[str, dict[str, bytes]]:
        """The records in transit by recipient, then sender (fixed once the share stage closes)."""
        state = self.state
        inboxes: dict[str, dict[str, bytes]] = {}
        for sender, recipient, sealed in zip(state.share_senders, state.share_recipients, state.share_ciphertexts):
            inboxes.setdefault(recipient, {})[sender] = sealed
        return inboxes

    def _delivered_to(self, device: str) -> dict[str, bytes]:
        """The records delivered to a device, by sender."""
        return self.inboxes.get(device, {})

    def _opens(self, sender: str, recipient: str, secret: bytes) -> bool:
        """Whether the sender's revealed ephemeral secret is its record's to the recipient and opens it as a share."""
        sealed = self._delivered_to(recipient)[sender]
        if len(secret) != keys.KEY_BYTES:
            return False
        if not hmac.compare_digest(keys.KeyPair.from_secret(secret).public, sealed[: keys.KEY_BYTES]):
            return False
        recipient_key = self.state.cipher_keys[self.state.advertised.index(recipient)]
        associated = keys.share_context(self.context, sender, recipient)
        try:
            shamir.Share.from_bytes(keys.open_record(secret, recipient_key, sealed, associated, self.context))
        except SecAggRefusal:
            return False
        return True
