# A device's side of secure aggregation (SecAgg+) as a state machine: advertise keys, share its secrets with its
# neighbours, send its masked update, reveal the shares a safe unmask request asks for. Pure: no I/O, no torch.
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import ClassVar

from protocol import wire
from protocol.errors import UsageError
from protocol.messages import (
    KeyAdvert,
    KeyRoster,
    MaskedInput,
    RejectionKind,
    ShareBundle,
    ShareDelivery,
    UnmaskRequest,
    UnmaskResponse,
)
from protocol.secagg import graph, keys, masks, shamir
from protocol.secagg.checks import (
    check_addressed,
    check_pairs,
    check_round,
    check_stage,
    check_unique,
    check_within,
)
from protocol.secagg.errors import SecAggRefusal
from protocol.secagg.fixed_point import FixedPoint, flat, layout_of, shaped
from protocol.tensors import Weights

ADVERTISED, SHARED, DELIVERED, MASKED = "advertised", "shared", "delivered", "masked"
RECORD_BYTES = 2 * shamir.SHARE_BYTES  # a neighbour's sealed record: its seed share, then its mask-key share


@dataclass(frozen=True)
class DeviceSecAggState:
    """Everything a device needs to finish a round after a restart (its secrets included: it lives in the device's
    own state directory). `clip` and `dropout` are the recipe's until a roster that matches them arrives;
    `revealed_*` remember which kind of share of which peer already left the device."""

    KIND: ClassVar[str] = "secagg_device_state"
    device_id: str
    round_id: int
    stage: str
    cipher_secret: bytes
    mask_secret: bytes
    self_seed: bytes
    run_id: str = ""
    threshold: int = 0
    min_survivors: int = 0
    clip: float = 1.0
    dropout: float = 0.3
    max_summands: int = 1
    neighbours: list[str] = field(default_factory=list)
    cipher_keys: list[bytes] = field(default_factory=list)
    mask_keys: list[bytes] = field(default_factory=list)
    held_from: list[str] = field(default_factory=list)
    held_records: list[bytes] = field(default_factory=list)
    revealed_seeds: list[str] = field(default_factory=list)
    revealed_keys: list[str] = field(default_factory=list)

    @property
    def context(self) -> bytes:
        """The round's binding for keys, seals and commitments."""
        return keys.round_context(self.run_id, self.round_id)

    def peer_key(self, peer: str, cipher: bool) -> bytes:
        """A neighbour's advertised public key: the one that seals shares, or the one that agrees masks."""
        index = self.neighbours.index(peer)
        return self.cipher_keys[index] if cipher else self.mask_keys[index]


class SecAggDevice:
    """One device in one secure round. Each stage method checks the coordinator's message, moves the state on and
    returns the device's answer; a refused message raises SecAggRefusal and leaves the state as it was."""

    def __init__(self, state: DeviceSecAggState) -> None:
        self.state = state

    @classmethod
    def start(cls, device_id: str, round_id: int, clip: float, dropout: float) -> SecAggDevice:
        """A device with fresh key pairs and a fresh self-mask seed for this round, expecting a roster with the
        recipe's clip and a neighbour graph sized for its dropout."""
        secrets = (keys.KeyPair.generate().secret, keys.KeyPair.generate().secret, os.urandom(masks.SEED_BYTES))
        return cls(DeviceSecAggState(device_id, round_id, ADVERTISED, *secrets, clip=clip, dropout=dropout))

    @classmethod
    def restored(cls, snapshot: bytes) -> SecAggDevice:
        """The device a snapshot saved."""
        return cls(wire.decode_record(snapshot, DeviceSecAggState))

    def snapshot(self) -> bytes:
        """The state as bytes, for the device's state directory (written atomically by its owner)."""
        return wire.encode_record(self.state)

    def advert(self) -> KeyAdvert:
        """Stage 1: the two public keys (the same ones again after a restart)."""
        state = self.state
        public = keys.KeyPair.from_secret
        return KeyAdvert(
            state.device_id, state.round_id, public(state.cipher_secret).public, public(state.mask_secret).public
        )

    def on_roster(self, roster: KeyRoster) -> ShareBundle:
        """Stage 2: split the self-mask seed and the mask key among the neighbours and seal each one's records."""
        self._check(roster.device_id, roster.round_id, ADVERTISED, "a key roster")
        check_pairs(roster.neighbours, roster.cipher_keys, "the roster's cipher keys")
        check_pairs(roster.neighbours, roster.mask_keys, "the roster's mask keys")
        _check_settings(roster, self.state.device_id)
        _check_recipe(roster, self.state)
        state = dataclasses.replace(
            self.state,
            **{
                name: getattr(roster, name) for name in ("run_id", "threshold", "min_survivors", "clip", "max_summands")
            },
            neighbours=list(roster.neighbours),
            cipher_keys=list(roster.cipher_keys),
            mask_keys=list(roster.mask_keys),
            stage=SHARED,
        )
        bundle = _sealed_shares(state)
        self.state = state
        return bundle

    def on_delivery(self, delivery: ShareDelivery) -> None:
        """Stage 2's answer: open and keep each neighbour's records (a record that does not open refuses them all)."""
        self._check(delivery.device_id, delivery.round_id, SHARED, "a share delivery")
        check_pairs(delivery.senders, delivery.ciphertexts, "the delivery")
        check_within(
            delivery.senders, self.state.neighbours, RejectionKind.WRONG_RECIPIENT, "shares from non-neighbours"
        )
        records = [self._opened(sender, sealed) for sender, sealed in zip(delivery.senders, delivery.ciphertexts)]
        self.state = dataclasses.replace(
            self.state, held_from=list(delivery.senders), held_records=records, stage=DELIVERED
        )

    def masked_input(self, update: Weights) -> MaskedInput:
        """Stage 3: the update in fixed point, plus the self mask, plus a pairwise mask with each neighbour whose
        shares arrived (exactly those who will mask with this device)."""
        state = self.state
        check_stage(state.stage, DELIVERED, "a request to mask the update")
        encoded = FixedPoint(state.clip, state.max_summands).encode(flat(update))
        pairs = [(masks.pairwise_sign(state.device_id, peer), self._mask_seed(peer)) for peer in state.held_from]
        vector = masks.masked(encoded, state.self_seed, pairs)
        self.state = dataclasses.replace(state, stage=MASKED)
        return MaskedInput(state.device_id, state.round_id, shaped(vector, layout_of(update)))

    def on_unmask(self, request: UnmaskRequest) -> UnmaskResponse:
        """Stage 4: the seed shares of surviving neighbours and the mask-key shares of dropped ones, unless the request
        would let the coordinator take both kinds of one peer's secrets (now or with an earlier answer)."""
        self._check(request.device_id, request.round_id, MASKED, "an unmask request")
        _check_request(self.state, request)
        seeds = [self._held_share(peer, 0) for peer in request.survivors]
        key_shares = [self._held_share(peer, 1) for peer in request.dropped]
        state = self.state
        self.state = dataclasses.replace(
            state,
            revealed_seeds=sorted({*state.revealed_seeds, *request.survivors}),
            revealed_keys=sorted({*state.revealed_keys, *request.dropped}),
        )
        return UnmaskResponse(
            state.device_id, state.round_id, list(request.survivors), seeds, list(request.dropped), key_shares
        )

    def _check(self, addressee: str, round_id: int, stage: str, what: str) -> None:
        check_addressed(self.state.device_id, addressee)
        check_round(self.state.round_id, round_id)
        check_stage(self.state.stage, stage, what)

    def _opened(self, sender: str, sealed: bytes) -> bytes:
        """A neighbour's record, opened with the pair's key and checked to hold two shares of one point."""
        state = self.state
        key = keys.agreed_key(state.cipher_secret, state.peer_key(sender, True), keys.SHARE_PURPOSE, state.context)
        record = keys.decrypt(key, sealed, keys.share_context(state.context, sender, state.device_id))
        halves = (record[: shamir.SHARE_BYTES], record[shamir.SHARE_BYTES :])
        if len(record) != RECORD_BYTES or len({shamir.Share.from_bytes(half).x for half in halves}) != 1:
            raise SecAggRefusal(RejectionKind.FORGED_SHARE, f"the record from {wire.shown(sender)} is not two shares")
        return record

    def _mask_seed(self, peer: str) -> bytes:
        state = self.state
        return keys.agreed_key(state.mask_secret, state.peer_key(peer, False), keys.MASK_PURPOSE, state.context)

    def _held_share(self, peer: str, which: int) -> bytes:
        record = self.state.held_records[self.state.held_from.index(peer)]
        return record[which * shamir.SHARE_BYTES : (which + 1) * shamir.SHARE_BYTES]


def _check_settings(roster: KeyRoster, own_id: str) -> None:
    """Settings an honest device takes part under: a strict-majority threshold of its neighbours (so its refusal
    rule protects it), at least two survivors, and a fixed-point range that fits."""
    count = len(roster.neighbours)
    if own_id in roster.neighbours or not count // 2 < roster.threshold <= count:
        raise SecAggRefusal(
            RejectionKind.UNSAFE_REQUEST, f"threshold {roster.threshold} is no strict majority of {count} neighbours"
        )
    if roster.min_survivors < 2 or roster.max_summands < roster.min_survivors:
        raise SecAggRefusal(RejectionKind.UNSAFE_REQUEST, f"minimum survivors {roster.min_survivors} is below 2")
    try:
        FixedPoint(roster.clip, roster.max_summands)
    except UsageError as error:
        raise SecAggRefusal(RejectionKind.OUT_OF_RANGE, str(error)) from None


def _check_recipe(roster: KeyRoster, state: DeviceSecAggState) -> None:
    """A roster that keeps the recipe: its clip, and as many neighbours as the recipe's dropout gives for the devices
    the roster says advertised (at most those selected); fewer would need fewer colluders to rebuild a secret."""
    if roster.clip != state.clip:
        raise SecAggRefusal(
            RejectionKind.UNSAFE_REQUEST, f"roster clip {roster.clip:g} is not the recipe's {state.clip:g}"
        )
    count, advertised = len(roster.neighbours), roster.advertised
    if not count < advertised <= roster.max_summands or count != graph.degree_for(advertised, state.dropout):
        raise SecAggRefusal(
            RejectionKind.UNSAFE_REQUEST,
            f"{count} neighbours among {wire.shown(advertised)} devices is not what dropout {state.dropout:g} gives",
        )


def _sealed_shares(state: DeviceSecAggState) -> ShareBundle:
    """Shares of the seed and the mask key (x = the neighbour's place in the sorted list, 1-based), sealed per
    neighbour, and the seed's commitment."""
    count = len(state.neighbours)
    seed_shares = shamir.split(state.self_seed, state.threshold, count)
    key_shares = shamir.split(state.mask_secret, state.threshold, count)
    sealed = []
    for peer, seed_share, key_share in zip(state.neighbours, seed_shares, key_shares):
        key = keys.agreed_key(state.cipher_secret, state.peer_key(peer, True), keys.SHARE_PURPOSE, state.context)
        associated = keys.share_context(state.context, state.device_id, peer)
        sealed.append(keys.encrypt(key, seed_share.to_bytes() + key_share.to_bytes(), associated))
    commitment = masks.seed_commitment(state.context, state.device_id, state.self_seed)
    return ShareBundle(state.device_id, state.round_id, list(state.neighbours), sealed, commitment)


def _check_request(state: DeviceSecAggState, request: UnmaskRequest) -> None:
    """The refusals that keep a device's neighbours' updates hidden: one peer asked as both survivor and dropped
    (in this request or across requests), the device itself called dropped, too few survivors, unheld shares."""
    both = sorted(
        ({*request.survivors} & {*request.dropped})
        | ({*request.survivors} & {*state.revealed_keys})
        | ({*request.dropped} & {*state.revealed_seeds})
    )
    if both:
        raise SecAggRefusal(
            RejectionKind.UNSAFE_REQUEST, f"asks both shares of {wire.shown_names(both)}; an honest device gives one"
        )
    if state.device_id in request.dropped or request.survivor_count < state.min_survivors:
        raise SecAggRefusal(
            RejectionKind.UNSAFE_REQUEST,
            f"{request.survivor_count} survivors (at least {state.min_survivors}), this device among the dropped: "
            f"{state.device_id in request.dropped}",
        )
    asked = [*request.survivors, *request.dropped]
    check_unique(asked, "the unmask request")
    check_within(asked, state.held_from, RejectionKind.UNSAFE_REQUEST, "asks for shares this device does not hold:")
