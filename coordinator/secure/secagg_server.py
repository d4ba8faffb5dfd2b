# The coordinator's side of secure aggregation (SecAgg+) as a state machine over the four stages: it routes sealed
# shares, keeps only the running masked sum, and unmasks the sum alone, or abandons the round and reveals nothing.
from __future__ import annotations

import numpy as np

from coordinator.secure.secagg_complaints import ComplaintStage
from coordinator.secure.secagg_round import CHECK, KEYS, MASKED, SHARES, SecAggSettings, ServerSecAggState
from coordinator.secure.secagg_unmask import UnmaskStage
from protocol import wire
from protocol.messages import KeyAdvert, KeyRoster, MaskedInput, RejectionKind, ShareBundle, ShareDelivery
from protocol.secagg import graph, keys, shamir
from protocol.secagg.checks import check_pairs, check_stage, check_within
from protocol.secagg.errors import SecAggRefusal
from protocol.secagg.fixed_point import FixedPoint, flat, layout_of
from protocol.secagg.identity import advert_signed
from protocol.tensors import Weights

# the ephemeral public key, the nonce, the seed share, the GCM tag, the pair's MAC
SEALED_BYTES = keys.KEY_BYTES + keys.NONCE_BYTES + shamir.SHARE_BYTES + 16 + keys.TAG_BYTES


class SecAggServer(ComplaintStage, UnmaskStage):
    """One secure round on the coordinator: `on_*` take the devices' messages (a refused one raises SecAggRefusal),
    and each stage closes with the coordinator's messages for the next (`rosters`, `deliveries`, `key_requests`,
    `mask_requests`, `view_requests`, `unmask_requests`) and finally `finish`; a round that cannot stay safe raises
    SecAggAbandoned."""

    @classmethod
    def start(
        cls, run_id: str, round_id: int, selected: list[str], layout: Weights, settings: SecAggSettings
    ) -> SecAggServer:
        """A round over the selected devices whose update has the layout of `layout`'s tensors (settings that do
        not fit, a clip too wide for the fleet or a dropout of one half or more, are a UsageError)."""
        zeros = {name: np.zeros(shape, np.uint32) for name, shape in layout_of(layout).items()}
        FixedPoint(settings.clip, max(len(selected), 1))
        graph.degree_for(len(selected), settings.dropout)
        known = settings.identities
        state = ServerSecAggState(
            run_id,
            round_id,
            KEYS,
            settings.graph_seed,
            settings.clip,
            settings.min_survivors,
            settings.dropout,
            sorted(selected),
            zeros,
            identities=[known.get(device, b"") for device in sorted(selected)] if known else [],
        )
        return cls(state)

    @classmethod
    def restored(cls, snapshot: bytes) -> SecAggServer:
        """The round a snapshot saved (after a coordinator restart)."""
        return cls(wire.decode_record(snapshot, ServerSecAggState))

    def on_keys(self, advert: KeyAdvert) -> None:
        """Stage 1: a selected device's public keys, once (the same message again is a replay), signed by its
        identity key on a provisioned fleet (an unsigned or badly signed advert is refused, naming its sender)."""
        state = self.state
        self._check(advert.device_id, advert.round_id, KEYS, "a key advert", state.selected)
        if advert.device_id in state.advertised:
            index = state.advertised.index(advert.device_id)
            same = (state.cipher_keys[index], state.mask_keys[index]) == (advert.cipher_key, advert.mask_key)
            kind = RejectionKind.REPLAY if same else RejectionKind.DUPLICATE
            raise SecAggRefusal(kind, f"{wire.shown(advert.device_id)} already advertised its keys this round")
        if {len(advert.cipher_key), len(advert.mask_key)} != {keys.KEY_BYTES}:
            raise SecAggRefusal(RejectionKind.UNDECODABLE, f"public keys have {keys.KEY_BYTES} bytes")
        self._check_signed(advert)
        state.advertised.append(advert.device_id)
        state.cipher_keys.append(advert.cipher_key)
        state.mask_keys.append(advert.mask_key)
        state.signatures.append(advert.signature)

    def _check_signed(self, advert: KeyAdvert) -> None:
        """On a provisioned fleet, the advert carries its device's identity signature over this round and its keys."""
        state = self.state
        if not state.identities:
            return
        public = state.identities[state.selected.index(advert.device_id)]
        if not public:
            raise SecAggRefusal(
                RejectionKind.UNKNOWN_DEVICE, f"{wire.shown(advert.device_id)} has no identity key in this fleet"
            )
        if not advert_signed(
            public, advert.signature, self.context, advert.device_id, advert.cipher_key, advert.mask_key
        ):
            raise SecAggRefusal(
                RejectionKind.BAD_SIGNATURE,
                f"the key advert of {wire.shown(advert.device_id)} is not signed by its identity key",
            )

    def rosters(self) -> list[KeyRoster]:
        """Closes stage 1: each advertising device's neighbours and their keys."""
        check_stage(self.state.stage, KEYS, "the close of the key stage")
        self._enough(self.state.advertised, "advertised keys")
        self.__dict__.pop("graph", None)
        state, index = self.state, {device: i for i, device in enumerate(self.state.advertised)}
        state.stage = SHARES
        rosters = []
        for device in state.advertised:
            peers = self.graph[device]
            rosters.append(
                KeyRoster(
                    state.run_id,
                    device,
                    state.round_id,
                    state.graph_seed,
                    self.threshold,
                    state.min_survivors,
                    state.clip,
                    len(state.selected),
                    len(state.advertised),
                    peers,
                    [state.cipher_keys[index[p]] for p in peers],
                    [state.mask_keys[index[p]] for p in peers],
                    [state.signatures[index[p]] for p in peers] if state.signatures else [],
                )
            )
        return rosters

    def on_shares(self, bundle: ShareBundle) -> None:
        """Stage 2: a device's sealed records, one for each of its neighbours and none for anyone else."""
        state = self.state
        self._check(bundle.device_id, bundle.round_id, SHARES, "a share bundle", state.advertised)
        self._once(bundle.device_id, state.sharers, "shares")
        check_pairs(bundle.recipients, bundle.ciphertexts, "the bundle")
        peers = self.graph[bundle.device_id]
        check_within(bundle.recipients, peers, RejectionKind.WRONG_RECIPIENT, "shares addressed to non-neighbours")
        check_within(peers, bundle.recipients, RejectionKind.WRONG_RECIPIENT, "no shares for neighbours")
        if any(len(sealed) != SEALED_BYTES for sealed in bundle.ciphertexts) or len(bundle.seed_commitment) != 32:
            raise SecAggRefusal(RejectionKind.UNDECODABLE, f"a sealed record has {SEALED_BYTES} bytes, a commitment 32")
        state.sharers.append(bundle.device_id)
        state.commitments.append(bundle.seed_commitment)
        state.share_senders += [bundle.device_id] * len(bundle.recipients)
        state.share_recipients += bundle.recipients
        state.share_ciphertexts += bundle.ciphertexts

    def deliveries(self) -> list[ShareDelivery]:
        """Closes stage 2: each device that shared gets the records its sharing neighbours sealed for it (kept until
        the complaints about them are settled)."""
        state = self.state
        check_stage(state.stage, SHARES, "the close of the share stage")
        self._enough(state.sharers, "shared their keys")
        state.stage = CHECK
        self.__dict__.pop("inboxes", None)
        inboxes = {device: self.inboxes.get(device, {}) for device in state.sharers}
        return [ShareDelivery(d, state.round_id, list(inbox), list(inbox.values())) for d, inbox in inboxes.items()]

    def on_masked(self, message: MaskedInput) -> None:
        """Stage 3: one masked input per device asked to mask, added to the running sum at once (on a provisioned
        fleet also kept apart in memory, still masked, so a proven cheat can be taken back out)."""
        state = self.state
        self._check(message.device_id, message.round_id, MASKED, "a masked input", state.maskers)
        self._once(message.device_id, state.masked_from, "a masked input")
        expected = {name: (array.shape, np.dtype(np.uint32)) for name, array in state.masked_sum.items()}
        if {name: (array.shape, array.dtype) for name, array in message.masked.items()} != expected:
            raise SecAggRefusal(RejectionKind.TENSOR_MISMATCH, "masked tensors differ from the round's uint32 layout")
        for name, array in message.masked.items():
            state.masked_sum[name] = state.masked_sum[name] + array
        if state.identities:
            self.inputs[message.device_id] = flat(message.masked)
        state.masked_from.append(message.device_id)
