# A device's side of secure aggregation (SecAgg+) as a state machine: advertise keys, share its secrets with its
# neighbours, send its masked update, confirm one view of who survived, reveal by it. Pure: no I/O, no torch.
from __future__ import annotations

import dataclasses
import hmac
import os
from dataclasses import dataclass, field
from typing import ClassVar

from protocol import wire
from protocol.credentials import DeviceIdentity
from protocol.errors import UsageError
from protocol.messages import (
    DeliveryAck,
    KeyAdvert,
    KeyRoster,
    MaskedInput,
    MaskRequest,
    RecordKeyRequest,
    RecordKeyReveal,
    RejectionKind,
    ShareBundle,
    ShareDelivery,
    SurvivorView,
    UnmaskRequest,
    UnmaskResponse,
    ViewConfirmation,
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
from protocol.secagg.identity import confirmation_body, sign, sign_advert, signed, unsigned
from protocol.tensors import Weights

ADVERTISED, SHARED, DELIVERED, PARTNERED = "advertised", "shared", "delivered", "partnered"
MASKED, VIEWED = "masked", "viewed"


@dataclass(frozen=True)
class DeviceSecAggState:
    """Everything a device needs to finish a round after a restart (its secrets included: it lives in the device's
    own state directory). `clip` and `dropout` are the recipe's until a roster that matches them arrives; `accused`
    are the neighbours whose records did not open, `partners` those it masks with, `view` the one set of surviving
    partners it confirmed (it reveals by it and takes no other)."""

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
    accused: list[str] = field(default_factory=list)
    partners: list[str] = field(default_factory=list)
    view: list[str] = field(default_factory=list)
    survivor_count: int = 0

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
    returns the device's answer; a refused message raises SecAggRefusal and leaves the state as it was. With an
    identity (a provisioned fleet's) it signs its advert and takes only neighbours whose adverts the fleet's roster
    of identity keys checks; without one (an open fleet) neither."""

    def __init__(self, state: DeviceSecAggState, identity: DeviceIdentity | None = None) -> None:
        self.state = state
        self.identity = identity or DeviceIdentity()

    @classmethod
    def start(
        cls,
        device_id: str,
        round_id: int,
        clip: float,
        dropout: float,
        run_id: str = "",
        identity: DeviceIdentity | None = None,
    ) -> SecAggDevice:
        """A device with fresh key pairs and a fresh self-mask seed for round `round_id` of run `run_id`, expecting a
        roster of that run with the recipe's clip and a neighbour graph sized for its dropout."""
        secrets = (keys.KeyPair.generate().secret, keys.KeyPair.generate().secret, os.urandom(masks.SEED_BYTES))
        state = DeviceSecAggState(device_id, round_id, ADVERTISED, *secrets, run_id=run_id, clip=clip, dropout=dropout)
        return cls(state, identity)

    @classmethod
    def restored(cls, snapshot: bytes, identity: DeviceIdentity | None = None) -> SecAggDevice:
        """The device a snapshot saved."""
        return cls(wire.decode_record(snapshot, DeviceSecAggState), identity)

    def snapshot(self) -> bytes:
        """The state as bytes, for the device's state directory (written atomically by its owner)."""
        return wire.encode_record(self.state)

    def advert(self) -> KeyAdvert:
        """Stage 1: the two public keys (the same ones again after a restart), signed by the identity key if the
        device has one."""
        state = self.state
        cipher, mask = (
            keys.KeyPair.from_secret(state.cipher_secret).public,
            keys.KeyPair.from_secret(state.mask_secret).public,
        )
        secret = self.identity.secret
        signature = sign_advert(secret, state.context, state.device_id, cipher, mask) if secret else b""
        return KeyAdvert(state.device_id, state.round_id, cipher, mask, signature)

    def on_roster(self, roster: KeyRoster) -> ShareBundle:
        """Stage 2: split the self-mask seed among the neighbours and seal each one's share."""
        self._check(roster.device_id, roster.round_id, ADVERTISED, "a key roster")
        check_pairs(roster.neighbours, roster.cipher_keys, "the roster's cipher keys")
        check_pairs(roster.neighbours, roster.mask_keys, "the roster's mask keys")
        if self.state.run_id and roster.run_id != self.state.run_id:
            raise SecAggRefusal(RejectionKind.UNSAFE_REQUEST, f"a roster of run {wire.shown(roster.run_id)}")
        self._check_signed(roster)
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

    def on_delivery(self, delivery: ShareDelivery) -> DeliveryAck:
        """Stage 2's answer: keeps each neighbour's record that carries the pair's MAC and opens as one share, accuses
        each sender whose authentic record does not (with the pair's record key as proof), and passes over a record
        without the MAC (altered on the way: nobody can be blamed). Fewer than `threshold` records kept: the device's
        secret would rest on fewer holders than the round promised, so it refuses and will send no masked input."""
        state = self.state
        self._check(delivery.device_id, delivery.round_id, SHARED, "a share delivery")
        check_pairs(delivery.senders, delivery.ciphertexts, "the delivery")
        check_within(delivery.senders, state.neighbours, RejectionKind.WRONG_RECIPIENT, "shares from non-neighbours")
        held: dict[str, bytes] = {}
        accused: dict[str, bytes] = {}
        for sender, sealed in zip(delivery.senders, delivery.ciphertexts):
            pair_key = self._pair_key(sender, keys.RECORD_PURPOSE)
            associated = keys.share_context(state.context, sender, state.device_id)
            if not keys.record_authentic(pair_key, sealed, associated):
                continue
            try:
                held[sender] = self._opened(sender, sealed, associated)
            except SecAggRefusal:
                accused[sender] = pair_key
        if len(held) < state.threshold:
            raise SecAggRefusal(
                RejectionKind.UNSAFE_REQUEST, f"shares from {len(held)} neighbours, at least {state.threshold} needed"
            )
        self.state = dataclasses.replace(
            state, held_from=list(held), held_records=list(held.values()), accused=list(accused), stage=DELIVERED
        )
        return DeliveryAck(state.device_id, state.round_id, list(held), list(accused), list(accused.values()))

    def on_key_request(self, request: RecordKeyRequest) -> RecordKeyReveal:
        """A complaint against this device's records: the ephemeral secret of its record to each accuser, only for
        an accuser whose pair key is the pair's (so the accuser really complained: an honest one only does when the
        record did not open, which never happens to an honest sender, so the record revealed is one a dishonest
        accuser holds anyway)."""
        state = self.state
        check_addressed(state.device_id, request.device_id)
        check_round(state.round_id, request.round_id)
        if state.stage in (ADVERTISED, SHARED):
            raise SecAggRefusal(
                RejectionKind.WRONG_STAGE, f"a complaint arrived while the round is in stage {state.stage!r}"
            )
        check_pairs(request.accusers, request.pair_keys, "the complaint")
        check_within(
            request.accusers, state.neighbours, RejectionKind.UNSAFE_REQUEST, "complaints from non-neighbours:"
        )
        wrong = sorted(
            accuser
            for accuser, key in zip(request.accusers, request.pair_keys)
            if not hmac.compare_digest(self._pair_key(accuser, keys.RECORD_PURPOSE), key)
        )
        if wrong:
            raise SecAggRefusal(
                RejectionKind.UNSAFE_REQUEST, f"complaints from {wire.shown_names(wrong)} without the pair key"
            )
        secrets = [keys.record_ephemeral(state.cipher_secret, state.context, accuser) for accuser in request.accusers]
        return RecordKeyReveal(state.device_id, state.round_id, list(request.accusers), secrets)

    def on_mask_request(self, request: MaskRequest) -> None:
        """Stage 3's start: the neighbours still in the round become the device's mask partners (less any it
        accused), once it holds at least `threshold` of their records."""
        state = self.state
        self._check(request.device_id, request.round_id, DELIVERED, "a mask request")
        check_unique(request.partners, "the mask request")
        check_within(request.partners, state.neighbours, RejectionKind.UNSAFE_REQUEST, "names non-neighbours:")
        partners = sorted(set(request.partners) - set(state.accused))
        held = [peer for peer in state.held_from if peer in partners]
        if len(held) < state.threshold:
            raise SecAggRefusal(
                RejectionKind.UNSAFE_REQUEST, f"shares from {len(held)} partners, at least {state.threshold} needed"
            )
        self.state = dataclasses.replace(state, partners=partners, stage=PARTNERED)

    def masked_input(self, update: Weights) -> MaskedInput:
        """Stage 3: the update in fixed point, plus the self mask, plus a pairwise mask with every partner (whether
        or not its record arrived: whoever holds a share of this device's seed is a mask partner, so no share can be
        revealed without hiding a mask only that holder can take off)."""
        state = self.state
        check_stage(state.stage, PARTNERED, "a request to mask the update")
        encoded = FixedPoint(state.clip, state.max_summands).encode(flat(update))
        pairs = [(masks.pairwise_sign(state.device_id, peer), self._mask_seed(peer)) for peer in state.partners]
        vector = masks.masked(encoded, state.self_seed, pairs)
        self.state = dataclasses.replace(state, stage=MASKED)
        return MaskedInput(state.device_id, state.round_id, shaped(vector, layout_of(update)))

    def on_view(self, view: SurvivorView) -> ViewConfirmation:
        """Stage 4a: takes the coordinator's one view of which partners survived (the same view again gets the same
        answer; another is refused), confirms it to each surviving partner with a MAC only that partner can check
        (signed by its identity key on a provisioned fleet), and reveals the pairwise mask seed of each other
        partner."""
        state = self.state
        check_addressed(state.device_id, view.device_id)
        check_round(state.round_id, view.round_id)
        if state.stage == VIEWED and (sorted(view.survivors), view.survivor_count) != (
            state.view,
            state.survivor_count,
        ):
            raise SecAggRefusal(RejectionKind.UNSAFE_REQUEST, "a second, different view of the survivors")
        if state.stage != VIEWED:
            check_stage(state.stage, MASKED, "a survivor view")
        _check_view(state, view)
        survivors = sorted(view.survivors)
        dropped = [peer for peer in state.partners if peer not in survivors]
        tags = [
            keys.survivor_tag(self._pair_key(peer, keys.CONFIRM_PURPOSE), state.context, state.device_id, peer)
            for peer in survivors
        ]
        seeds = [self._mask_seed(peer) for peer in dropped]
        secret = self.identity.secret
        signatures = [
            sign(secret, confirmation_body(state.context, state.device_id, peer, tag))
            for peer, tag in zip(survivors, tags)
            if secret
        ]
        self.state = dataclasses.replace(state, view=survivors, survivor_count=view.survivor_count, stage=VIEWED)
        return ViewConfirmation(state.device_id, state.round_id, survivors, tags, dropped, seeds, signatures)

    def on_unmask(self, request: UnmaskRequest) -> UnmaskResponse:
        """Stage 4b: the seed share of each named neighbour that this device's view calls a survivor and that
        confirmed it saw this device survive (so it revealed no pairwise seed with this device); a neighbour whose
        confirmation does not check gets no share and is named in the answer (it alone is left out), with this
        device's pairwise seed with it where its own signature proves it sent that confirmation; a request outside
        the view or the records held is refused. The same request again gets the same answer."""
        state = self.state
        self._check(request.device_id, request.round_id, VIEWED, "an unmask request")
        check_pairs(request.senders, request.tags, "the unmask request")
        check_within(request.senders, state.view, RejectionKind.UNSAFE_REQUEST, "asks for shares of non-survivors")
        check_within(request.senders, state.held_from, RejectionKind.UNSAFE_REQUEST, "asks for shares not held:")
        if request.signatures:
            check_pairs(request.senders, request.signatures, "the unmask request's signatures")
        confirmed = [
            sender
            for sender, tag in zip(request.senders, request.tags)
            if keys.tag_valid(self._pair_key(sender, keys.CONFIRM_PURPOSE), state.context, sender, state.device_id, tag)
        ]
        refused = sorted(set(request.senders) - set(confirmed))
        proven = self._proven(request, refused)
        shares = [state.held_records[state.held_from.index(sender)] for sender in confirmed]
        seeds = [self._mask_seed(sender) for sender in proven]
        return UnmaskResponse(state.device_id, state.round_id, confirmed, shares, refused, proven, seeds)

    def _proven(self, request: UnmaskRequest, refused: list[str]) -> list[str]:
        """The refused senders whose confirmation that did not check came under their own valid identity signature:
        proof that they cheated (nobody else can sign for them), so this device's pairwise seed with each, which the
        cheat knows anyway, can go to the coordinator to take it out of the sum. Empty on an open fleet."""
        known, state = self.identity.roster, self.state
        if not known or not request.signatures:
            return []
        signatures = dict(zip(request.senders, request.signatures))
        tags = dict(zip(request.senders, request.tags))
        return [
            sender
            for sender in refused
            if sender in known
            and signed(
                known[sender],
                signatures[sender],
                confirmation_body(state.context, sender, state.device_id, tags[sender]),
            )
        ]

    def _check_signed(self, roster: KeyRoster) -> None:
        """On a provisioned fleet, every neighbour in the roster with its own identity's signature over the keys
        given for it in this run and round: an unknown device or a bad signature (the coordinator inventing a
        neighbour, or an impostor's keys) is refused, naming it."""
        known = self.identity.roster
        if not known:
            return
        check_pairs(roster.neighbours, roster.signatures, "the roster's signatures")
        context = keys.round_context(roster.run_id, roster.round_id)
        adverts = list(zip(roster.neighbours, roster.cipher_keys, roster.mask_keys, roster.signatures))
        unknown, forged = unsigned(known, context, adverts)
        if unknown:
            raise SecAggRefusal(
                RejectionKind.UNKNOWN_DEVICE, f"neighbours {wire.shown_names(unknown)} have no identity in this fleet"
            )
        if forged:
            raise SecAggRefusal(
                RejectionKind.BAD_SIGNATURE,
                f"the keys of neighbours {wire.shown_names(forged)} are not signed by their identity keys",
            )

    def _check(self, addressee: str, round_id: int, stage: str, what: str) -> None:
        check_addressed(self.state.device_id, addressee)
        check_round(self.state.round_id, round_id)
        check_stage(self.state.stage, stage, what)

    def _opened(self, sender: str, sealed: bytes, associated: bytes) -> bytes:
        """A neighbour's authentic record, opened with its ephemeral key and checked to be one share."""
        state = self.state
        share = keys.open_record(state.cipher_secret, sealed[: keys.KEY_BYTES], sealed, associated, state.context)
        shamir.Share.from_bytes(share)
        return share

    def _mask_seed(self, peer: str) -> bytes:
        state = self.state
        return keys.agreed_key(state.mask_secret, state.peer_key(peer, False), keys.MASK_PURPOSE, state.context)

    def _pair_key(self, peer: str, purpose: bytes) -> bytes:
        state = self.state
        return keys.agreed_key(state.cipher_secret, state.peer_key(peer, True), purpose, state.context)


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
    """Shares of the self-mask seed (x = the neighbour's place in the sorted list, 1-based), sealed per neighbour,
    and the seed's commitment. The mask key is not shared: a dropped neighbour's masks are taken out by the
    survivors revealing their own pairwise seeds with it."""
    shares = shamir.split(state.self_seed, state.threshold, len(state.neighbours))
    sealed = [
        keys.seal_record(
            state.cipher_secret, state.peer_key(peer, True), state.context, state.device_id, peer, share.to_bytes()
        )
        for peer, share in zip(state.neighbours, shares)
    ]
    commitment = masks.seed_commitment(state.context, state.device_id, state.self_seed)
    return ShareBundle(state.device_id, state.round_id, list(state.neighbours), sealed, commitment)


def _check_view(state: DeviceSecAggState, view: SurvivorView) -> None:
    """A view an honest device confirms: surviving neighbours named once each, none outside its roster, not itself,
    and at least the round's minimum of survivors in all (else the sum would be too few devices' updates)."""
    check_unique(view.survivors, "the survivor view")
    check_within(view.survivors, state.partners, RejectionKind.UNSAFE_REQUEST, "calls non-partners survivors:")
    if view.survivor_count < max(state.min_survivors, len(view.survivors) + 1):
        raise SecAggRefusal(
            RejectionKind.UNSAFE_REQUEST,
            f"{wire.shown(view.survivor_count)} survivors with {len(view.survivors)} surviving neighbours and this "
            f"device (at least {state.min_survivors})",
        )
