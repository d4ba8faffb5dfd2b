# Secure aggregation's wire messages (SecAgg+'s stages, both ways); `messages` lists them among the wire's kinds.
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from protocol.tensors import Weights


@dataclass(frozen=True)
class KeyAdvert:
    """Secure aggregation, stage 1, device to coordinator: the device's two X25519 public keys for this round, one
    that seals the shares it sends and one that agrees its pairwise masks, and on a provisioned fleet its identity
    key's Ed25519 signature over the run, round, device id and both keys (empty on an open fleet)."""

    KIND: ClassVar[str] = "secagg_keys"
    device_id: str
    round_id: int
    cipher_key: bytes
    mask_key: bytes
    signature: bytes = b""


@dataclass(frozen=True)
class KeyRoster:
    """Stage 1's answer, coordinator to one device: the round's secure-aggregation settings and its neighbours' public
    keys (the neighbour graph is drawn from `graph_seed` over the `advertised` devices that advertised keys; a device
    checks its neighbour count is what the recipe's dropout gives for that many), each with the neighbour's own
    signature of its advert (a device on a provisioned fleet checks each against the fleet's identity roster)."""

    KIND: ClassVar[str] = "secagg_roster"
    run_id: str
    device_id: str
    round_id: int
    graph_seed: bytes
    threshold: int
    min_survivors: int
    clip: float
    max_summands: int
    advertised: int
    neighbours: list[str]
    cipher_keys: list[bytes]
    mask_keys: list[bytes]
    signatures: list[bytes] = field(default_factory=list)


@dataclass(frozen=True)
class ShareBundle:
    """Stage 2, device to coordinator: one sealed share record per neighbour (a share of its self-mask seed,
    readable by that neighbour only) and a SHA-256 commitment to the seed."""

    KIND: ClassVar[str] = "secagg_shares"
    device_id: str
    round_id: int
    recipients: list[str]
    ciphertexts: list[bytes]
    seed_commitment: bytes


@dataclass(frozen=True)
class ShareDelivery:
    """Stage 2's answer, coordinator to one device: the sealed share records its neighbours addressed to it."""

    KIND: ClassVar[str] = "secagg_delivery"
    device_id: str
    round_id: int
    senders: list[str]
    ciphertexts: list[bytes]


@dataclass(frozen=True)
class DeliveryAck:
    """Stage 2's answer, device to coordinator: whose records it holds, and a complaint against each sender whose
    record carried the pair's MAC but did not open as one share, with the pair's record key as its proof (the
    coordinator checks the MAC with it; the accused sender checks it is the pair's before settling the complaint)."""

    KIND: ClassVar[str] = "secagg_ack"
    device_id: str
    round_id: int
    held: list[str]
    accused: list[str]
    pair_keys: list[bytes]


@dataclass(frozen=True)
class RecordKeyRequest:
    """A complaint to settle, coordinator to the accused sender: the accusers and the pair keys they gave."""

    KIND: ClassVar[str] = "secagg_key_request"
    device_id: str
    round_id: int
    accusers: list[str]
    pair_keys: list[bytes]


@dataclass(frozen=True)
class RecordKeyReveal:
    """The accused sender's answer: the ephemeral secret of its record to each accuser, so the coordinator opens
    that record and tells who lied."""

    KIND: ClassVar[str] = "secagg_key_reveal"
    device_id: str
    round_id: int
    accusers: list[str]
    ephemeral_secrets: list[bytes]


@dataclass(frozen=True)
class MaskRequest:
    """Stage 3's start, coordinator to one device: the neighbours it masks with (those still in the round: not
    excluded by a complaint, not silent)."""

    KIND: ClassVar[str] = "secagg_mask"
    device_id: str
    round_id: int
    partners: list[str]


@dataclass(frozen=True)
class MaskedInput:
    """Stage 3, device to coordinator: its fixed-point update plus its self mask and pairwise masks (uint32)."""

    KIND: ClassVar[str] = "secagg_masked"
    device_id: str
    round_id: int
    masked: Weights


@dataclass(frozen=True)
class SurvivorView:
    """Stage 4a, coordinator to one surviving device: which of its neighbours survived (sent a masked input), and
    how many survived in all. The device keeps this one view for the round and answers by it."""

    KIND: ClassVar[str] = "secagg_view"
    device_id: str
    round_id: int
    survivors: list[str]
    survivor_count: int


@dataclass(frozen=True)
class ViewConfirmation:
    """Stage 4a's answer, device to coordinator: for each neighbour its view calls a survivor, a MAC (under a key
    only the two share) saying so, for the coordinator to route to it; for each other neighbour, the pairwise mask
    seed the device masked with, so the coordinator can take that mask out of the sum. On a provisioned fleet each
    confirmation carries the device's identity signature over it (`signatures`, one per recipient), routed with it:
    a recipient holds a confirmation that does not check under a valid one as proof of who sent it."""

    KIND: ClassVar[str] = "secagg_confirm"
    device_id: str
    round_id: int
    recipients: list[str]
    tags: list[bytes]
    dropped: list[str]
    pair_seeds: list[bytes]
    signatures: list[bytes] = field(default_factory=list)


@dataclass(frozen=True)
class UnmaskRequest:
    """Stage 4b, coordinator to one surviving device: the surviving neighbours whose self-mask seed shares are asked,
    each with its confirmation that it saw this device survive (and, on a provisioned fleet, that neighbour's
    identity signature over the confirmation)."""

    KIND: ClassVar[str] = "secagg_unmask"
    device_id: str
    round_id: int
    senders: list[str]
    tags: list[bytes]
    signatures: list[bytes] = field(default_factory=list)


@dataclass(frozen=True)
class UnmaskResponse:
    """Stage 4b's answer, device to coordinator: the seed shares it was asked for and agreed to give, the senders
    whose confirmation did not check (their shares withheld: only they are left out), and of those the ones whose
    confirmation came under their own valid identity signature (`proven`: they cheated, and know the pairwise seed
    anyway), each with this device's pairwise seed with it, so the coordinator can take it out of the sum."""

    KIND: ClassVar[str] = "secagg_reveal"
    device_id: str
    round_id: int
    seed_owners: list[str]
    seed_shares: list[bytes]
    refused: list[str] = field(default_factory=list)
    proven: list[str] = field(default_factory=list)
    pair_seeds: list[bytes] = field(default_factory=list)
