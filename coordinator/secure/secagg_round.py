# A secure round's saved state on the coordinator and what every stage shares: its graph, threshold, context, the
# checks on a device's message, and abandoning the round without revealing anything.
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import ClassVar, NoReturn

import numpy as np

from protocol import wire
from protocol.messages import RejectionKind, Tensors
from protocol.secagg import graph, keys
from protocol.secagg.checks import check_round, check_stage
from protocol.secagg.errors import SecAggAbandoned, SecAggRefusal
from protocol.secagg.fixed_point import FixedPoint

KEYS, SHARES, CHECK, RESOLVE, MASKED = "keys", "shares", "check", "resolve", "masked"
VIEW, UNMASK = "view", "unmask"
DONE, ABANDONED = "done", "abandoned"
SECRETS = (
    *("share_ciphertexts", "seed_owners", "seed_holders", "seed_shares"),
    *("pair_owners", "pair_peers", "pair_seeds", "proven_seeds"),
)


@dataclass
class SecAggSettings:
    """A secure round's public settings: the clip of the fixed-point range, the fewest survivors whose sum may be
    revealed, the seed the neighbour graph is drawn from (public: anyone can redraw the graph), the dropout
    fraction the graph's degree is chosen to survive, and the fleet's identity public keys by device id (a
    provisioned fleet's: each key advert must carry its device's signature; empty: adverts go unchecked)."""

    clip: float = 1.0
    min_survivors: int = 2
    graph_seed: bytes = b""
    dropout: float = 0.3
    identities: Mapping[str, bytes] = field(default_factory=dict)


@dataclass
class ServerSecAggState:
    """All a coordinator holds in a secure round, saved with the round: public keys, sealed shares it routes and
    cannot open, who holds whose record, complaints and the devices they excluded (with why), the devices that
    mask, the running masked sum (never one device's input), the survivors' confirmations it routes, the pairwise
    seeds survivors revealed with dropped partners, the seed shares sent back, and whose confirmation each holder
    said did not check (`refused_owners`, by `refusing_holders`), and the pairwise seeds holders gave with a sender
    whose signed confirmation did not check (`proven_*`), so that sender can be taken back out of the sum. `identities` holds the identity
    public key of each selected device in its order (empty on an open fleet), `signatures` each advert's."""

    KIND: ClassVar[str] = "secagg_server_state"
    run_id: str
    round_id: int
    stage: str
    graph_seed: bytes
    clip: float
    min_survivors: int
    dropout: float
    selected: list[str]
    masked_sum: Tensors
    advertised: list[str] = field(default_factory=list)
    cipher_keys: list[bytes] = field(default_factory=list)
    mask_keys: list[bytes] = field(default_factory=list)
    identities: list[bytes] = field(default_factory=list)
    signatures: list[bytes] = field(default_factory=list)
    sharers: list[str] = field(default_factory=list)
    commitments: list[bytes] = field(default_factory=list)
    share_senders: list[str] = field(default_factory=list)
    share_recipients: list[str] = field(default_factory=list)
    share_ciphertexts: list[bytes] = field(default_factory=list)
    ackers: list[str] = field(default_factory=list)
    held_owners: list[str] = field(default_factory=list)
    held_holders: list[str] = field(default_factory=list)
    accusers: list[str] = field(default_factory=list)
    accused: list[str] = field(default_factory=list)
    pair_keys: list[bytes] = field(default_factory=list)
    revealers: list[str] = field(default_factory=list)
    excluded: list[str] = field(default_factory=list)
    exclusion_reasons: list[str] = field(default_factory=list)
    exclusion_kinds: list[str] = field(default_factory=list)
    maskers: list[str] = field(default_factory=list)
    masked_from: list[str] = field(default_factory=list)
    viewers: list[str] = field(default_factory=list)
    tag_senders: list[str] = field(default_factory=list)
    tag_recipients: list[str] = field(default_factory=list)
    tags: list[bytes] = field(default_factory=list)
    tag_signatures: list[bytes] = field(default_factory=list)
    pair_owners: list[str] = field(default_factory=list)
    pair_peers: list[str] = field(default_factory=list)
    pair_seeds: list[bytes] = field(default_factory=list)
    responders: list[str] = field(default_factory=list)
    seed_owners: list[str] = field(default_factory=list)
    seed_holders: list[str] = field(default_factory=list)
    seed_shares: list[bytes] = field(default_factory=list)
    refused_owners: list[str] = field(default_factory=list)
    refusing_holders: list[str] = field(default_factory=list)
    proven_owners: list[str] = field(default_factory=list)
    proven_holders: list[str] = field(default_factory=list)
    proven_seeds: list[bytes] = field(default_factory=list)


class SecAggRound:
    """The state of one secure round and what all its stages need (the stages themselves are SecAggServer's). On a
    provisioned fleet `inputs` keeps each masked input apart (flat, by device; in memory only, never saved: hidden
    by its self mask, which a proven cheat's seed never loses), to take a proven cheat back out of the sum; a
    process restarted after the masked inputs has none, and abandons a round that would need them."""

    def __init__(self, state: ServerSecAggState) -> None:
        self.state = state
        self.inputs: dict[str, np.ndarray] = {}

    def snapshot(self) -> bytes:
        """The state as bytes, for the run's store."""
        return wire.encode_record(self.state)

    @cached_property
    def graph(self) -> dict[str, list[str]]:
        """The neighbour graph over the devices that advertised keys, drawn from the public seed."""
        advertised = self.state.advertised
        return graph.neighbours(advertised, self.state.graph_seed, self.degree)

    @property
    def degree(self) -> int:
        """Neighbours per device, for the devices that advertised keys and the dropout the round must survive."""
        return graph.degree_for(len(self.state.advertised), self.state.dropout)

    @property
    def threshold(self) -> int:
        """Shares that rebuild a secret: a strict majority of each device's neighbours."""
        return graph.threshold_for(self.degree)

    @property
    def fixed_point(self) -> FixedPoint:
        """The round's fixed-point encoding: its clip, room for every selected device's input."""
        return FixedPoint(self.state.clip, max(len(self.state.selected), 1))

    @property
    def context(self) -> bytes:
        """The round's binding for keys, seals and commitments."""
        return keys.round_context(self.state.run_id, self.state.round_id)

    def partners(self, device: str) -> list[str]:
        """The device's neighbours that were asked to mask (its mask partners), sorted."""
        return sorted(set(self.state.maskers).intersection(self.graph[device]))

    @cached_property
    def held_by(self) -> dict[str, set[str]]:
        """Who acknowledged holding each owner's record (fixed once the delivery check closes)."""
        held: dict[str, set[str]] = {}
        for owner, holder in zip(self.state.held_owners, self.state.held_holders):
            held.setdefault(owner, set()).add(holder)
        return held

    def holders(self, owner: str, among: set[str]) -> set[str]:
        """The owner's partners among `among` that hold its record (they can give a share of its seed)."""
        return self.held_by.get(owner, set()).intersection(among, self.partners(owner))

    def _check(self, device: str, round_id: int, stage: str, what: str, allowed: list[str]) -> None:
        check_round(self.state.round_id, round_id)
        if device not in allowed:
            kind = RejectionKind.NOT_SELECTED if stage == KEYS else RejectionKind.WRONG_STAGE
            raise SecAggRefusal(kind, f"{what} from {wire.shown(device)}, which is not in this stage of the round")
        check_stage(self.state.stage, stage, what)

    @staticmethod
    def _once(device: str, done: list[str], what: str) -> None:
        if device in done:
            raise SecAggRefusal(RejectionKind.DUPLICATE, f"{wire.shown(device)} already sent {what} this round")

    def _enough(self, devices: list[str], what: str) -> None:
        if len(devices) < self.state.min_survivors:
            self._abandon(f"{len(devices)} devices {what}, at least {self.state.min_survivors} must")

    def _exclude(self, device: str, reason: str, kind: RejectionKind = RejectionKind.FORGED_SHARE) -> None:
        """Takes a device out of the round (once), with a bounded reason naming what it did and its rejection kind."""
        state = self.state
        if device not in state.excluded:
            state.excluded.append(device)
            state.exclusion_reasons.append(f"{wire.shown(device)} {reason}"[:300])
            state.exclusion_kinds.append(kind)

    def exclusions(self) -> list[tuple[str, str, RejectionKind]]:
        """Each excluded device with its reason and rejection kind (forged_share where a saved round predates kinds)."""
        state = self.state
        kinds = [*state.exclusion_kinds, *[RejectionKind.FORGED_SHARE] * len(state.excluded)]
        return [(d, r, RejectionKind(k)) for d, r, k in zip(state.excluded, state.exclusion_reasons, kinds)]

    def refuse(self, reason: str) -> NoReturn:
        """Ends a finished round unrevealed after all (its unmasked sum failed a check): abandoned, with `reason`."""
        self._abandon(reason)

    def _abandon(self, reason: str) -> NoReturn:
        """Drops everything that could unmask anything (the sum, the shares) and ends the round unrevealed."""
        state = self.state
        state.stage = ABANDONED
        state.masked_sum = {name: np.zeros_like(array) for name, array in state.masked_sum.items()}
        for name in SECRETS:
            setattr(state, name, [])
        self.inputs = {}
        raise SecAggAbandoned(reason)
